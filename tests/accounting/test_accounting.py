"""Accountant known answers, calibration, and the ledger's composition of phases."""

import math

import pytest

from tf_dp.accounting import PrivacyLedger, calibrate_noise_multiplier, compute_epsilon, steps_for


def test_known_answers_rdp_and_pld():
    # docs/algorithms.md §1: N=60000, L=256, σ=1.1, 60 epochs (14063 steps), δ=1e-5.
    assert steps_for(60000, 256, 60, None) == 14063
    assert compute_epsilon(60000, 256, 1.1, epochs=60, delta=1e-5) == pytest.approx(2.597, abs=0.01)
    assert compute_epsilon(60000, 256, 1.1, epochs=60, delta=1e-5, accountant="pld") == pytest.approx(2.382, abs=0.01)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_calibration_round_trips(accountant):
    sigma = calibrate_noise_multiplier(2.0, 60000, 256, epochs=10, delta=1e-5, accountant=accountant)
    assert compute_epsilon(60000, 256, sigma, epochs=10, accountant=accountant) <= 2.0
    assert compute_epsilon(60000, 256, sigma * 0.99, epochs=10, accountant=accountant) > 2.0


def test_epsilon_grows_with_steps_and_falls_with_noise():
    base = compute_epsilon(10000, 100, 1.0, steps=100)
    assert compute_epsilon(10000, 100, 1.0, steps=200) > base
    assert compute_epsilon(10000, 100, 2.0, steps=100) < base
    assert math.isinf(compute_epsilon(10000, 100, 0.0, steps=1))


@pytest.mark.parametrize("kwargs, match", [
    ({"batch_size": 70000}, "batch_size"),
    ({"delta": 1.0}, "delta"),
    ({"delta": 0.0}, "delta"),
    ({"noise_multiplier": -1.0}, "noise_multiplier"),
    ({"num_examples": 0}, "num_examples"),
    ({"accountant": "moments"}, "accountant"),
    ({"epochs": None}, "exactly one"),
])
def test_bad_arguments_are_named(kwargs, match):
    args = {"num_examples": 60000, "batch_size": 256, "noise_multiplier": 1.1, "epochs": 1, "delta": 1e-5, **kwargs}
    with pytest.raises((ValueError, TypeError), match=match):
        compute_epsilon(**args)


def test_unreachable_target_is_a_clear_error():
    from dp_accounting import dp_event

    spent = dp_event.NonPrivateDpEvent()
    with pytest.raises(ValueError, match="unreachable"):
        calibrate_noise_multiplier(1.0, 1000, 10, steps=10, prior_event=spent)


def test_ledger_composes_phases_exactly():
    ledger = PrivacyLedger()
    ledger.open_phase("poisson", 256 / 60000, 1.1, 60000, 256)
    ledger.steps.assign(1000)
    ledger.open_phase("poisson", 512 / 60000, 1.5, 60000, 512)  # changed σ and L: a new phase
    ledger.steps.assign(1500)
    phases = ledger.phases()
    assert [(p.sampling_rate, p.noise_multiplier, p.steps) for p in phases] == [
        (256 / 60000, 1.1, 1000), (512 / 60000, 1.5, 500)
    ]
    first_only = compute_epsilon(60000, 256, 1.1, steps=1000)
    assert ledger.epsilon(1e-5) > first_only
    assert ledger.epsilon(1e-5) < first_only + compute_epsilon(60000, 512, 1.5, steps=500)  # RDP composes tighter


def test_ledger_same_settings_continue_the_phase_and_batches_are_unamplified():
    ledger = PrivacyLedger()
    ledger.open_phase("batches", 1.0, 1.0, 0, 0.0)
    ledger.steps.assign(10)
    ledger.open_phase("batches", 1.0, 1.0, 0, 0.0)
    assert len(ledger.phases()) == 1 and ledger.phases()[0].steps == 10
    # Without amplification, 10 steps at σ=1 cost far more than 10 Poisson steps at q=0.01.
    assert ledger.epsilon(1e-5) > 5 * compute_epsilon(1000, 10, 1.0, steps=10)


def test_empty_ledger_reports_zero():
    assert PrivacyLedger().epsilon(1e-5) == 0.0
