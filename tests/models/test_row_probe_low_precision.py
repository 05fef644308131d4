"""The row probe on 16-bit models: no false refusal of a row-independent bfloat16 model, and
row-mixing bfloat16 layers still refused.

In bfloat16 (8 significant bits) a kernel that sums a batch in another order when the batch
size changes moves a weight gradient by ~2⁻⁸ relative; the batch-size probes therefore run
with every layer computing in float32 (the same-size probes stay bit for bit in bfloat16).
The row-independent Conv2D model must train, and its release at σ = 0 must move by at most
C (up to bfloat16 rounding of the norms) when one example is removed — the
neighbouring-dataset difference, computed on full-batch steps from the same weights.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.harness import sparse_ce

CLASSES, ROWS, CLIP, RATE = 4, 32, 0.5, 0.5


@pytest.fixture
def bfloat16_policy():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    yield
    keras.mixed_precision.set_global_policy("float32")


class CentreOverBatch(keras.layers.Layer):
    """x − mean over the batch: every row reads every other row."""

    def call(self, inputs):
        return inputs - tf.reduce_mean(inputs, axis=0, keepdims=True)


class ScaleByBatchSize(keras.layers.Layer):
    """x · B / 16: every row reads how many rows the batch has."""

    def call(self, inputs):
        return inputs * tf.cast(tf.shape(inputs)[0], inputs.dtype) / 16.0


def conv_model(*middle):
    keras.utils.set_random_seed(0)
    model = tf_dp.DPSequential([
        keras.Input((28, 28, 1)), keras.layers.Conv2D(16, 3, activation="relu"), *middle, keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.Flatten(), keras.layers.Dense(CLASSES)])
    model.compile(optimizer=tf_dp.DPSGD(RATE, l2_norm_clip=CLIP, noise_multiplier=0.0), loss=sparse_ce)
    return model


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(ROWS, 28, 28, 1)).astype("float32"), (np.arange(ROWS) % CLASSES).astype("int32")


def released_sum(model, x, y) -> np.ndarray:
    """S = (θ₀ − θ₁)·L/η of one full-batch step (q = 1, σ = 0); weights restored after."""
    weights = model.get_weights()
    before = np.concatenate([np.ravel(v.numpy()) for v in model.trainable_variables])
    model.fit(x, y, batch_size=len(y), epochs=1, verbose=0)
    after = np.concatenate([np.ravel(v.numpy()) for v in model.trainable_variables])
    model.set_weights(weights)
    return (before - after) * len(y) / RATE


def test_a_bfloat16_conv_model_trains_and_one_example_moves_the_release_by_at_most_c(bfloat16_policy):
    model = conv_model()
    assert model.layers[0].compute_dtype == "bfloat16"
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert int(model.privacy_ledger.steps.numpy()) == 2
    assert {layer.dtype_policy.name for layer in model.layers} == {"mixed_bfloat16"}  # restored after the probe
    keep = np.arange(ROWS) != 5
    difference = released_sum(model, x, y) - released_sum(model, x[keep], y[keep])
    assert np.linalg.norm(difference) <= CLIP * (1 + 2 ** -6)  # the clip factor's bfloat16 rounding


@pytest.mark.parametrize("mixing", [CentreOverBatch, ScaleByBatchSize], ids=lambda cls: cls.__name__)
def test_a_row_mixing_bfloat16_layer_is_still_refused(bfloat16_policy, mixing):
    layer = mixing(name=f"mixing_{mixing.__name__.lower()}")
    assert layer.compute_dtype == "bfloat16"
    model = conv_model(layer)
    x, y = data()
    with pytest.raises(ValueError, match=f"mixes examples.*{layer.name}"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert int(model.privacy_ledger.steps.numpy()) == 0
