"""Layers that mix examples are refused, and padding rows are no example.

(a) validate() refuses the Keras layers that combine rows (MixUp, CutMix, BatchNorm),
    nested models included; (b) the padding rows of a Poisson chunk are zeros, not copies
    of example 0; (c) check_rows_independent catches custom mixing layers by testing that
    changing one row leaves every other row's output and loss unchanged.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.harness import sparse_ce
from tf_dp.models.data import poisson_dataset
from tf_dp.models.losses import per_example_loss

FEATURES, CLASSES = 6, 3


def data(n=40):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32")


def sequential(*middle):
    return keras.Sequential([keras.Input((FEATURES,)), *middle, keras.layers.Dense(CLASSES)])


@keras.saving.register_keras_serializable(package="tests")
class CenterOverBatch(keras.layers.Layer):
    """x − mean over the batch axis: row i depends on every row."""

    def call(self, inputs):
        return inputs - tf.reduce_mean(inputs, axis=0)


class MixInTraining(keras.layers.Layer):
    """Adds the batch mean only when training (a MixUp-like custom layer)."""

    def call(self, inputs, training=None):
        return inputs + tf.reduce_mean(inputs, axis=0) if training else inputs


class Augmented(keras.Model):
    """augment → flatten → dense, subclassed (a functional graph drops Equalization, whose
    symbolic call returns its input)."""

    def __init__(self, augment):
        super().__init__()
        self.augment, self.flatten, self.out = augment, keras.layers.Flatten(), keras.layers.Dense(CLASSES)

    def call(self, images, training=None):
        return self.out(self.flatten(self.augment(images, training=training)))


def guard(model, loss=sparse_ce):
    from tf_dp.models.row_independence import check_rows_independent

    x, y = data()
    check_rows_independent(model, per_example_loss(loss), x, y)


# ------------------------------------------------------------------ (a) validate
@pytest.mark.parametrize("layer", [keras.layers.MixUp, keras.layers.CutMix], ids=["MixUp", "CutMix"])
def test_validate_refuses_row_mixing_augmentations(layer):
    image = keras.Input((8, 8, 3))
    model = keras.Model(image, keras.layers.Dense(CLASSES)(keras.layers.Flatten()(layer()(image))))
    problems = tf_dp.validate(model)
    assert len(problems) == 1 and layer.__name__ in problems[0] and "another example" in problems[0]


def test_validate_walks_nested_models_and_compile_refuses():
    image = keras.Input((8, 8, 3))
    augment = keras.Sequential([keras.layers.RandomFlip(), keras.layers.MixUp()], name="augment")
    inner = keras.Model(image, keras.layers.Flatten()(augment(image)), name="inner")
    outer = tf_dp.DPModel(image, keras.layers.Dense(CLASSES)(inner(image)))
    problems = tf_dp.validate(outer)
    assert len(problems) == 1 and problems[0].startswith("mix_up") and "in inner/augment (MixUp)" in problems[0]
    with pytest.raises(ValueError, match="MixUp"):
        outer.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0), loss=sparse_ce)


@pytest.mark.parametrize("layer", [keras.layers.Equalization, keras.layers.RandAugment, keras.layers.AugMix])
def test_validate_refuses_batch_histogram_equalization_also_inside_rand_augment_and_aug_mix(layer):
    """Keras' Equalization builds one histogram per channel over the WHOLE batch."""
    problems = tf_dp.validate(Augmented(layer(value_range=(0, 1))))
    assert len(problems) == 1 and "(Equalization)" in problems[0] and "whole batch" in problems[0]


def test_equalization_really_mixes_rows():
    images = np.random.default_rng(0).uniform(size=(3, 8, 8, 3)).astype("float32")
    changed = images.copy()
    changed[0] = 1.0 - changed[0] ** 3
    layer = keras.layers.Equalization(value_range=(0, 1))
    assert not np.array_equal(np.asarray(layer(images))[1:], np.asarray(layer(changed))[1:])


def test_mel_spectrogram_is_refused_only_with_a_batch_wide_db_floor():
    audio = keras.Input((400,))
    for power_to_db, problems in ((True, 1), (False, 0)):
        mel = keras.layers.MelSpectrogram(fft_length=64, sequence_stride=32, num_mel_bins=8, power_to_db=power_to_db)
        assert len(tf_dp.validate(keras.Model(audio, mel(audio)))) == problems


