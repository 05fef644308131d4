"""Rounding bounds from counts known at trace time are float64 constants, bit for bit the ops'.

The certified norms (docs/algorithms.md §6) raise each squared norm by 1 + γ_n. With the
count n static, ``tf_dp.clipping.rounding`` computes γ_n in Python float64 — the same
IEEE operations in the same order as the graph's ops — and uses static paddings and
reshapes, so the traced step has fewer ops. The reference is the same code with folding
off (``FOLD_STATIC_COUNTS = False``: every count from tf.shape, as before): the clip
factors' inputs (the certified squared norms) and the clipped sums must agree bit for bit.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.harness import sparse_ce
from tf_dp.clipping import clipped_gradient_sum, rounding
from tf_dp.models.losses import per_example_loss

COUNTS = [0, 1, 2, 15, 16, 17, 1000, 12_544 ** 2 + 9_408, 2 ** 22, 2 ** 23 - 1, 2 ** 23, 2 ** 24, 2 ** 52, -3]


def bits(values) -> np.ndarray:
    return np.asarray(values, np.float64).view(np.uint64)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64], ids=["float32", "float64"])
def test_gamma_of_a_static_count_is_the_graph_value_bit_for_bit(dtype):
    graph = tf.function(lambda n: rounding.gamma(n, dtype), input_signature=[tf.TensorSpec([], tf.int64)])
    for n in COUNTS:
        folded = rounding.gamma(n, dtype)
        assert folded.dtype == tf.float64 and rounding.gamma_value(n, dtype) is not None
        assert bits(folded.numpy()) == bits(graph(tf.constant(n, tf.int64)).numpy()), n
    assert np.isinf(rounding.gamma(2 ** 23, tf.float32).numpy())  # n·u = 1/2: no bound
    assert np.isfinite(rounding.gamma(2 ** 23 - 1, tf.float32).numpy())


def _traced(function, *args, fold: bool, monkeypatch):
    """``function(*args)`` in a fresh tf.function traced with folding on or off, and its op count."""
    monkeypatch.setattr(rounding, "FOLD_STATIC_COUNTS", fold)
    traced = tf.function(function)
    concrete = traced.get_concrete_function(*args)
    graph_def = concrete.graph.as_graph_def()
    ops = len(graph_def.node) + sum(len(f.node_def) for f in graph_def.library.function)
    return tf.nest.map_structure(lambda t: t.numpy(), traced(*args)), ops


@pytest.mark.parametrize("shape", [(4, 16), (4, 5000), (4, 37), (3, 2, 19), (5, 7, 48)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_squared_sum_with_static_shapes_is_bit_identical_and_smaller(shape, dtype, monkeypatch):
    x = tf.constant(np.random.default_rng(0).normal(size=shape) * 1e3, dtype)
    folded, folded_ops = _traced(rounding.squared_sum, x, fold=True, monkeypatch=monkeypatch)
    reference, reference_ops = _traced(rounding.squared_sum, x, fold=False, monkeypatch=monkeypatch)
    np.testing.assert_array_equal(bits(folded), bits(reference))
    assert folded_ops < reference_ops
    exact = np.sum(np.asarray(x, np.float64) ** 2, axis=-1)
    assert np.all(folded >= exact)  # still an upper bound (independent float64 sum)


def mlp():
    inputs = keras.Input((20,))
    return keras.Model(inputs, keras.layers.Dense(5)(keras.layers.Dense(16, activation="tanh")(inputs)))


def cnn():
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(4, 3, activation="relu")(inputs)
    h = keras.layers.DepthwiseConv2D(3)(h)
    return keras.Model(inputs, keras.layers.Dense(5)(keras.layers.Flatten()(h)))


def sequence():
    """Embedding (repeated ids), Dense on [P, T, d] (the T-position rules), LayerNorm, EinsumDense."""
    inputs = keras.Input((12,), dtype="int32")
    h = keras.layers.Embedding(30, 8)(inputs)
    h = keras.layers.Dense(24, activation="tanh")(h)
    h = keras.layers.LayerNormalization()(h)
    h = keras.layers.EinsumDense("btd,de->bte", output_shape=(None, 6))(h)
    return keras.Model(inputs, keras.layers.Dense(5)(keras.layers.GlobalAveragePooling1D()(h)))


MODELS = {"mlp": (mlp, (20,), "float32"), "cnn": (cnn, (8, 8, 3), "float32"), "sequence": (sequence, (12,), "int32")}


@pytest.mark.parametrize("engine", ["ghost", "vectorized"])
@pytest.mark.parametrize("name", list(MODELS))
def test_clipped_sums_and_norms_are_bit_identical_with_fewer_ops(name, engine, monkeypatch):
    build, shape, dtype = MODELS[name]
    keras.utils.set_random_seed(0)
    model = build()
    rng = np.random.default_rng(1)
    x = rng.integers(0, 30, (1, 6, *shape)) if dtype == "int32" else rng.normal(size=(1, 6, *shape)) * 3.0
    x = tf.constant(x, dtype)
    y = tf.constant(rng.integers(0, 5, (1, 6)), tf.int32)
    mask = tf.constant([[1.0, 1.0, 1.0, 1.0, 1.0, 0.0]])
    loss = per_example_loss(sparse_ce)

    def step(x, y, mask):
        batch = clipped_gradient_sum(model, loss, x[0], y[0], mask[0], 0.7, engine=engine)
        return batch.squared_norms, batch.clipped_sums

    folded, folded_ops = _traced(step, x, y, mask, fold=True, monkeypatch=monkeypatch)
    reference, reference_ops = _traced(step, x, y, mask, fold=False, monkeypatch=monkeypatch)
    np.testing.assert_array_equal(folded[0], reference[0])
    for a, b in zip(folded[1], reference[1]):
        np.testing.assert_array_equal(a, b)
    assert np.all(np.isfinite(folded[0])) and np.any(folded[0] > 0)
    if engine == "ghost":
        assert folded_ops < reference_ops
