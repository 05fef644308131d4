"""Layers that read the batch size, or mix rows only for some input value, are refused.

Per-example clipping bounds one example's influence on the released sum by C only if each
example's gradient depends on that example alone (docs/algorithms.md §1). A layer scaling
its input by the batch size B changes every other example's gradient when one example is
added or removed (train_on_batch's realized size is B), and a layer that rolls rows only
when an input holds a magic value changes its neighbour's gradient only when that example
is present. Both passed the row-independence probe, which changed one of 3 rows in place.

The attack is measured independently of the probe: two σ = 0 steps of DP-SGD from the same
weights, on the batch with and without one example; the released sum is (θ₀ − θ₁)·L/η and
its move ‖Δ‖ must be ≤ C for a sound step. With the probe switched off each layer moves it
by several C; with it on, training is refused before any step and the error names the layer.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.harness import sparse_ce
from tf_dp.models import fitting

FEATURES, CLASSES, BATCH, CLIP, LEARNING_RATE, MAGIC = 6, 3, 8, 0.5, 1.0, 7.0


class ScaleByBatchSize(keras.layers.Layer):
    """x · B: every row's output depends on how many rows the batch has."""

    def call(self, inputs):
        return inputs * tf.cast(tf.shape(inputs)[0], inputs.dtype)


class FlipAtBatchSize(keras.layers.Layer):
    """x · (B − L + ½): a full batch keeps the sign, one example fewer flips every row."""

    def call(self, inputs):
        return inputs * (tf.cast(tf.shape(inputs)[0], inputs.dtype) - (BATCH - 0.5))


class RollOnMagicValue(keras.layers.Layer):
    """A row whose first feature is the magic value takes the previous row's input."""

    def call(self, inputs):
        return tf.where(inputs[:, :1] == MAGIC, tf.roll(inputs, 1, axis=0), inputs)


class RollAllOnMagicValue(keras.layers.Layer):
    """Every row takes the previous row's input when some row holds the magic value."""

    def call(self, inputs):
        return tf.where(tf.reduce_any(inputs[:, :1] == MAGIC), tf.roll(inputs, 1, axis=0), inputs)


class GradientOnlyBatchSize(keras.layers.Layer):
    """Output x, gradient (1 + B)·: the batch size moves gradients but no output or loss."""

    def call(self, inputs):
        size = tf.cast(tf.shape(inputs)[0], inputs.dtype)
        return inputs + size * (inputs - tf.stop_gradient(inputs))


class GradientOnlyMixing(keras.layers.Layer):
    """Output x, but each row's loss gradient also flows into the batch mean (row mixing)."""

    def call(self, inputs):
        mean = tf.reduce_mean(inputs, axis=0, keepdims=True)
        return inputs + 4.0 * (mean - tf.stop_gradient(mean))


class PerExampleScale(keras.layers.Layer):
    """A benign custom layer: a per-example rescaling (batch-independent)."""

    def call(self, inputs):
        return inputs / (1.0 + tf.reduce_sum(tf.abs(inputs), axis=-1, keepdims=True))


def batch(magic_row=None, rows=BATCH):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, FEATURES)).astype("float32") * 2.0
    y = (np.arange(rows) % CLASSES).astype("int32")
    if magic_row is not None:
        x[magic_row, 0] = MAGIC
    return x, y


def dp_model(layer, engine="ghost", hidden=False):
    """Input → [layer] → Dense(16) → [layer] → tanh → Dense: the layer on the inputs, or
    (``hidden``) on the first Dense's outputs, where a gradient-only mix reaches weights."""
    keras.utils.set_random_seed(0)
    stack = [keras.layers.Dense(16), layer] if hidden else [layer, keras.layers.Dense(16)]
    model = tf_dp.DPSequential([keras.Input((FEATURES,)), *stack, keras.layers.Activation("tanh"),
                                keras.layers.Dense(CLASSES)])
    model.compile(optimizer=tf_dp.DPSGD(LEARNING_RATE, l2_norm_clip=CLIP, noise_multiplier=0.0), loss=sparse_ce,
                  clipping_engine=engine)
    return model


def released_sum(layer_class, x, y, hidden=False, engine="ghost") -> np.ndarray:
    """The clipped sum one σ = 0 train_on_batch step releases: (θ₀ − θ₁)·L/η."""
    model = dp_model(layer_class(), engine, hidden)
    model(x[:1])
    before = np.concatenate([np.ravel(v.numpy()) for v in model.trainable_variables])
    model.train_on_batch(x, y, batch_size=BATCH)
    after = np.concatenate([np.ravel(v.numpy()) for v in model.trainable_variables])
    return (before - after) * BATCH / LEARNING_RATE


def move_of_one_example(layer_class, removed: int, magic_row=None, hidden=False, engine="ghost") -> float:
    """‖released sum with example ``removed`` − without it‖ / C, same initial weights."""
    x, y = batch(magic_row)
    keep = np.arange(len(x)) != removed
    return float(np.linalg.norm(released_sum(layer_class, x, y, hidden, engine)
                                - released_sum(layer_class, x[keep], y[keep], hidden, engine)) / CLIP)


