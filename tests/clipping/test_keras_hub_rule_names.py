"""keras-hub layer rules are keyed by keras-hub's public names where it exports the class
(keras_hub.layers.ReversibleEmbedding, PositionEmbedding), resolved only once keras_hub has
been imported by the user; classes it does not export keep their private module path."""

import subprocess
import sys

import pytest

from tf_dp.clipping import registry
from tf_dp.clipping.normalization import GemmaRMSNormalizationRule
from tf_dp.clipping.position_embedding import PositionEmbeddingRule
from tf_dp.clipping.reversible_embedding import ReversibleEmbeddingRule


def test_importing_tf_dp_does_not_import_keras_hub():
    code = ("import sys, tf_dp, tf_dp.clipping; from tf_dp.clipping import registry; "
            "assert 'keras_hub' not in sys.modules, 'keras_hub imported'; "
            "print(sorted(registry._RULES_BY_PUBLIC_NAME))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "keras_hub.layers.ReversibleEmbedding" in done.stdout
    assert "keras_hub.layers.PositionEmbedding" in done.stdout


def test_a_public_name_whose_package_is_not_loaded_stays_pending_and_imports_nothing():
    name = "tf_dp_test_absent_package.layers.Layer"
    registry.register_ghost_rule_by_public_name(name, PositionEmbeddingRule())
    try:
        import keras
        registry.ghost_rule_for(keras.layers.Dense(2))
        assert name in registry._RULES_BY_PUBLIC_NAME
        assert "tf_dp_test_absent_package" not in sys.modules
    finally:
        registry._RULES_BY_PUBLIC_NAME.pop(name, None)
    with pytest.raises(ValueError, match="module.Attribute"):
        registry.register_ghost_rule_by_public_name("NoModule", PositionEmbeddingRule())


def test_keras_hub_layers_get_their_rules_through_public_and_private_names():
    keras_hub = pytest.importorskip("keras_hub")
    from keras_hub.src.models.gemma.rms_normalization import RMSNormalization as GemmaRMSNormalization

    reversible = keras_hub.layers.ReversibleEmbedding(11, 4, tie_weights=True)
    position = keras_hub.layers.PositionEmbedding(sequence_length=5)
    norm = GemmaRMSNormalization()
    for layer, shape in [(reversible, (None, 5)), (position, (None, 5, 4)), (norm, (None, 4))]:
        layer.build(shape)
    assert isinstance(registry.ghost_rule_for(reversible), ReversibleEmbeddingRule)
    assert isinstance(registry.ghost_rule_for(position), PositionEmbeddingRule)
    assert type(registry._RULES[keras_hub.layers.ReversibleEmbedding]) is ReversibleEmbeddingRule  # by the class
    assert not any(name.startswith("keras_hub.layers.") for name in registry._RULES_BY_PUBLIC_NAME)
    assert not any("reversible_embedding" in name or "position_embedding" in name
                   for name in registry._RULES_BY_NAME)  # no private path for an exported class
    assert isinstance(registry.ghost_rule_for(norm), GemmaRMSNormalizationRule)