def test_per_image_augmentations_pass_validate_and_the_guard():
    image = keras.Input((8, 8, 3))
    augment = keras.Sequential([keras.layers.RandomFlip(), keras.layers.RandomRotation(0.2),
                                keras.layers.RandomContrast(0.3), keras.layers.RandomTranslation(0.1, 0.1)])
    model = keras.Model(image, keras.layers.Dense(CLASSES)(keras.layers.Flatten()(augment(image))))
    assert tf_dp.validate(model) == []
    images = np.random.default_rng(0).uniform(size=(8, 8, 8, 3)).astype("float32")
    from tf_dp.models.row_independence import check_rows_independent

    check_rows_independent(model, per_example_loss(sparse_ce), images, np.arange(8) % CLASSES)


# ---------------------------------------------------------------- (b) padding rows
def test_poisson_padding_rows_are_zero_not_example_zero():
    x, y = data(30)
    x[0], y[0] = 7.0, 2  # example 0 is recognisable
    groups = np.arange(30, dtype=np.int32) + 5
    stream = poisson_dataset({"a": x, "b": x[:, :2]}, y, 30, 6, physical_batch_size=16, seed=0,
                             extras={"groups": groups})
    padded_rows = 0
    for element in stream.take(5).as_numpy_iterator():
        pad = element["mask"] == 0
        padded_rows += int(pad.sum())
        for values in (element["x"]["a"], element["x"]["b"], element["y"], element["groups"]):
            assert not np.any(values[pad]), "padding rows must hold zeros"
        real = element["mask"] == 1
        assert np.all(element["groups"][real] >= 5)  # real rows are real examples
    assert padded_rows > 0


# ---------------------------------------------------------- (c) generic row guard
def test_guard_catches_a_custom_layer_that_centers_over_the_batch():
    with pytest.raises(ValueError, match="mixes examples.*changed the output of example"):
        guard(sequential(CenterOverBatch()))


def test_guard_passes_a_normal_model_and_a_dropout_model():
    guard(sequential(keras.layers.Dense(8, activation="relu")))
    guard(sequential(keras.layers.Dense(8, activation="relu"), keras.layers.Dropout(0.5),
                     keras.layers.GaussianNoise(0.3)))


def test_guard_compares_in_training_mode_with_the_same_randomness():
    """Dropout draws differ between calls unless the seeds are pinned; the guard pins them
    and so still sees a layer that mixes rows only when training."""
    with pytest.raises(ValueError, match=r"training=True"):
        guard(sequential(keras.layers.Dropout(0.5), MixInTraining()))


def test_guard_catches_mixup_and_batch_norm_and_a_mixing_loss():
    with pytest.raises(ValueError, match="mixes examples|non-trainable state"):  # moving statistics too
        guard(sequential(keras.layers.BatchNormalization()))
    mixing_loss = lambda y, p: sparse_ce(y, p) + tf.reduce_mean(p)  # noqa: E731
    with pytest.raises(ValueError, match="mixes examples"):
        guard(sequential(), loss=mixing_loss)


def test_guard_changes_no_model_state():
    model = sequential(keras.layers.BatchNormalization(), keras.layers.Dropout(0.5))
    model(np.zeros((2, FEATURES), "float32"))
    before = [np.array(v) for v in model.variables]
    with pytest.raises(ValueError):
        guard(model)
    for old, variable in zip(before, model.variables):
        np.testing.assert_array_equal(old, np.asarray(variable), err_msg=variable.path)


def test_dp_training_runs_the_row_guard_before_the_first_step():
    """Needs the calls to check_rows_independent in tf_dp/models/fitting.py (fit, fixed
    batches, train_on_batch)."""
    x, y = data()
    model = tf_dp.DPSequential([keras.Input((FEATURES,)), CenterOverBatch(), keras.layers.Dense(CLASSES)])
    model.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0), loss=sparse_ce)
    with pytest.raises(ValueError, match="mixes examples"):
        model.fit(x, y, batch_size=10, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="mixes examples"), pytest.warns(UserWarning, match="BATCHED"):
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(10), epochs=1, verbose=0)
    with pytest.raises(ValueError, match="mixes examples"):
        model.train_on_batch(x[:10], y[:10], batch_size=10)
    assert int(model.privacy_ledger.steps.numpy()) == 0
