"""The selection bound of docs/algorithms.md §14 against computations written out in the test:
the paper's closed forms evaluated by hand (Gaussian base mechanism, ε(λ) = λ·T/(2σ²)), the
authors' public forms (tensorflow/privacy research/hyperparameters_2022, re-derived here as
formulas), dp_accounting called directly, the limits §14 allows, and monotonicity."""

import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant
from scipy.stats import norm

from tf_dp.accounting import dp_sgd_event
from tf_dp.tuning import (PoissonTrials, TruncatedNegativeBinomial, one_trial_epsilon, selection_rdp, trial_rdp,
                          tuning_epsilon)
from tf_dp.tuning.selection import ORDERS

SIGMA, STEPS = 4.0, 3
SLOPE = STEPS / (2 * SIGMA**2)  # Gaussian: ε(λ) = λ·Δ²/(2σ²) per step, Δ = 1
GAUSSIAN_RDP = SLOPE * np.array(ORDERS)
CHECKED = [1.5, 2.0, 3.0, 8.0, 32.0, 128.0]


def expected_trials(eta, gamma):
    if eta == 0:
        return (1 / gamma - 1) / math.log(1 / gamma)
    return eta * (1 - gamma) / (gamma * (1 - gamma**eta))


def theorem_2_by_hand(order, eta, gamma):
    """min over λ̂ ∈ {1} ∪ ORDERS of the paper's Theorem 2 for ε(λ) = SLOPE·λ."""
    best = math.inf
    for hat in [1.0] + list(ORDERS):
        value = (SLOPE * order + (1 + eta) * (1 - 1 / hat) * SLOPE * hat + (1 + eta) * math.log(1 / gamma) / hat
                 + math.log(expected_trials(eta, gamma)) / (order - 1))
        best = min(best, value)
    return best


@pytest.mark.parametrize("eta,gamma", [(-0.5, 0.05), (0.0, 0.02), (0.5, 0.1), (1.0, 0.1), (2.0, 0.3)])
def test_negative_binomial_matches_theorem_2_by_hand(eta, gamma):
    curve = selection_rdp(GAUSSIAN_RDP, TruncatedNegativeBinomial(eta, gamma))
    for order in CHECKED:
        assert curve[ORDERS.index(order)] == pytest.approx(theorem_2_by_hand(order, eta, gamma), rel=1e-12)


@pytest.mark.parametrize("eta,gamma", [(0.0, 0.02), (1.0, 0.1), (2.0, 0.3)])
def test_negative_binomial_is_within_the_continuous_optimum(eta, gamma):
    """min over real λ̂ >= 1 of (1+η)[c(λ̂ − 1) + ln(1/γ)/λ̂] is (1+η)(2√(c·ln(1/γ)) − c) at
    λ̂* = √(ln(1/γ)/c) >= 1: the grid's minimum is no lower, and close (the grid is fine there)."""
    log_inverse_gamma = math.log(1 / gamma)
    assert math.sqrt(log_inverse_gamma / SLOPE) >= 1
    curve = selection_rdp(GAUSSIAN_RDP, TruncatedNegativeBinomial(eta, gamma))
    for order in CHECKED:
        continuous = (SLOPE * order + (1 + eta) * (2 * math.sqrt(SLOPE * log_inverse_gamma) - SLOPE)
                      + math.log(expected_trials(eta, gamma)) / (order - 1))
        assert continuous - 1e-12 <= curve[ORDERS.index(order)] <= continuous + 0.02


@pytest.mark.parametrize("gamma", [0.001, 0.05, 0.3])
def test_geometric_equals_the_public_code_form(gamma):
    """η = 1: the authors' figure7 form ε(λ) + 2(1 − 1/λ̂)ε(λ̂) + (2/λ̂ + 1/(λ − 1))·ln(1/γ) is
    Theorem 2 with E[K] = 1/γ (over the same λ̂ grid)."""
    curve = selection_rdp(GAUSSIAN_RDP, TruncatedNegativeBinomial(1.0, gamma))
    for order in CHECKED:
        public = min(SLOPE * order + 2 * (1 - 1 / hat) * SLOPE * hat + (2 / hat + 1 / (order - 1)) * math.log(1 / gamma)
                     for hat in [1.0] + list(ORDERS))
        assert curve[ORDERS.index(order)] == pytest.approx(public, rel=1e-12)


@pytest.mark.parametrize("gamma", [0.001, 0.05, 0.3])
def test_logarithmic_is_theorem_2_not_the_tighter_public_variant(gamma):
    """η = 0: the public code writes ln(1/γ − 1) where Theorem 2 has ln(1/γ) (λ̂ term), so
    Theorem 2 lies above it by at most ln(1/(1 − γ))/λ̂ <= ln(1/(1 − γ))."""
    curve = selection_rdp(GAUSSIAN_RDP, TruncatedNegativeBinomial(0.0, gamma))
    for order in CHECKED:
        public = min(SLOPE * order + (1 - 1 / hat) * SLOPE * hat + math.log(1 / gamma - 1) / hat
                     + (math.log(1 / gamma - 1) - math.log(math.log(1 / gamma))) / (order - 1)
                     for hat in [1.0] + list(ORDERS))
        value = curve[ORDERS.index(order)]
        assert public - 1e-12 <= value <= public + math.log(1 / (1 - gamma)) + 1e-12


