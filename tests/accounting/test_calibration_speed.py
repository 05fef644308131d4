"""Calibration speed: ε from cached per-step RDP curves equals dp_accounting's
composition; σ calibration returns the smallest σ to 0.1 % with a fraction of the
accountant evaluations; step-count searches reuse one per-step curve.

The references are written here against dp_accounting directly (a fresh accountant per ε;
σ meets the target and σ·(1 − 0.1 %) does not), and evaluations are counted inside
dp_accounting, so the tests read the same on any implementation of tf_dp's accountant."""

import math

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from tf_dp.accounting import accountant
from tf_dp.accounting.accountant import (
    PLD_DISCRETIZATION,
    RDP_ORDERS,
    calibrate_noise_multiplier,
    dp_sgd_event,
    epsilon_of_event,
    largest_fitting,
)


def _slow_epsilon(event, delta, name="rdp"):
    """The reference: the event composed in a fresh dp_accounting accountant."""
    if name == "rdp":
        engine = rdp_privacy_accountant.RdpAccountant(RDP_ORDERS)
    else:
        engine = pld_privacy_accountant.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
    engine.compose(event)
    return float(engine.get_epsilon(delta))


RELATIVE_TOLERANCE = 1e-3  # calibration's documented precision: σ is the smallest to 0.1 %


def _smallest_within_tolerance(sigma, epsilon, target):
    """σ meets the target and σ·(1 − 0.1 %) does not, both by ``epsilon`` (dp_accounting
    directly): σ is within the documented 0.1 % of the smallest σ that meets it."""
    return epsilon(sigma) <= target < epsilon(sigma * (1 - RELATIVE_TOLERANCE))


def _whole_rdp_curves(action):
    """(result, how many whole RDP curves — per-step RDP at all orders — dp_accounting
    computed during ``action()``), counted order by order inside dp_accounting."""
    if hasattr(accountant, "_step_rdp"):
        accountant._step_rdp.cache_clear()
    compute = rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian
    computed = []

    def counted(q, noise_multiplier, orders):
        computed.append(len(orders))
        return compute(q, noise_multiplier, orders)

    rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian = counted
    try:
        result = action()
    finally:
        rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian = compute
    return result, sum(computed) / len(RDP_ORDERS)


@pytest.mark.parametrize("num_examples, batch_size", [(512, 32), (512, 256), (60000, 256)])
@pytest.mark.parametrize("sigma", [0.6, 1.1, 3.0])
def test_epsilon_from_per_step_curves_equals_dp_accounting(num_examples, batch_size, sigma):
    """Grid over (N, L, σ, T, δ): the same float as composing in dp_accounting's RdpAccountant
    (count × per-step RDP, summed in the same order: bit for bit)."""
    for steps in (1, 37, 14063):
        for delta in (1e-5, 1e-3):
            event = dp_sgd_event(batch_size / num_examples, sigma, steps)
            assert epsilon_of_event(event, delta) == _slow_epsilon(event, delta)


def test_composed_phases_equal_dp_accounting():
    """A ledger-like composition: Poisson phases at different (q, σ), unamplified batches,
    no-ops; a non-private step makes ε infinite, as in dp_accounting."""
    phases = dp_event.ComposedDpEvent([
        dp_sgd_event(256 / 60000, 1.1, 1000),
        dp_event.NoOpDpEvent(),
        dp_sgd_event(512 / 60000, 1.5, 500),
        dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(20.0), 10),
    ])
    for delta in (1e-5, 1e-6):
        assert epsilon_of_event(phases, delta) == _slow_epsilon(phases, delta)
    spent = dp_event.ComposedDpEvent([phases, dp_event.NonPrivateDpEvent()])
    assert math.isinf(epsilon_of_event(spent, 1e-5)) and math.isinf(_slow_epsilon(spent, 1e-5))


def test_other_events_and_pld_take_the_accountant_path():
    laplace = dp_event.SelfComposedDpEvent(dp_event.LaplaceDpEvent(2.0), 3)
    assert epsilon_of_event(laplace, 1e-5) == _slow_epsilon(laplace, 1e-5)
    event = dp_sgd_event(0.01, 1.0, 100)
    assert epsilon_of_event(event, 1e-5, "pld") == _slow_epsilon(event, 1e-5, "pld")


