"""ScatteringTransform2D against Kymatio's scattering (tests/data, written by
tools/scattering_reference.py), its per-example independence, and its input errors."""

import pathlib

import keras
import numpy as np
import pytest

from tf_dp.features import ScatteringTransform2D, scattering_features

REFERENCE = np.load(pathlib.Path(__file__).parents[1] / "data" / "scattering_reference.npz")


def test_matches_kymatio_on_mnist_digits():
    digits = REFERENCE["digits"][..., None]  # [2, 28, 28, 1]
    want = REFERENCE["digits_scattering"].transpose(0, 2, 3, 1)  # [2, 81, 7, 7] → channels last
    got = ScatteringTransform2D(scale=2, angles=8)(digits).numpy()
    assert got.shape == (2, 7, 7, 81)
    np.testing.assert_allclose(got, want, atol=2e-6 * np.abs(want).max())


def test_matches_kymatio_per_colour_channel_at_another_scale_and_angle_count():
    colour = REFERENCE["colour"].transpose(0, 2, 3, 1)  # [1, 16, 24, 3]
    want = REFERENCE["colour_scattering"]  # [1, C, K, 2, 3]
    layer = ScatteringTransform2D(scale=3, angles=4)
    got = layer(colour).numpy()
    channels = want.shape[2]
    assert layer.channels_per_input == channels == 1 + 3 * 4 + 16 * 3
    want = want.reshape(1, 3 * channels, 2, 3).transpose(0, 2, 3, 1)  # channel c·K + k
    np.testing.assert_allclose(got, want, atol=2e-6 * np.abs(want).max())


def test_each_example_is_transformed_alone():
    rng = np.random.default_rng(1)
    first, others = rng.random((1, 28, 28, 1), np.float32), rng.random((2, 28, 28, 1), np.float32)
    layer = ScatteringTransform2D()
    alone = layer(first).numpy()[0]
    for other in others:
        beside = layer(np.concatenate([first, other[None]])).numpy()[0]
        np.testing.assert_allclose(beside, alone, rtol=0, atol=1e-7)
    images = np.concatenate([first, others])
    np.testing.assert_allclose(scattering_features(images, chunk=2), layer(images).numpy(), rtol=0, atol=1e-7)


def test_an_image_size_not_divisible_by_two_to_the_scale_is_refused_by_name():
    with pytest.raises(ValueError, match="multiple of 2\\^scale = 4"):
        ScatteringTransform2D(scale=2)(np.zeros((1, 30, 28, 1), np.float32))
    with pytest.raises(ValueError, match="scale=0"):
        ScatteringTransform2D(scale=0)
    with pytest.raises(ValueError, match="static H and W"):
        ScatteringTransform2D()(keras.Input((None, None, 1)))
    with pytest.raises(ValueError, match="non-empty \\[N, H, W, C\\]"):
        scattering_features(np.zeros((5, 28, 28), np.float32))


def test_a_saved_model_with_the_layer_loads_and_gives_the_same_features(tmp_path):
    inputs = keras.Input((28, 28, 1))
    model = keras.Model(inputs, ScatteringTransform2D(scale=2, angles=8)(inputs))
    path = tmp_path / "scattering.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    digits = REFERENCE["digits"][..., None]
    np.testing.assert_allclose(loaded(digits).numpy(), model(digits).numpy(), rtol=0, atol=0)
