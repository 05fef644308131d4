"""How trials are ranked: PublicScore is the accuracy counted here; NoisyAccuracy is the count of
correct predictions plus Gaussian noise of the declared σ (its event), from OS entropy."""

import secrets

import keras
import numpy as np
import pytest
from dp_accounting import dp_event

from tf_dp.tuning import NoisyAccuracy, PublicScore

ROWS = 40


def model_and_data():
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    x = np.random.default_rng(0).normal(size=(ROWS, 2)).astype("float32")
    y = np.random.default_rng(1).integers(0, 3, size=ROWS)
    correct = int(np.sum(np.argmax(model(x).numpy(), axis=-1) == y))
    return model, x, y, correct


def test_public_score_is_the_accuracy_at_no_cost():
    model, x, y, correct = model_and_data()
    score = PublicScore(x, y[:, None])
    assert score.score(model) == pytest.approx(correct / ROWS)
    assert isinstance(score.event, dp_event.NoOpDpEvent)


def test_noisy_score_is_the_count_plus_gaussian_noise_of_its_event(monkeypatch):
    model, x, y, correct = model_and_data()
    score = NoisyAccuracy(x, y, noise_multiplier=3.0)
    assert score.event == dp_event.GaussianDpEvent(3.0)
    monkeypatch.setattr(secrets, "randbits", lambda bits: 7)  # a fixed seed: a reproducible test
    assert score.score(model) == pytest.approx(correct + np.random.default_rng(7).normal(0.0, 3.0), rel=1e-12)
    draws = iter(range(1, 4001))
    monkeypatch.setattr(secrets, "randbits", lambda bits: next(draws))
    noise = np.array([score.noisy(0.0) for _ in range(4000)])
    assert abs(noise.mean()) <= 4.5 * 3.0 / np.sqrt(4000)
    assert noise.std() == pytest.approx(3.0, rel=4.5 * np.sqrt(1 / (2 * 3999)))


def test_binary_outputs_are_thresholded():
    inputs = keras.Input((1,))
    model = keras.Model(inputs, inputs)  # the logit is the input
    x = np.array([[-2.0], [0.5], [3.0]], dtype="float32")
    assert PublicScore(x, np.array([0, 1, 0])).score(model) == pytest.approx(2 / 3)
    assert PublicScore(x, np.array([1, 0, 1]), from_logits=False).score(model) == pytest.approx(2 / 3)  # 0.5: 0
