"""Recurrent layers inside a compiled train step: the cell runs in the layer's while loop,
so the whole RNN layer is the tapped unit (its cell's recorded inputs are out of reach)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.harness import flat_norms, loop_per_example_gradients, sparse_ce
from tf_dp.clipping import clipped_gradient_sum


@pytest.mark.parametrize("unroll", [False, True])
@pytest.mark.parametrize("recurrent", ["lstm", "gru", "bidirectional"])
def test_recurrent_layers_clip_exactly_in_graph_mode(recurrent, unroll):
    layer = {"lstm": lambda: keras.layers.LSTM(8, unroll=unroll), "gru": lambda: keras.layers.GRU(8, unroll=unroll),
             "bidirectional": lambda: keras.layers.Bidirectional(keras.layers.SimpleRNN(8, unroll=unroll))}[recurrent]
    model = tf_dp.DPSequential([keras.Input((10, 4)), layer(), keras.layers.Dense(3)])
    x = np.random.rand(6, 10, 4).astype("float32")
    y = np.arange(6) % 3
    per_example = loop_per_example_gradients(model, x, y)

    @tf.function
    def clip():
        result = clipped_gradient_sum(model, sparse_ce, tf.constant(x), tf.constant(y), tf.ones(6), 1e9)
        return result.squared_norms, result.clipped_sums

    squared_norms, sums = clip()
    np.testing.assert_allclose(np.sqrt(squared_norms.numpy()), flat_norms(per_example), rtol=1e-4)
    for v, total in enumerate(sums):
        np.testing.assert_allclose(total.numpy(), sum(g[v] for g in per_example), rtol=1e-4, atol=1e-6)
    model.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0), loss=sparse_ce)
    model.train_on_batch(x, y, batch_size=6)
