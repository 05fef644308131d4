"""The affine normalization rules (tf_dp/clipping/normalization.py): RMSNormalization and
GroupNormalization (non-trivial γ) against the per-example loop."""

import keras
import numpy as np

from tests.clipping.rules.models import assert_ghost_matches_loop, uses_rule

BATCH, CLASSES = 4, 3


def test_rms_and_group_normalization_rules_match_loop():
    inputs = keras.Input((4, 4, 6))
    hidden = keras.layers.Conv2D(6, 3, padding="same")(inputs)
    hidden = keras.layers.GroupNormalization(groups=3)(hidden)
    hidden = keras.layers.RMSNormalization()(keras.layers.Dense(5)(hidden))
    model = keras.Model(inputs, keras.layers.Dense(CLASSES)(keras.layers.Flatten()(hidden)))
    assert uses_rule(model, keras.layers.GroupNormalization) and uses_rule(model, keras.layers.RMSNormalization)
    model.layers[2].gamma.assign(np.random.randn(6).astype("float32"))  # non-trivial γ
    assert_ghost_matches_loop(model, np.random.randn(BATCH, 4, 4, 6).astype("float32"))
