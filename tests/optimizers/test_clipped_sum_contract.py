"""Keras' optimizer contract kept (issue 32): the model hands ``optimizer.apply`` one frozen
``ClippedSum``; raw gradients still raise. Independent check: at σ = 0 with SGD(lr) the update
is θ − lr·(S/L + ∇R) computed by hand from the sum S, the expected batch size L and a public
regularizer gradient ∇R."""

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.harness import drawing_noise
from tf_dp.optimizers import ClippedSum


def test_apply_of_a_clipped_sum_is_the_hand_computed_update():
    optimizer = tf_dp.DPSGD(0.5, l2_norm_clip=1.0, noise_multiplier=0.0)
    variable = keras.Variable(np.ones((3,), "float32"))
    total, public = np.array([2.0, -4.0, 8.0], "float32"), np.array([0.1, 0.2, 0.3], "float32")
    with drawing_noise(optimizer):
        optimizer.apply(ClippedSum([tf.constant(total)], tf.constant(4.0), tf.constant(0, tf.int64),
                                   public_gradients=[tf.constant(public)]), [variable])
    np.testing.assert_allclose(variable.numpy(), 1.0 - 0.5 * (total / 4.0 + public), rtol=1e-6)


def test_a_clipped_sum_is_frozen_and_raw_gradients_are_refused():
    value = ClippedSum([tf.zeros(3)], 4.0, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        value.expected_batch_size = 1.0
    optimizer = tf_dp.DPSGD(0.5, l2_norm_clip=1.0, noise_multiplier=1.0)
    variable = keras.Variable(np.ones((3,), "float32"))
    with pytest.raises(TypeError, match="refuses raw"):
        optimizer.apply([tf.ones(3)], [variable])
    with pytest.raises(TypeError, match="refuses raw"):
        optimizer.apply_gradients([(tf.ones(3), variable)])
    with pytest.raises(RuntimeError, match="outside a DP step"):  # the window: only a model's train function
        optimizer.apply(value, [variable])
    np.testing.assert_array_equal(variable.numpy(), np.ones(3))
