"""A layer that calls add_loss in the training forward pass is refused before the first step.

The DP step clips and noises the compiled per-example loss only: a loss added by a layer
would be dropped silently (and, computed from the batch, would be neither clipped nor
noised if it were kept). The refusal names the layer and the fix.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.harness import sparse_ce

FEATURES, CLASSES, ROWS = 6, 3, 64


class ActivityPenalty(keras.layers.Layer):
    """Identity that adds the batch's mean squared activation as a loss in training."""

    def call(self, inputs, training=None):
        if training:
            self.add_loss(1e-2 * tf.reduce_mean(tf.square(inputs)))
        return inputs


def model_with_penalty():
    keras.utils.set_random_seed(0)
    model = tf_dp.DPSequential([keras.Input((FEATURES,)), keras.layers.Dense(8, activation="tanh"),
                                ActivityPenalty(name="activity_penalty"), keras.layers.Dense(CLASSES)])
    model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0), loss=sparse_ce)
    return model


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(ROWS, FEATURES)).astype("float32"), (np.arange(ROWS) % CLASSES).astype("int32")


@pytest.mark.parametrize("how", ["fit", "train_on_batch"])
def test_a_layer_adding_a_loss_is_refused_before_the_first_step(how):
    model = model_with_penalty()
    x, y = data()
    model(x[:4], training=True)  # independent of tf_dp's probe: the layer really adds a loss in training
    assert len(model.losses) == 1
    with pytest.raises(ValueError, match=r"'activity_penalty' \(ActivityPenalty\) calls add_loss.*kernel_regularizer"):
        if how == "fit":
            model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        else:
            model.train_on_batch(x[:16], y[:16], batch_size=16)
    assert int(model.privacy_ledger.steps.numpy()) == 0
