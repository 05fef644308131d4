"""A tiny DP hypermodel and data set shared by the search tests (2 features, 2 classes)."""

import keras
import numpy as np

import tf_dp

N, BATCH, EPOCHS, SIGMA = 128, 32, 2, 1.0


def data(seed=0, rows=N):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 2)).astype("float32")
    return x, (x[:, 0] + 0.3 * x[:, 1] > 0).astype("int64")


def build(hp, sigma=SIGMA):
    inputs = keras.Input((2,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(2)(inputs))
    optimizer = tf_dp.DPSGD(hp.Choice("learning_rate", [0.001, 0.05, 0.5, 2.0]), l2_norm_clip=1.0,
                            noise_multiplier=sigma)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model
