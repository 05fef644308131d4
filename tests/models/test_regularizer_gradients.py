"""Weight regularizers are public (a function of θ only): their gradient is added after the
noisy average, in the built-in step and in ``private_update`` alike (one function,
``tf_dp.models.custom_step.regularization_gradients``). Independent check at σ = 0 with C
large: θ' = θ − lr·(mean of per-example gradients by a loop + 2λθ for an L2(λ) kernel)."""

import keras
import numpy as np
import tensorflow as tf

import tf_dp
from tests.harness import loop_per_example_gradients

L, LR, LAMBDA = 4, 0.1, 0.3


def mse(y_true, y_pred):
    return keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)


def test_the_l2_gradient_is_added_once_after_averaging():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(2, kernel_regularizer=keras.regularizers.L2(LAMBDA))(inputs))
    model.compile(optimizer=tf_dp.DPSGD(LR, l2_norm_clip=1e6, noise_multiplier=0.0), loss="mse")
    x = np.random.default_rng(1).normal(size=(L, 3)).astype("float32")
    y = np.random.default_rng(2).normal(size=(L, 2)).astype("float32")
    kernel, bias = [w.copy() for w in model.get_weights()]
    per_example = loop_per_example_gradients(model, tf.constant(x), tf.constant(y), loss=mse)
    mean = [sum(g[v] for g in per_example) / L for v in range(2)]
    model.train_on_batch(x, y, batch_size=L)
    np.testing.assert_allclose(model.get_weights()[0], kernel - LR * (mean[0] + 2 * LAMBDA * kernel), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(model.get_weights()[1], bias - LR * mean[1], rtol=1e-5, atol=1e-6)