@pytest.mark.parametrize("mu", [1.0, 5.0, 20.0])
def test_poisson_matches_the_formula_with_dp_accounting_delta(mu):
    """ε'(λ) = ε(λ) + μ·δ̂ + ln μ/(λ − 1), δ̂ from dp_accounting's compute_delta at
    ε̂ = ln(1 + 1/(λ − 1)); δ̂ is at least the EXACT δ of the composed Gaussian (sound)."""
    curve = selection_rdp(GAUSSIAN_RDP, PoissonTrials(mu))
    composed_sigma = SIGMA / math.sqrt(STEPS)  # T Gaussian(σ) steps = one Gaussian of σ/√T
    for order in CHECKED:
        eps_hat = math.log1p(1 / (order - 1))
        delta_hat = rdp_privacy_accountant.compute_delta(ORDERS, GAUSSIAN_RDP, eps_hat)[0]
        exact = (norm.cdf(-eps_hat * composed_sigma + 1 / (2 * composed_sigma))
                 - math.exp(eps_hat) * norm.cdf(-eps_hat * composed_sigma - 1 / (2 * composed_sigma)))
        assert delta_hat >= exact - 1e-15
        by_hand = SLOPE * order + mu * delta_hat + math.log(mu) / (order - 1)
        assert curve[ORDERS.index(order)] == pytest.approx(by_hand, rel=1e-12)


def test_trial_curve_and_epsilon_are_dp_accounting_s():
    """One trial's curve = dp_accounting's RdpAccountant on the event; ε(δ) of the search =
    dp_accounting's compute_epsilon of the selection curve."""
    event = dp_event.ComposedDpEvent([dp_sgd_event(0.02, 1.1, 500), dp_event.GaussianDpEvent(30.0)])
    engine = rdp_privacy_accountant.RdpAccountant(list(ORDERS))
    engine.compose(event)
    np.testing.assert_allclose(trial_rdp(event), engine._rdp, rtol=1e-12)
    distribution = TruncatedNegativeBinomial(0.5, 0.05)
    expected = rdp_privacy_accountant.compute_epsilon(ORDERS, selection_rdp(engine._rdp, distribution), 1e-5)[0]
    assert tuning_epsilon(engine._rdp, 1e-5, distribution) == pytest.approx(expected, rel=1e-12)
    assert one_trial_epsilon(engine._rdp, 1e-5) == pytest.approx(engine.get_epsilon(1e-5), rel=1e-12)


@pytest.mark.parametrize("eta", [-0.5, 0.0, 1.0])
def test_concentrating_on_one_trial_gives_one_run_s_epsilon(eta):
    """γ → 1 puts all mass on K = 1 (E[K] → 1): with λ̂ = 1 the overhead is
    (1 + η)·ln(1/γ) + ln E[K]/(λ − 1) → 0, so the search's ε tends to one run's, from above."""
    rdp = trial_rdp(dp_sgd_event(0.01, 1.0, 1000))
    one_run = one_trial_epsilon(rdp, 1e-5)
    previous = math.inf
    for gamma in [0.5, 0.9, 0.99, 0.999999]:
        search = tuning_epsilon(rdp, 1e-5, TruncatedNegativeBinomial(eta, gamma))
        assert one_run <= search < previous
        previous = search
    assert previous == pytest.approx(one_run, abs=1e-4)


@pytest.mark.parametrize("eta", [-0.5, 0.0, 0.5, 1.0])
def test_more_trials_cost_more(eta):
    rdp = trial_rdp(dp_sgd_event(0.01, 1.0, 1000))
    values = [tuning_epsilon(rdp, 1e-5, TruncatedNegativeBinomial.with_mean(eta, m)) for m in (2, 5, 10, 20, 50)]
    assert np.all(np.diff(values) > 0)
    assert values[0] > one_trial_epsilon(rdp, 1e-5)


def test_poisson_cost_grows_with_the_mean_and_falls_with_sigma():
    rdp = trial_rdp(dp_sgd_event(0.01, 1.0, 1000))
    by_mean = [tuning_epsilon(rdp, 1e-5, PoissonTrials(m)) for m in (1, 5, 10, 20, 50)]
    assert np.all(np.diff(by_mean) > 0)
    by_sigma = [tuning_epsilon(trial_rdp(dp_sgd_event(0.01, s, 1000)), 1e-5, PoissonTrials(10)) for s in (0.8, 1, 2)]
    assert np.all(np.diff(by_sigma) < 0)


def test_a_curve_that_does_not_match_the_orders_is_refused():
    with pytest.raises(ValueError, match="rdp"):
        selection_rdp(GAUSSIAN_RDP[:-1], PoissonTrials(3))
    with pytest.raises(TypeError, match="distribution"):
        selection_rdp(GAUSSIAN_RDP, 3)
