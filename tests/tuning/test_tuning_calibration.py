"""calibrate_noise_multiplier / calibrate_mean_trials: the answer meets the search's target ε
and a slightly smaller σ (larger E[K]) does not; the curves are dp_accounting's, built here."""

import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant

from tf_dp.accounting import calibrate_noise_multiplier as one_run_sigma
from tf_dp.tuning import (PoissonTrials, TruncatedNegativeBinomial, calibrate_mean_trials, calibrate_noise_multiplier,
                          tuning_epsilon)
from tf_dp.tuning.selection import ORDERS

N, L, EPOCHS = 10_000, 200, 3
STEPS = 150  # ⌈3 · 10000 / 200⌉


def curve(sigma, score_sigma=None):
    """One trial's RDP: dp_accounting's RdpAccountant on T Poisson-sampled Gaussian steps (+ score)."""
    engine = rdp_privacy_accountant.RdpAccountant(list(ORDERS))
    engine.compose(dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(L / N, dp_event.GaussianDpEvent(sigma)), STEPS))
    if score_sigma is not None:
        engine.compose(dp_event.GaussianDpEvent(score_sigma))
    return engine._rdp


@pytest.mark.parametrize("distribution", [TruncatedNegativeBinomial.with_mean(1.0, 10), PoissonTrials(10)])
def test_sigma_meets_the_search_target(distribution):
    sigma = calibrate_noise_multiplier(2.0, distribution, N, L, epochs=EPOCHS)
    assert tuning_epsilon(curve(sigma), 1e-5, distribution) <= 2.0
    assert tuning_epsilon(curve(sigma * 0.997), 1e-5, distribution) > 2.0
    assert sigma > one_run_sigma(2.0, N, L, epochs=EPOCHS)  # the search costs more than one run


def test_sigma_accounts_for_the_score():
    distribution = PoissonTrials(5)
    sigma = calibrate_noise_multiplier(2.0, distribution, N, L, epochs=EPOCHS,
                                       score_event=dp_event.GaussianDpEvent(20.0))
    assert tuning_epsilon(curve(sigma, 20.0), 1e-5, distribution) <= 2.0
    assert sigma > calibrate_noise_multiplier(2.0, distribution, N, L, epochs=EPOCHS)


@pytest.mark.parametrize("eta", [None, 0.0, 1.0])
def test_mean_trials_is_the_largest_within_target(eta):
    rdp = curve(2.0)  # one trial: ε = 0.55
    distribution = calibrate_mean_trials(1.0, rdp, 1e-5, eta=eta)  # E[K] ≈ 6 (Poisson), 10 (η = 0), 3 (η = 1)
    assert 2 < distribution.mean() < 20
    assert tuning_epsilon(rdp, 1e-5, distribution) <= 1.0
    mean = distribution.mean() * 1.002
    larger = PoissonTrials(mean) if eta is None else TruncatedNegativeBinomial.with_mean(eta, mean)
    assert tuning_epsilon(rdp, 1e-5, larger) > 1.0
    assert isinstance(distribution, PoissonTrials if eta is None else TruncatedNegativeBinomial)


def test_unreachable_targets_are_refused():
    with pytest.raises(ValueError, match="target_epsilon"):
        calibrate_mean_trials(0.5, curve(1.0), 1e-5)  # one trial alone: ε ≈ 2.0
    with pytest.raises(ValueError, match="target_epsilon"):
        calibrate_noise_multiplier(-1.0, PoissonTrials(5), N, L, epochs=EPOCHS)