def test_epsilon_for_many_step_counts_reuses_one_curve():
    """ε(T) for any T is T × one per-step curve: after the first T, dp_accounting is not
    consulted again; a budget search (largest T with ε ≤ 2) equals the slow search's."""
    rate, sigma, delta = 64 / 10000, 0.9, 1e-5

    def fits(steps):
        return epsilon_of_event(dp_sgd_event(rate, sigma, steps), delta) <= 2.0

    largest, curves = _whole_rdp_curves(lambda: largest_fitting(fits, 1, 10**8))
    assert curves == 1  # one per step count searched (~30) before
    slow = largest_fitting(lambda steps: _slow_epsilon(dp_sgd_event(rate, sigma, steps), delta) <= 2.0, 1, 10**8)
    assert largest == slow
    assert fits(largest) and not fits(largest + 1)


CALIBRATIONS = [
    # target ε, N, L, T, δ
    (2.0, 512, 32, 32, 1e-5),  # the 512 rows × 2 epochs
    (2.0, 512, 64, 16, 1e-5),
    (3.0, 60000, 256, 14063, 1e-5),  # the tutorial's 60 epochs
    (1.0, 60000, 1024, 1758, 1e-5),
    (8.0, 1000, 100, 50, 1e-3),
    (0.5, 50000, 500, 500, 1e-6),
    (20.0, 100, 10, 5, 1e-5),  # a large target: σ < 1 and the bisection's (0, 1] branch
]


@pytest.mark.parametrize("target, num_examples, batch_size, steps, delta", CALIBRATIONS)
def test_rdp_calibration_is_the_smallest_sigma_with_few_evaluations(target, num_examples, batch_size,
                                                                   steps, delta):
    sigma, curves = _whole_rdp_curves(
        lambda: calibrate_noise_multiplier(target, num_examples, batch_size, steps=steps, delta=delta))
    rate = batch_size / num_examples
    assert _smallest_within_tolerance(sigma, lambda s: _slow_epsilon(dp_sgd_event(rate, s, steps), delta), target)
    assert curves <= 3  # the original bisection computed 12–13 whole curves


def test_rdp_calibration_after_a_prior_event_is_the_smallest_sigma():
    prior = dp_sgd_event(256 / 60000, 1.1, 3000)
    rate, steps = 256 / 60000, 2000

    def slow(sigma):
        return _slow_epsilon(dp_event.ComposedDpEvent([prior, dp_sgd_event(rate, sigma, steps)]), 1e-5)

    sigma = calibrate_noise_multiplier(2.0, 60000, 256, steps=steps, prior_event=prior)
    assert _smallest_within_tolerance(sigma, slow, 2.0)


def test_pld_calibration_is_the_smallest_sigma_with_half_the_evaluations(monkeypatch):
    """PLD has no curve to reuse; the RDP answer starts the secant close by. The result is
    the smallest σ to 0.1 % (checked here directly: the bisection cost 12 PLD evaluations)."""
    calls = []
    get_epsilon = pld_privacy_accountant.PLDAccountant.get_epsilon

    def counted(self, delta):
        calls.append(delta)
        return get_epsilon(self, delta)

    monkeypatch.setattr(pld_privacy_accountant.PLDAccountant, "get_epsilon", counted)
    sigma = calibrate_noise_multiplier(2.0, 512, 32, steps=32, accountant="pld")
    assert len(calls) <= 6  # 12 before
    monkeypatch.undo()

    def epsilon(s):
        return _slow_epsilon(dp_sgd_event(1 / 16, s, 32), 1e-5, "pld")

    assert _smallest_within_tolerance(sigma, epsilon, 2.0)


def test_unreachable_target_still_raises():
    with pytest.raises(ValueError, match="unreachable"):
        calibrate_noise_multiplier(1.0, 1000, 10, steps=10, prior_event=dp_event.NonPrivateDpEvent())
