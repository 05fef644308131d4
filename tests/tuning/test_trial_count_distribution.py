"""K's distribution (docs/algorithms.md §14): the pmf and E[K] against the closed forms written
out here, 10⁴ draws from a fixed-seed generator against them (tolerances from the variance),
and the arguments' errors."""

import math

import numpy as np
import pytest

from tf_dp.tuning import PoissonTrials, TruncatedNegativeBinomial

DRAWS = 10_000
SHAPES = [(-0.5, 0.2), (0.0, 0.1), (0.5, 0.15), (1.0, 0.25), (2.0, 0.4)]


def closed_form_pmf(eta, gamma, k):
    """P[K = k] ∝ (1 − γ)^k Π_{l<k}(l + η)/(l + 1), normalised by its series (§14)."""
    if eta == 0:
        return (1 - gamma) ** k / (k * math.log(1 / gamma))
    weight = (1 - gamma) ** k * math.prod((l + eta) / (l + 1) for l in range(k))
    return weight / (gamma ** (-eta) - 1)


def closed_form_mean(eta, gamma):
    if eta == 0:
        return (1 / gamma - 1) / math.log(1 / gamma)
    if eta == 1:
        return 1 / gamma
    return eta * (1 - gamma) / (gamma * (1 - gamma**eta))


@pytest.mark.parametrize("eta,gamma", SHAPES)
def test_pmf_and_mean_are_the_closed_forms(eta, gamma):
    distribution = TruncatedNegativeBinomial(eta, gamma)
    for k in range(1, 30):
        assert distribution.pmf(k) == pytest.approx(closed_form_pmf(eta, gamma, k), rel=1e-10)
    assert distribution.pmf(0) == 0.0
    assert distribution.mean() == pytest.approx(closed_form_mean(eta, gamma), rel=1e-12)
    assert sum(distribution.pmf(k) for k in range(1, 3000)) == pytest.approx(1.0, abs=1e-9)


def test_geometric_and_logarithmic_special_cases():
    assert TruncatedNegativeBinomial(1.0, 0.2).pmf(3) == pytest.approx(0.2 * 0.8**2, rel=1e-12)
    assert TruncatedNegativeBinomial(0.0, 0.2).pmf(3) == pytest.approx(0.8**3 / (3 * math.log(5)), rel=1e-12)


def _moments(pmf, support):
    probabilities = np.array([pmf(k) for k in support])
    mean = float(np.sum(probabilities * support))
    return probabilities, mean, float(np.sum(probabilities * (support - mean) ** 2))


def _check_draws(draws, pmf, support):
    """Empirical mean within 4.5 standard errors of E[K], and P[K = k] within 4.5 binomial
    standard errors, for the first values of k."""
    probabilities, mean, variance = _moments(pmf, support)
    assert abs(draws.mean() - mean) <= 4.5 * math.sqrt(variance / len(draws))
    for k, p in zip(support[:6], probabilities[:6]):
        assert abs(np.mean(draws == k) - p) <= 4.5 * math.sqrt(p * (1 - p) / len(draws)) + 1e-12


@pytest.mark.parametrize("eta,gamma", SHAPES)
def test_negative_binomial_draws_follow_the_law(eta, gamma):
    distribution = TruncatedNegativeBinomial(eta, gamma)
    generator = np.random.default_rng(20221)
    draws = np.array([distribution.sample(generator) for _ in range(DRAWS)])
    assert draws.min() >= 1
    _check_draws(draws, lambda k: closed_form_pmf(eta, gamma, k), np.arange(1, 4000))


@pytest.mark.parametrize("mu", [0.7, 5.0, 20.0])
def test_poisson_draws_follow_the_law(mu):
    distribution = PoissonTrials(mu)
    generator = np.random.default_rng(20222)
    draws = np.array([distribution.sample(generator) for _ in range(DRAWS)])
    assert distribution.mean() == mu
    _check_draws(draws, lambda k: math.exp(k * math.log(mu) - mu - math.lgamma(k + 1)), np.arange(0, 200))


@pytest.mark.parametrize("eta", [-0.5, 0.0, 0.5, 1.0])
@pytest.mark.parametrize("mean", [1.5, 10.0, 20.0])
def test_with_mean_finds_gamma(eta, mean):
    distribution = TruncatedNegativeBinomial.with_mean(eta, mean)
    assert distribution.mean() <= mean
    assert distribution.mean() == pytest.approx(mean, rel=1e-9)


def test_description_states_parameters_and_mean_only():
    assert TruncatedNegativeBinomial(1.0, 0.1).describe() == {
        "name": "truncated_negative_binomial", "eta": 1.0, "gamma": 0.1, "expected_trials": pytest.approx(10.0)}
    assert PoissonTrials(4.0).describe() == {"name": "poisson", "mean": 4.0, "expected_trials": 4.0}


@pytest.mark.parametrize("eta", [-1.0, -2.5, math.inf])
def test_eta_at_most_minus_one_is_refused(eta):
    with pytest.raises(ValueError, match="`eta`"):
        TruncatedNegativeBinomial(eta, 0.5)


@pytest.mark.parametrize("gamma", [0.0, 1.0, -0.1, 1.5])
def test_gamma_outside_the_open_unit_interval_is_refused(gamma):
    with pytest.raises(ValueError, match="`gamma`"):
        TruncatedNegativeBinomial(0.5, gamma)


@pytest.mark.parametrize("mean", [0.0, -1.0, math.inf])
def test_poisson_mean_must_be_positive(mean):
    with pytest.raises(ValueError, match="`mean`"):
        PoissonTrials(mean)


def test_with_mean_needs_more_than_one_trial():
    with pytest.raises(ValueError, match="`mean`"):
        TruncatedNegativeBinomial.with_mean(1.0, 1.0)
