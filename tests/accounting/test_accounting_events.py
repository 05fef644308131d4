"""The accounting registries (docs/algorithms.md, appendix A): every registered scheme's event
against a dp_accounting event built here by hand; one ε whichever way it is asked for (ledger,
compute_epsilon, the event); RDP against PLD; segments; ledgers saved before the registry.

The references are dp_accounting's own accountants and functions, called directly."""

import ast
import dataclasses
import json
import math
import pathlib

import keras
import numpy as np
import pytest
import tensorflow as tf
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

import tf_dp
from tf_dp import raco
from tf_dp.accounting import events
from tf_dp.accounting.accountant import PLD_DISCRETIZATION, RDP_ORDERS
from tf_dp.accounting.events import Phase, composed_event, epsilon, phase_event, register_event
from tf_dp.accounting.ledger import PrivacyLedger

ROOT = pathlib.Path(__file__).resolve().parents[2]
LEGACY = ROOT / "tests" / "data" / "legacy_ledger"


def _rdp_by_dp_accounting(event, delta, orders=RDP_ORDERS):
    engine = rdp_privacy_accountant.RdpAccountant(list(orders))
    engine.compose(event)
    return float(engine.get_epsilon(delta))


def _pld_by_dp_accounting(event, delta):
    engine = pld_privacy_accountant.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
    engine.compose(event)
    return float(engine.get_epsilon(delta))


# Each scheme's event, built by hand from its definition (docs/algorithms.md A.1, §5, §7.1).
HAND_BUILT = {
    "poisson": lambda p: dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(p.sampling_rate, dp_event.GaussianDpEvent(p.noise_multiplier)), p.steps),
    "batches": lambda p: dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(p.noise_multiplier), p.steps),
    # User-level (§11): the subsampled Gaussian over users, q_u = L_u/N_u.
    "user_poisson": lambda p: dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(p.sampling_rate, dp_event.GaussianDpEvent(p.noise_multiplier)), p.steps),
    "raco_poisson": lambda p: dp_event.SelfComposedDpEvent(
        raco.GaussianLaplaceDpEvent(p.sampling_rate, p.noise_multiplier, p.parameter), p.steps),
    # BandMF (docs/algorithms.md §10): q_b = b·L/N, one participation per b steps: ⌈T/b⌉ rounds.
    "cyclic_poisson": lambda p: dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(p.parameter * p.expected_batch_size / p.num_examples,
                                       dp_event.GaussianDpEvent(p.noise_multiplier)), -(-p.steps // int(p.parameter))),
    # Balls-in-bins (§15): one Gaussian per epoch window of B = parameter steps the T steps overlap.
    "balls_in_bins": lambda p: dp_event.SelfComposedDpEvent(
        dp_event.GaussianDpEvent(p.noise_multiplier), math.ceil((p.steps - 1) / p.parameter) + 1),
}
SAMPLE_PHASES = {
    "poisson": Phase("poisson", 0.01, 1.1, 10000, 100.0, 300),
    "batches": Phase("batches", 1.0, 4.0, 0, 32.0, 7),
    "user_poisson": Phase("user_poisson", 0.05, 1.3, 1090, 54.5, 40),
    "raco_poisson": Phase("raco_poisson", 0.125, 4.0, 32561, 4096.0, 12, parameter=2.0),
    "cyclic_poisson": Phase("cyclic_poisson", 0.04, 1.1, 10000, 100.0, 30, parameter=4.0),
    "balls_in_bins": Phase("balls_in_bins", 0.01, 1.1, 10000, 100.0, 250, parameter=100.0),
}


