"""Amplified-BandMF accounting (docs/algorithms.md §10): ε of a segment equals dp_accounting's
PoissonSampled(q_b, Gaussian(σ)) composed ⌈T/b⌉ times, under RDP and PLD."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from tf_dp.accounting import compute_epsilon, epsilon_of_event
from tf_dp.accounting.accountant import PLD_DISCRETIZATION, RDP_ORDERS
from tf_dp.accounting.bandmf import (accounted_rounds, bandmf_event, bandmf_segment_event,
                                     calibrate_bandmf_noise_multiplier, cyclic_poisson_phase_event)

DELTA = 1e-5


def _dp_accounting_epsilon(rate, sigma, count, accountant):
    """dp_accounting directly: a fresh accountant composing the sampled Gaussian ``count`` times."""
    step = dp_event.PoissonSampledDpEvent(rate, dp_event.GaussianDpEvent(sigma))
    if accountant == "rdp":
        engine = rdp_privacy_accountant.RdpAccountant(RDP_ORDERS)
    else:
        engine = pld_privacy_accountant.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
    engine.compose(step, count)
    return engine.get_epsilon(DELTA)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize("steps,bands", [(2000, 4), (1001, 8), (10, 4)])
def test_epsilon_equals_dp_accounting_composed_ceil_t_over_b_times(accountant, steps, bands):
    n, batch, sigma = 60000, 256, 1.1
    q_b = bands * batch / n
    rounds = math.ceil(steps / bands)
    expected = _dp_accounting_epsilon(q_b, sigma, rounds, accountant)
    actual = epsilon_of_event(bandmf_event(q_b, sigma, steps, bands), DELTA, accountant)
    assert actual == pytest.approx(expected, rel=1e-9)
    if rounds > 1:  # ⌈T/b⌉ rounds, not ⌊T/b⌋ or T: the comparison can fail
        fewer = _dp_accounting_epsilon(q_b, sigma, rounds - 1, accountant)
        assert actual > fewer * (1 + 1e-6)


def test_rounds_are_the_ceiling():
    assert [accounted_rounds(t, 4) for t in (1, 3, 4, 5, 8, 9)] == [1, 1, 1, 2, 2, 3]


def test_one_band_is_dp_sgd():
    n, batch, sigma, steps = 60000, 256, 1.1, 14063
    event = bandmf_event(batch / n, sigma, steps, 1)
    assert epsilon_of_event(event, DELTA) == pytest.approx(compute_epsilon(n, batch, sigma, steps=steps,
                                                                           delta=DELTA), rel=1e-12)


def _phase(rate, sigma, steps, bands, num_examples=1000, batch=5):
    return SimpleNamespace(sampling_rate=rate, noise_multiplier=sigma, steps=steps, parameter=float(bands),
                           num_examples=num_examples, expected_batch_size=float(batch))


def test_a_segment_is_accounted_at_its_smallest_sigma():
    phases = [_phase(0.02, 1.2, 300, 4), _phase(0.02, 0.9, 101, 4)]
    event = bandmf_segment_event(phases)
    assert event == bandmf_event(0.02, 0.9, 401, 4)
    assert epsilon_of_event(event, DELTA) == pytest.approx(_dp_accounting_epsilon(0.02, 0.9, 101, "rdp"), rel=1e-9)
    assert cyclic_poisson_phase_event(phases[0]) == bandmf_event(0.02, 1.2, 300, 4)
    with pytest.raises(ValueError, match="one q_b and one number of bands"):
        bandmf_segment_event([phases[0], _phase(0.02, 1.0, 5, 2)])
    assert isinstance(bandmf_segment_event([]), dp_event.NoOpDpEvent)


def test_edge_cases_and_bad_input():
    assert isinstance(bandmf_event(0.1, 1.0, 0, 4), dp_event.NoOpDpEvent)
    assert epsilon_of_event(bandmf_event(0.1, 0.0, 10, 4), DELTA) == np.inf
    with pytest.raises(ValueError, match="sampling_rate_per_group"):
        bandmf_event(1.5, 1.0, 10, 4)
    with pytest.raises(ValueError, match="num_bands"):
        bandmf_event(0.1, 1.0, 10, 0)
    with pytest.raises(ValueError, match="steps"):
        bandmf_event(0.1, 1.0, -1, 2)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_calibrated_sigma_is_the_smallest_that_meets_the_target(accountant):
    n, batch, bands, epochs, target = 60000, 256, 4, 3, 2.0
    sigma = calibrate_bandmf_noise_multiplier(target, n, batch, bands, epochs=epochs, accountant=accountant)
    steps = math.ceil(epochs * n / batch)

    def epsilon(s):
        return _dp_accounting_epsilon(bands * batch / n, s, math.ceil(steps / bands), accountant)

    assert epsilon(sigma) <= target < epsilon(sigma * (1 - 2e-3))
    with pytest.raises(ValueError, match="num_bands=4 and batch_size=20000"):
        calibrate_bandmf_noise_multiplier(target, n, 20000, bands, epochs=1)


def test_a_phase_recording_l_over_n_is_still_accounted_at_b_l_over_n():
    recorded_q_b, recorded_q = _phase(0.02, 1.0, 100, 4), _phase(0.005, 1.0, 100, 4)  # N = 1000, L = 5, b = 4
    assert cyclic_poisson_phase_event(recorded_q) == cyclic_poisson_phase_event(recorded_q_b) == \
        bandmf_event(0.02, 1.0, 100, 4)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_ledger_phases_of_scheme_cyclic_poisson_go_through_the_registry(accountant):
    from tf_dp.accounting import Phase, epsilon

    n, batch, bands = 60000, 256, 4
    q_b = bands * batch / n

    def phase(sigma, steps, segment):
        return Phase("cyclic_poisson", q_b, sigma, n, float(batch), steps, float(bands), segment)

    one = epsilon([phase(1.1, 1001, 0)], DELTA, accountant)
    assert one == pytest.approx(_dp_accounting_epsilon(q_b, 1.1, math.ceil(1001 / bands), accountant), rel=1e-9)
    # σ changed inside a segment: ONE segment of 1001 + 500 steps at the smaller σ
    same_segment = epsilon([phase(1.1, 1001, 0), phase(0.9, 500, 0)], DELTA, accountant)
    assert same_segment == pytest.approx(_dp_accounting_epsilon(q_b, 0.9, math.ceil(1501 / bands), accountant),
                                         rel=1e-9)
    # two segments (two fits): composed, ⌈1001/4⌉ + ⌈500/4⌉ rounds
    two = epsilon([phase(1.1, 1001, 0), phase(1.1, 500, 1)], DELTA, accountant)
    composed = dp_event.ComposedDpEvent([bandmf_event(q_b, 1.1, 1001, bands), bandmf_event(q_b, 1.1, 500, bands)])
    assert two == pytest.approx(epsilon_of_event(composed, DELTA, accountant), rel=1e-9)
    # phase-by-phase at each own σ would be smaller than the sound account: the test can fail
    per_phase = epsilon_of_event(dp_event.ComposedDpEvent(
        [bandmf_event(q_b, 1.1, 1001, bands), bandmf_event(q_b, 0.9, 500, bands)]), DELTA, accountant)
    assert per_phase < same_segment


def test_compute_epsilon_and_calibration_by_scheme_use_b_l_over_n():
    n, batch, bands, steps = 60000, 256, 4, 2000
    expected = _dp_accounting_epsilon(bands * batch / n, 1.1, math.ceil(steps / bands), "rdp")
    assert compute_epsilon(n, batch, 1.1, steps=steps, delta=DELTA, scheme="cyclic_poisson",
                           parameter=bands) == pytest.approx(expected, rel=1e-9)
    from tf_dp.accounting import calibrate_noise_multiplier
    by_scheme = calibrate_noise_multiplier(2.0, n, batch, steps=steps, scheme="cyclic_poisson", parameter=bands)
    assert by_scheme == pytest.approx(calibrate_bandmf_noise_multiplier(2.0, n, batch, bands, steps=steps), rel=2e-3)
