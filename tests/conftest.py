import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402


@pytest.fixture(autouse=True)
def _seeded():
    keras.utils.set_random_seed(1234)
    yield


def sparse_ce(y_true, y_pred):
    return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)


def loop_per_example_gradients(model, x, y, loss=sparse_ce):
    """Reference: per-example gradients by a Python loop over single examples."""
    grads = []
    for i in range(len(y)):
        x_i = tf.nest.map_structure(lambda a: a[i : i + 1], x)
        with tf.GradientTape() as tape:
            value = loss(y[i : i + 1], model(x_i, training=True))[0]
        grads.append([tf.convert_to_tensor(g).numpy() for g in tape.gradient(value, model.trainable_variables)])
    return grads


def flat_norms(per_example):
    return np.array([np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads)) for grads in per_example])