@pytest.mark.parametrize("scheme", events.registered_schemes())
def test_every_registered_scheme_builds_the_hand_built_event(scheme):
    assert scheme in HAND_BUILT, f"scheme {scheme!r} is registered: add its hand-built event to this test"
    phase = SAMPLE_PHASES[scheme]
    assert phase_event(phase) == HAND_BUILT[scheme](phase)
    # The shared rules: no steps → NoOp, σ = 0 → not private.
    assert phase_event(dataclasses.replace(phase, steps=0)) == dp_event.NoOpDpEvent()
    assert phase_event(dataclasses.replace(phase, noise_multiplier=0.0)) == dp_event.NonPrivateDpEvent()


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize("scheme", ["poisson", "batches"])
def test_ledger_compute_epsilon_and_event_give_dp_accountings_epsilon(scheme, accountant):
    """One phase, four ways: the ledger, compute_epsilon, epsilon(event), dp_accounting directly.
    30 steps of the unsampled scheme (each PLD of 300 such steps takes ~9 s to compose)."""
    n, batch, sigma, delta = 10000, 100, 1.1, 1e-5
    steps = 300 if scheme == "poisson" else 30
    rate = 1.0 if scheme == "batches" else batch / n
    ledger = PrivacyLedger()
    ledger.open_phase(scheme, rate, sigma, n, float(batch))
    ledger.steps.assign(steps)
    by_ledger = ledger.epsilon(delta, accountant)
    by_function = tf_dp.compute_epsilon(n, batch, sigma, steps=steps, delta=delta, accountant=accountant,
                                        scheme=scheme)
    by_event = epsilon(ledger.event(), delta, accountant)
    hand = HAND_BUILT[scheme](Phase(scheme, rate, sigma, n, float(batch), steps))
    reference = (_rdp_by_dp_accounting if accountant == "rdp" else _pld_by_dp_accounting)(hand, delta)
    assert by_ledger == by_function == by_event == reference


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_raco_phase_gives_one_epsilon_everywhere(accountant):
    """The RaCO-DP plug-in: ledger, tf_dp.compute_epsilon(scheme=...), tf_dp.raco.compute_epsilon
    and the hand computation (its PLD self-composed; its RDP at the integer orders) agree."""
    q, sigma, scale, steps, delta = 4096 / 32561, 4.0, 2.0, 12, 1e-4
    ledger = PrivacyLedger()
    ledger.open_phase("raco_poisson", q, sigma, 32561, 4096.0, scale)
    ledger.steps.assign(steps)
    by_ledger = ledger.epsilon(delta, accountant)
    by_core = tf_dp.compute_epsilon(32561, 4096, sigma, steps=steps, delta=delta, accountant=accountant,
                                    scheme="raco_poisson", parameter=scale)
    by_raco = raco.compute_epsilon(32561, 4096, sigma, scale, steps, delta, accountant=accountant)
    if accountant == "pld":
        hand = raco.joint_step_pld(q, sigma, scale).self_compose(steps).get_epsilon_for_delta(delta)
    else:
        orders = np.array(raco.accounting.INTEGER_RDP_ORDERS)
        step = raco.accounting.poisson_subsampled_rdp(
            q, orders, lambda a: raco.accounting.gaussian_rdp(a, sigma) + raco.accounting.laplace_rdp(a, scale))
        hand = rdp_privacy_accountant.compute_epsilon(orders, steps * step, delta)[0]
    assert by_ledger == by_core == by_raco == pytest.approx(hand, rel=1e-12)


def _mixed_ledger():
    ledger = PrivacyLedger()
    ledger.open_phase("poisson", 256 / 60000, 1.1, 60000, 256.0)
    ledger.steps.assign(100)
    ledger.open_phase("raco_poisson", 4096 / 32561, 4.0, 32561, 4096.0, 2.0)
    ledger.steps.assign(120)
    ledger.open_phase("batches", 1.0, 3.0, 0, 64.0)
    ledger.steps.assign(125)
    return ledger


def test_mixed_ledger_under_rdp_is_the_sum_at_the_integer_orders():
    """A RaCO-DP phase between plain phases (this crashed before: a scalar order passed to
    dp_accounting): every phase's RDP at the integer orders ≥ 2 Zhu & Wang's bound needs,
    summed, converted by dp_accounting."""
    orders = np.array(raco.accounting.INTEGER_RDP_ORDERS)
    gaussian = rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian
    joint = raco.accounting.poisson_subsampled_rdp(
        4096 / 32561, orders, lambda a: raco.accounting.gaussian_rdp(a, 4.0) + raco.accounting.laplace_rdp(a, 2.0))
    total = 100 * gaussian(256 / 60000, 1.1, orders) + 20 * joint + 5 * gaussian(1.0, 3.0, orders)
    expected = rdp_privacy_accountant.compute_epsilon(orders, total, 1e-5)[0]
    assert _mixed_ledger().epsilon(1e-5, "rdp") == pytest.approx(expected, rel=1e-12)


