"""The noise draw's lean seed handling equals TensorFlow's own functions bit for bit.

``tf_dp.noise.gaussian`` builds the Philox key/counter from a seed pair with a handful of raw
ops instead of ``tf.random.experimental.stateless_fold_in`` / ``tf.random.stateless_normal``
(~4× fewer graph ops, a cheaper trace). The reference here is TensorFlow's public functions
called directly: every seed, every draw must be the same, eagerly, in a graph and under XLA.
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_dp.noise import gaussian

SEEDS = [(3, 7), (2**62 + 11, 5), (-5, 2**40)]
STREAMS = [0, -1, -2, 12345678901, 2**60 + 3]
SHAPES = [(7, 5), (3,), (2, 3, 4)]


@pytest.mark.parametrize("key, step", SEEDS)
def test_draw_seed_is_tf_fold_in(key, step):
    for stream in STREAMS:
        lean = gaussian.draw_seed(tf.constant(key, tf.int64), step, stream).numpy()
        reference = tf.random.experimental.stateless_fold_in(tf.constant([key, step], tf.int64),
                                                             tf.constant(stream, tf.int64), alg="philox").numpy()
        np.testing.assert_array_equal(lean, reference)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64, tf.bfloat16, tf.float16])
def test_philox_normal_is_tf_stateless_normal(dtype):
    for key, step in SEEDS:
        seed = tf.constant([key, step], tf.int64)
        lean = gaussian._philox_normal([9, 4], seed, dtype).numpy()
        reference = tf.random.stateless_normal([9, 4], seed=seed, dtype=dtype, alg="philox").numpy()
        np.testing.assert_array_equal(lean, reference)


def _reference_noise(tensors, stddev, key, step, replica, replicas):
    """add_gaussian_noise written with TensorFlow's public fold_in and stateless_normal."""
    noised = []
    for index, tensor in enumerate(tensors):
        stream = (index * 2**20 + replica) * 2**20 + replicas
        pair = tf.stack([tf.cast(key, tf.int64), tf.cast(step, tf.int64)])
        seed = tf.random.experimental.stateless_fold_in(pair, tf.constant(stream, tf.int64), alg="philox")
        draw = tf.random.stateless_normal(tf.shape(tensor), seed, dtype=tensor.dtype, alg="philox")
        noised.append(tensor + tf.cast(stddev, tensor.dtype) * draw)
    return noised


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_add_gaussian_noise_is_the_reference_draw(mode):
    tensors = [tf.fill(shape, 0.5) for shape in SHAPES]

    def lean(key, step):
        return gaussian.add_gaussian_noise(tensors, tf.constant(2.0), key, step, replica=1, replicas=3)

    def reference(key, step):
        return _reference_noise(tensors, 2.0, key, step, 1, 3)

    if mode != "eager":
        lean, reference = (tf.function(f, jit_compile=mode == "xla") for f in (lean, reference))
    key, step = tf.constant(2**61 + 99, tf.int64), tf.constant(4, tf.int64)
    outputs = lean(key, step)
    for got, want, shape in zip(outputs, reference(key, step), SHAPES):
        assert tuple(got.shape) == shape
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_the_traced_draw_has_static_shapes_and_few_ops():
    tensors = [tf.zeros(shape) for shape in SHAPES]
    graph = tf.function(lambda key, step: gaussian.add_gaussian_noise(tensors, tf.constant(1.0), key, step)) \
        .get_concrete_function(tf.constant(1, tf.int64), tf.constant(1, tf.int64)).graph
    assert [tuple(t.shape) for t in graph.outputs] == SHAPES
    assert len(graph.as_graph_def().node) < 40 * len(SHAPES)  # TF's fold_in + stateless_normal: ~100 per draw
