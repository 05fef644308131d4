"""The EinsumDense rule (tf_dp/clipping/einsum_dense.py): Dense-form equations (attention's
query/key/value/output projections) and general ones, biases on any axis, against the
per-example loop."""

import keras
import numpy as np

from tests.clipping.rules.models import assert_ghost_matches_loop, attention_model, uses_rule
from tf_dp.clipping import ghost_rule_for

BATCH, CLASSES = 4, 3


def test_einsum_dense_and_attention_use_ghost_rules_and_match_loop():
    from tf_dp.clipping.einsum_dense import dense_form

    assert dense_form("abc,cde->abde") == (1, 2) and dense_form("abcd,cde->abe") == (2, 1)
    assert dense_form("ab,bc->ac") == (1, 1) and dense_form("...b,bc->...c") == (1, 1)
    assert dense_form("abc,dc->abd") is None  # transposed kernel: not a Dense form
    model, x = attention_model()
    einsums = [layer for layer in model._flatten_layers() if isinstance(layer, keras.layers.EinsumDense)]
    assert len(einsums) == 5 and all(ghost_rule_for(layer) is not None for layer in einsums)
    assert_ghost_matches_loop(model, x)


def test_einsum_dense_bias_on_a_non_output_axis_matches_loop():
    inputs = keras.Input((3, 4))
    hidden = keras.layers.EinsumDense("abc,cd->abd", output_shape=(3, 5), bias_axes="b")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(CLASSES)(keras.layers.Flatten()(hidden)))
    assert_ghost_matches_loop(model, np.random.randn(BATCH, 3, 4).astype("float32"))


def test_general_einsum_dense_equations_match_loop():
    inputs = keras.Input((3, 4))
    query = keras.layers.EinsumDense("btd,ndh->btnh", output_shape=(3, 2, 5), bias_axes="nh")(inputs)
    back = keras.layers.EinsumDense("btnh,nhd->btd", output_shape=(3, 4), bias_axes="d")(keras.ops.tanh(query))
    spread = keras.layers.EinsumDense("...d,ndh->...nh", output_shape=(2, 3))(back)
    model = keras.Model(inputs, keras.layers.Dense(CLASSES)(keras.layers.Flatten()(spread)))
    assert uses_rule(model, keras.layers.EinsumDense)
    assert_ghost_matches_loop(model, np.random.randn(BATCH, 3, 4).astype("float32"))