def test_mixed_ledger_under_pld_composes_each_phases_pld():
    from dp_accounting.pld import privacy_loss_distribution as pld

    first = pld.from_gaussian_mechanism(1.1, sampling_prob=256 / 60000,
                                        value_discretization_interval=PLD_DISCRETIZATION).self_compose(100)
    second = raco.joint_step_pld(4096 / 32561, 4.0, 2.0).self_compose(20)
    third = pld.from_gaussian_mechanism(3.0, value_discretization_interval=PLD_DISCRETIZATION).self_compose(5)
    expected = first.compose(second).compose(third).get_epsilon_for_delta(1e-5)
    assert _mixed_ledger().epsilon(1e-5, "pld") == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("phases", [
    [SAMPLE_PHASES["poisson"]],
    [SAMPLE_PHASES["poisson"], SAMPLE_PHASES["batches"]],
    [SAMPLE_PHASES["raco_poisson"]],
    [SAMPLE_PHASES["poisson"], SAMPLE_PHASES["raco_poisson"], SAMPLE_PHASES["batches"]],
])
def test_pld_is_tighter_than_rdp_and_both_are_finite(phases):
    rdp, pld = epsilon(phases, 1e-5, "rdp"), epsilon(phases, 1e-5, "pld")
    assert 0 < pld <= rdp < math.inf


def test_plug_in_pld_path_equals_dp_accountings_pld_accountant_on_plain_events():
    """The PLD composition used when a plug-in step is present, on dp_accounting's own events,
    against its PLDAccountant: the same up to the accountant's discretization."""
    from tf_dp.accounting import accountant

    event = composed_event([SAMPLE_PHASES["poisson"], SAMPLE_PHASES["batches"]])
    walked = accountant._pld_of(event).get_epsilon_for_delta(1e-5)
    assert walked == pytest.approx(_pld_by_dp_accounting(event, 1e-5), rel=1e-3)


def test_a_non_private_phase_makes_every_accountant_infinite():
    phases = [SAMPLE_PHASES["raco_poisson"], dataclasses.replace(SAMPLE_PHASES["poisson"], noise_multiplier=0.0)]
    assert math.isinf(epsilon(phases, 1e-5, "rdp")) and math.isinf(epsilon(phases, 1e-5, "pld"))
    assert epsilon([dataclasses.replace(SAMPLE_PHASES["poisson"], steps=0)], 1e-5) == 0.0


# ------------------------------------------------------------------ registries and errors


def test_registry_errors_name_the_problem():
    with pytest.raises(ValueError, match="no_such_scheme"):
        phase_event(dataclasses.replace(SAMPLE_PHASES["poisson"], scheme="no_such_scheme"))
    with pytest.raises(ValueError, match="code="):
        register_event("unreserved_scheme")
    with pytest.raises(ValueError, match="already registered"):
        register_event("poisson")(lambda phase: dp_event.NoOpDpEvent())
    with pytest.raises(ValueError, match="clashes"):
        register_event("another_scheme", code=events.SCHEME_CODES["poisson"])
    with pytest.raises(ValueError, match="accountant"):
        epsilon([SAMPLE_PHASES["poisson"]], 1e-5, "moments")
    with pytest.raises(ValueError, match="scheme"):
        PrivacyLedger().open_phase("no_such_scheme", 0.1, 1.0, 100, 10.0)


def test_cyclic_poisson_has_a_reserved_ledger_code():
    assert events.SCHEME_CODES["cyclic_poisson"] == 3 and events.SCHEME_CODES["raco_poisson"] == 4


def test_unreachable_target_names_the_largest_sigma_tried():
    """The error states the σ the search really stops at (2¹³), not 1e4 as before."""
    with pytest.raises(ValueError, match=r"even noise_multiplier=8192 exceeds"):
        tf_dp.calibrate_noise_multiplier(1.0, 1000, 10, steps=10, prior_event=dp_event.NonPrivateDpEvent())
    assert tf_dp.accounting.LARGEST_NOISE_MULTIPLIER == 2.0**13


def test_the_core_imports_nothing_from_raco():
    for name in ("events.py", "ledger.py", "accountant.py", "callbacks.py", "budget.py", "__init__.py"):
        tree = ast.parse((ROOT / "tf_dp" / "accounting" / name).read_text())
        imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in imported if m.startswith("tf_dp.raco")], (name, imported)


# ---------------------------------------------------------------------------- segments


