"""The distribution of K, the number of trials of a private random search (docs/algorithms.md §14).

Papernot & Steinke (ICLR 2022) bound the Rényi DP of "run K trials, release the best" when K
is RANDOM: a truncated negative binomial (η > −1, γ ∈ (0, 1)) or a Poisson (mean μ). Each
class states its law (``pmf``, ``mean``), draws K from a generator the caller holds secret
(``sample``), and describes itself for ``privacy.json`` (``describe``: the parameters, never a
draw).
"""

from __future__ import annotations

import math

import numpy as np

from tf_dp import _checks

_LARGEST_GAMMA_SEARCH_STEPS = 200  # bisection steps of ``with_mean`` (γ to machine precision)


class TruncatedNegativeBinomial:
    """P[K = k] ∝ (1 − γ)^k Π_{l<k} (l + η)/(l + 1), k ≥ 1 (docs/algorithms.md §14).

    η = 0 is the logarithmic distribution, η = 1 the geometric one.

    Args:
      eta: η > −1.
      gamma: γ ∈ (0, 1).
    """

    name = "truncated_negative_binomial"

    def __init__(self, eta: float, gamma: float):
        self.eta = _checks.real("eta", eta)
        if not self.eta > -1 or math.isinf(self.eta):
            raise ValueError(f"`eta` must be a finite number > -1 (truncated negative binomial), got {self.eta}.")
        self.gamma = _checks.in_open_unit_interval("gamma", gamma)

    @classmethod
    def with_mean(cls, eta: float, mean: float) -> "TruncatedNegativeBinomial":
        """The distribution of shape η whose E[K] is ``mean`` (> 1): γ by bisection, E[K]
        decreasing in γ."""
        mean = _checks.real("mean", mean)
        if not mean > 1 or math.isinf(mean):
            raise ValueError(f"`mean` (E[K]) must be a finite number > 1, got {mean}.")
        cls(eta, 0.5)  # checks η
        low, high = 0.0, 1.0  # E[K](low) > mean >= E[K](high)
        for _ in range(_LARGEST_GAMMA_SEARCH_STEPS):
            middle = (low + high) / 2
            if middle in (low, high):
                break
            if cls(eta, middle).mean() > mean:
                low = middle
            else:
                high = middle
        return cls(eta, high)  # E[K] <= mean: never more trials on average than asked

    def _log_scale(self) -> float:
        """log(η/Z), Z = Σ_{k≥1} (1 − γ)^k Π_{l<k}(l + η)/(l + 1) = γ^−η − 1 (the negative
        binomial series without its k = 0 term); at η = 0 its limit, 1/ln(1/γ)."""
        if self.eta == 0:
            return -math.log(math.log(1 / self.gamma))
        return math.log(self.eta / math.expm1(-self.eta * math.log(self.gamma)))

    def log_pmf(self, k: int) -> float:
        """log P[K = k] = k·ln(1 − γ) + ln Γ(k + η) − ln Γ(1 + η) − ln k! + ln(η/Z)."""
        if k < 1:
            return -math.inf
        return (k * math.log1p(-self.gamma) + math.lgamma(k + self.eta) - math.lgamma(1 + self.eta)
                - math.lgamma(k + 1) + self._log_scale())

    def pmf(self, k: int) -> float:
        return math.exp(self.log_pmf(k))

    def mean(self) -> float:
        """E[K] = η(1 − γ)/(γ(1 − γ^η)) (η ≠ 0), (1/γ − 1)/ln(1/γ) (η = 0)."""
        gamma, eta = self.gamma, self.eta
        if eta == 0:
            return (1 / gamma - 1) / math.log(1 / gamma)
        return eta * (1 - gamma) / (gamma * -math.expm1(eta * math.log(gamma)))

    def sample(self, generator: np.random.Generator) -> int:
        """K by inversion of the CDF at one uniform draw of ``generator``."""
        uniform, cumulative, k = generator.random(), 0.0, 0
        while True:
            k += 1
            probability = self.pmf(k)
            cumulative += probability
            if cumulative > uniform or (probability == 0.0 and k > self.mean()):
                return k

    def describe(self) -> dict:
        return {"name": self.name, "eta": self.eta, "gamma": self.gamma, "expected_trials": self.mean()}


class PoissonTrials:
    """K ~ Poisson(μ); K = 0 releases nothing (docs/algorithms.md §14).

    Args:
      mean: μ > 0.
    """

    name = "poisson"

    def __init__(self, mean: float):
        self.mu = _checks.positive("mean", mean)

    @classmethod
    def with_mean(cls, mean: float) -> "PoissonTrials":
        return cls(mean)

    def log_pmf(self, k: int) -> float:
        if k < 0:
            return -math.inf
        return k * math.log(self.mu) - self.mu - math.lgamma(k + 1)

    def pmf(self, k: int) -> float:
        return math.exp(self.log_pmf(k))

    def mean(self) -> float:
        return self.mu

    def sample(self, generator: np.random.Generator) -> int:
        return int(generator.poisson(self.mu))

    def describe(self) -> dict:
        return {"name": self.name, "mean": self.mu, "expected_trials": self.mu}


DISTRIBUTIONS = (TruncatedNegativeBinomial, PoissonTrials)


def check_distribution(distribution) -> "TruncatedNegativeBinomial | PoissonTrials":
    """``distribution`` if it is one whose selection bound tf_dp implements, else a TypeError."""
    if not isinstance(distribution, DISTRIBUTIONS):
        raise TypeError("`distribution` must be tf_dp.tuning.TruncatedNegativeBinomial(eta, gamma) or "
                        f"tf_dp.tuning.PoissonTrials(mean), got {type(distribution).__name__}: only these two have "
                        "a proven selection bound (docs/algorithms.md §14).")
    return distribution