ATTACKS = {  # layer: (example removed, magic row, on the hidden layer)
    ScaleByBatchSize: (BATCH - 1, None, False),
    FlipAtBatchSize: (BATCH - 1, None, False),
    RollOnMagicValue: (2, 3, False),
    RollAllOnMagicValue: (3, 3, False),
    GradientOnlyBatchSize: (BATCH - 1, None, True),
    GradientOnlyMixing: (BATCH - 1, None, True),
}
MOVES = {  # ‖Δ‖/C at least (measured with CLIP = 0.5: 1.02, 6.69, 1.36, 5.79, 2.26); sound: ≤ 1
    ScaleByBatchSize: 1.01, FlipAtBatchSize: 5.0, RollOnMagicValue: 1.2, RollAllOnMagicValue: 5.0,
    GradientOnlyMixing: 2.0,
}


@pytest.mark.parametrize("layer_class", list(MOVES), ids=lambda c: c.__name__)
def test_without_the_probe_one_example_moves_the_release_by_more_than_c(layer_class, monkeypatch):
    """The attacks are real (probe switched off): ‖Δ‖ > C, by up to 6.7·C; a per-example layer stays ≤ C."""
    monkeypatch.setattr(fitting, "check_rows_independent", lambda *args, **kwargs: None)
    removed, magic_row, hidden = ATTACKS[layer_class]
    assert move_of_one_example(layer_class, removed, magic_row, hidden) > MOVES[layer_class]
    assert move_of_one_example(PerExampleScale, removed, magic_row, hidden) <= 1.0 + 1e-5


@pytest.mark.parametrize("layer_class", list(ATTACKS), ids=lambda c: c.__name__)
def test_train_on_batch_refuses_before_training_and_names_the_layer(layer_class):
    _, magic_row, hidden = ATTACKS[layer_class]
    model = dp_model(layer_class(), hidden=hidden)
    x, y = batch(magic_row)
    name = model.layers[1 if hidden else 0].name
    with pytest.raises(ValueError, match=f"mixes examples.*{name}"):
        model.train_on_batch(x, y, batch_size=BATCH)
    assert int(model.privacy_ledger.steps.numpy()) == 0


@pytest.mark.parametrize("layer_class", [ScaleByBatchSize, GradientOnlyMixing], ids=lambda c: c.__name__)
def test_fit_refuses_a_batch_dependent_layer(layer_class):
    hidden = ATTACKS[layer_class][2]
    model = dp_model(layer_class(), hidden=hidden)
    x, y = batch(rows=40)
    with pytest.raises(ValueError, match=f"mixes examples.*{model.layers[1 if hidden else 0].name}"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert int(model.privacy_ledger.steps.numpy()) == 0


def test_a_magic_value_in_the_probed_rows_is_found_anywhere_in_them():
    """The probe uses the real head rows (the first GUARD_ROWS of them, together): the magic
    example is found at row 13 of a 40-row training set, beyond the 3 rows probed before."""
    from tf_dp.models.row_independence import GUARD_ROWS

    assert GUARD_ROWS > 13
    model = dp_model(RollOnMagicValue())
    x, y = batch(magic_row=13, rows=40)
    with pytest.raises(ValueError, match=f"mixes examples.*{model.layers[0].name}"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)


def test_benign_batch_independent_layers_still_train():
    """Dense, LayerNorm, GroupNorm-free per-example layers, Dropout and GaussianNoise (pinned
    per-row randomness) and a per-example custom layer pass at every probed batch size."""
    keras.utils.set_random_seed(0)
    model = tf_dp.DPSequential([keras.Input((FEATURES,)), PerExampleScale(), keras.layers.Dense(16, activation="tanh"),
                                keras.layers.LayerNormalization(), keras.layers.Dropout(0.3),
                                keras.layers.GaussianNoise(0.1), keras.layers.Dense(CLASSES)])
    model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0), loss=sparse_ce)
    x, y = batch(rows=64)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    model.train_on_batch(x[:16], y[:16], batch_size=16)
    assert int(model.privacy_ledger.steps.numpy()) >= 2


def test_benign_conv_model_passes_the_probe():
    """The main job's architecture (GroupNorm without parameters, convolutions, dense): no false alarm."""
    from tf_dp.models.losses import per_example_loss
    from tf_dp.models.row_independence import check_rows_independent

    keras.utils.set_random_seed(0)
    inputs = keras.Input((7, 7, 81))
    h = keras.layers.GroupNormalization(27, center=False, scale=False)(inputs)
    h = keras.layers.Conv2D(16, 3, strides=2, padding="same", activation="tanh")(h)
    h = keras.layers.Conv2D(32, 3, padding="same", activation="tanh")(h)
    h = keras.layers.Dense(32, activation="tanh")(keras.layers.Flatten()(h))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(10)(h))
    x = np.random.default_rng(0).normal(size=(67, 7, 7, 81)).astype("float32")
    check_rows_independent(model, per_example_loss(sparse_ce), x, np.arange(67) % 10)