def test_new_segment_opens_a_phase_at_the_same_settings():
    ledger = PrivacyLedger()
    ledger.open_phase("poisson", 0.01, 1.0, 1000, 10.0)
    ledger.steps.assign(5)
    ledger.open_phase("poisson", 0.01, 1.0, 1000, 10.0)  # same settings: continues
    assert [p.steps for p in ledger.phases()] == [5]
    ledger.open_phase("poisson", 0.01, 1.0, 1000, 10.0, new_segment=True)
    ledger.steps.assign(8)
    phases = ledger.phases()
    assert [p.steps for p in phases] == [5, 3] and phases[0].segment != phases[1].segment
    ledger.record_step(tf.constant(2.0))  # σ changed in the step: a new phase of the same segment
    phases = ledger.phases()
    assert [(p.noise_multiplier, p.steps) for p in phases] == [(1.0, 5), (1.0, 3), (2.0, 1)]
    assert phases[2].segment == phases[1].segment


def test_a_whole_segments_scheme_is_accounted_per_segment_at_its_smallest_sigma(monkeypatch):
    monkeypatch.setattr(events, "_EVENTS", dict(events._EVENTS))
    monkeypatch.setattr(events, "_WHOLE_SEGMENTS", set(events._WHOLE_SEGMENTS))
    monkeypatch.setattr(events, "SCHEME_CODES", dict(events.SCHEME_CODES))
    register_event("test_segmented", code=1000, whole_segments=True)(HAND_BUILT["poisson"])
    ledger = PrivacyLedger()
    ledger.open_phase("test_segmented", 0.01, 2.0, 1000, 10.0)
    ledger.steps.assign(4)
    ledger.record_step(tf.constant(1.5))  # same segment, smaller σ
    ledger.open_phase("test_segmented", 0.01, 2.0, 1000, 10.0, new_segment=True)
    ledger.steps.assign(8)
    expected = dp_event.ComposedDpEvent([HAND_BUILT["poisson"](Phase("poisson", 0.01, 1.5, 1000, 10.0, 5)),
                                         HAND_BUILT["poisson"](Phase("poisson", 0.01, 2.0, 1000, 10.0, 3))])
    assert ledger.event() == expected
    assert ledger.epsilon(1e-5) == _rdp_by_dp_accounting(expected, 1e-5)


# ------------------------------------------------------------------- legacy ledgers


def test_open_phase_keeps_the_models_former_call():
    """Models call open_phase(scheme, q, σ, N, L, histogram_noise) positionally; a "poisson"
    phase with a Laplace scale is a RaCO-DP phase."""
    ledger = PrivacyLedger()
    ledger.open_phase("poisson", 0.25, 2.0, 200, 50.0, 2.0)
    ledger.steps.assign(4)
    (phase,) = ledger.phases()
    assert (phase.scheme, phase.parameter) == ("raco_poisson", 2.0)


@pytest.mark.parametrize("name", ["plain", "raco"])
def test_a_ledger_saved_before_the_registry_loads_with_the_same_epsilon(name, tmp_path):
    """.keras files written by main at 9f3703f (tests/data/legacy_ledger/README.md): ε under
    both accountants as that code computed it; the plain one also against dp_accounting."""
    expected = json.loads((LEGACY / "expected.json").read_text())[name]
    delta = 1e-5 if name == "plain" else 1e-4
    model = keras.models.load_model(LEGACY / f"{name}.keras", compile=False)
    assert int(model.privacy_ledger.steps.numpy()) == expected["steps"]
    for accountant, value in expected["epsilon"].items():
        # rel 1e-9: the PLD accountant's FFTs round differently across CPUs (5.6e-12 measured on
        # an AVX-512 AMD EPYC); any changed event (σ, q, steps) moves ε by orders of magnitude more.
        assert model.privacy_ledger.epsilon(delta, accountant) == pytest.approx(value, rel=1e-9)
    if name == "plain":
        rows = expected["phase_table_rows"]
        ends = [r[5] for r in rows[1:]] + [expected["steps"]]
        hand = dp_event.ComposedDpEvent([
            HAND_BUILT["poisson" if r[0] == 1 else "batches"](Phase("", r[1], r[2], 0, 0.0, int(end - r[5])))
            for r, end in zip(rows, ends)])
        assert model.privacy_ledger.epsilon(delta, "rdp") == _rdp_by_dp_accounting(hand, delta)
    else:
        (phase,) = model.privacy_ledger.phases()
        assert (phase.scheme, phase.parameter) == ("raco_poisson", 2.0)
    model.save(tmp_path / "again.keras")  # saved in today's layout, the same ε
    again = keras.models.load_model(tmp_path / "again.keras", compile=False)
    assert again.privacy_ledger.epsilon(delta, "pld") == model.privacy_ledger.epsilon(delta, "pld")
    assert again.privacy_ledger.phases() == model.privacy_ledger.phases()
