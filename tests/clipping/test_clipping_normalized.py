"""Normalized clipping (docs/algorithms.md §13): engine sums vs a per-example loop, and the bound."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.clipping.rules.models import mixed_model
from tests.harness import flat_norms, loop_per_example_gradients, sparse_ce
from tf_dp.clipping import Normalized, clipped_gradient_sum, resolve_clipping

BATCH = 6
ENGINES = ("ghost", "vectorized")


def dense_model(activation="tanh", use_bias=True):
    inputs = keras.Input((7,))
    hidden = keras.layers.Dense(5, activation=activation, use_bias=use_bias)(inputs)
    outputs = keras.layers.Dense(3, use_bias=use_bias)(hidden)
    return keras.Model(inputs, outputs), np.random.randn(BATCH, 7).astype("float32")


def squared_output(y_true, y_pred):
    """ℓ_i = ‖f(x_i)‖²: no saturation, so a linear model's gradient grows as ‖x_i‖²."""
    return tf.reduce_sum(tf.square(y_pred), axis=-1)


def loop_normalized_sum(per_example, clip, gamma, mask):
    """Σ_i mask_i · C g_i/(‖g_i‖ + γ) in float64, from the loop's gradients."""
    norms = flat_norms(per_example)
    return [sum(mask[i] * clip / (norms[i] + gamma) * per_example[i][v].astype(np.float64)
                for i in range(len(per_example)))
            for v in range(len(per_example[0]))]


def flat_norm(sums):
    return math.sqrt(sum(float(np.sum(np.square(np.asarray(s, np.float64)))) for s in sums))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("build", [dense_model, mixed_model], ids=lambda f: f.__name__)
def test_normalized_sum_matches_loop(build, engine):
    model, x = build()
    y = np.random.randint(0, 3, BATCH).astype("int32")
    mask = np.array([1, 1, 1, 0, 1, 1], np.float32)
    clip, gamma = 0.7, 0.05
    expected = loop_normalized_sum(loop_per_example_gradients(model, x, y), clip, gamma, mask)
    result = clipped_gradient_sum(model, sparse_ce, tf.constant(x), tf.constant(y), tf.constant(mask), clip,
                                  engine=engine, clipping=Normalized(gamma))
    for got, want in zip(result.clipped_sums, expected):
        np.testing.assert_allclose(got.numpy(), want, rtol=2e-4, atol=1e-6)


@pytest.mark.parametrize("engine", ENGINES)
def test_every_contribution_is_below_c(engine):
    """One example at a time: ‖c_i g_i‖ < C, for a huge example (inputs × 1e4) and for
    examples whose gradient is far smaller than γ (factor ≈ C/γ). A linear model without
    biases, so that the gradients scale with the inputs."""
    model, x = dense_model(activation=None, use_bias=False)
    x[1] *= 1e3
    x[4] *= 1e-3
    y = np.zeros(BATCH, "float32")
    clip, gamma = 0.5, 0.01
    policy = Normalized(gamma)
    assert policy.sensitivity(clip) == clip
    norms = flat_norms(loop_per_example_gradients(model, x, y, loss=squared_output))
    for i in range(BATCH):
        result = clipped_gradient_sum(model, squared_output, x, y, np.eye(BATCH, dtype=np.float32)[i], clip,
                                      engine=engine, clipping=policy)
        released = flat_norm(result.clipped_sums)
        assert released < clip
        np.testing.assert_allclose(released, clip * norms[i] / (norms[i] + gamma), rtol=1e-4)
    assert norms[1] > 1e3 and norms[4] < 1e-3


@pytest.mark.parametrize("engine", ENGINES)
def test_nonfinite_and_padded_examples_contribute_zero(engine):
    model, x = dense_model()
    y = np.random.randint(0, 3, BATCH).astype("int32")
    x_nan = x.copy()
    x_nan[0, 0] = np.nan
    mask = np.array([1, 1, 1, 1, 1, 0], np.float32)
    x_nan[5] *= 1e5  # padded
    clip = 1.0
    only_good = np.array([0, 1, 1, 1, 1, 0], np.float32)
    expected = loop_normalized_sum(loop_per_example_gradients(model, x, y), clip, 0.01, only_good)
    result = clipped_gradient_sum(model, sparse_ce, x_nan, y, mask, clip, engine=engine, clipping=Normalized())
    for got, want in zip(result.clipped_sums, expected):
        np.testing.assert_allclose(got.numpy(), want, rtol=2e-4, atol=1e-6)
    assert float(result.nonfinite_count(mask)) == 1.0


def test_gamma_must_be_positive():
    for bad in (0.0, -0.1, float("inf")):
        with pytest.raises(ValueError, match="gamma"):
            Normalized(bad)


def test_config_round_trip():
    restored = resolve_clipping(keras.saving.serialize_keras_object(Normalized(0.2)))
    assert isinstance(restored, Normalized) and restored.gamma == 0.2
    assert resolve_clipping("normalized").gamma == 0.01
