"""What a trial is judged by (docs/algorithms.md §14): a score on data declared PUBLIC (no
cost), or a NOISY score on private data whose cost joins every trial's curve. A private
score without its own noise is never accepted: selecting on it is outside every bound.
"""

from __future__ import annotations

import secrets

import numpy as np
from dp_accounting import dp_event

from tf_dp import _checks


def _predicted_labels(model, x, from_logits: bool) -> np.ndarray:
    outputs = np.asarray(model.predict(x, verbose=0))
    if outputs.ndim >= 2 and outputs.shape[-1] > 1:
        return np.argmax(outputs, axis=-1)
    threshold = 0.0 if from_logits else 0.5
    return (outputs.reshape(len(outputs), -1)[:, 0] > threshold).astype(np.int64)


def _labels(y) -> np.ndarray:
    y = np.asarray(y)
    return y.reshape(len(y), -1)[:, 0] if y.ndim > 1 and y.shape[-1] == 1 else y


class PublicScore:
    """Accuracy on validation data the user declares PUBLIC (no privacy cost): data that is
    not the private training set nor drawn from it (a public data set, a held-out split that
    is published).

    Args:
      x, y: the public validation examples and their integer labels.
      from_logits: binary models: outputs are logits (threshold 0), else probabilities (0.5).
    """

    kind = "public"

    def __init__(self, x, y, from_logits: bool = True):
        self.x, self.y = x, _labels(y)
        self.from_logits = _checks.boolean("from_logits", from_logits)
        if len(self.y) == 0:
            raise ValueError("`public_validation_data` must hold at least one example.")

    @property
    def event(self) -> dp_event.DpEvent:
        return dp_event.NoOpDpEvent()

    def score(self, model) -> float:
        """Accuracy of ``model`` on the public data."""
        return float(np.mean(_predicted_labels(model, self.x, self.from_logits) == self.y))

    def describe(self) -> dict:
        return {"score": "accuracy on validation data declared public", "cost": "none (public data)",
                "examples": int(len(self.y))}


class NoisyAccuracy:
    """The number of correct predictions on PRIVATE validation data plus N(0, σ²): the
    Gaussian mechanism at sensitivity 1 (adding or removing one validation example changes
    the count by at most one), accounted as ``GaussianDpEvent(σ)`` in every trial.

    The score is the noisy COUNT (not divided by the number of examples, itself private);
    only its ranking matters. The noise comes from OS entropy and is never stored.

    Args:
      x, y: the private validation examples and their integer labels.
      noise_multiplier: σ of the noise on the count (> 0).
      from_logits: binary models: outputs are logits (threshold 0), else probabilities (0.5).
    """

    kind = "noisy"

    def __init__(self, x, y, noise_multiplier: float, from_logits: bool = True):
        self.x, self.y = x, _labels(y)
        self.noise_multiplier = _checks.positive(
            "noise_multiplier", noise_multiplier, "A private score needs noise: the count's σ must be > 0.")
        self.from_logits = _checks.boolean("from_logits", from_logits)

    @property
    def event(self) -> dp_event.DpEvent:
        return dp_event.GaussianDpEvent(self.noise_multiplier)

    def score(self, model) -> float:
        """Σ_i 1[model(x_i) = y_i] + N(0, σ²)."""
        return self.noisy(float(np.sum(_predicted_labels(model, self.x, self.from_logits) == self.y)))

    def noisy(self, count: float) -> float:
        """count + N(0, σ²), the noise from a generator seeded by OS entropy (never stored)."""
        return count + float(np.random.default_rng(secrets.randbits(128)).normal(0.0, self.noise_multiplier))

    def describe(self) -> dict:
        return {"score": "number of correct predictions on private validation data + N(0, sigma^2)",
                "cost": "Gaussian mechanism, sensitivity 1 (add/remove one example)",
                "noise_multiplier": self.noise_multiplier}
