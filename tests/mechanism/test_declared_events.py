"""The mechanism object is held and used: each sampling part declares its accounting event, the
running ``DPMechanism`` asks its part (not a name table), the step plan holds the mechanism, and a
reloaded ledger (names only) composes the very same events (docs/algorithms.md A.1)."""

import keras
import numpy as np
import pytest
from dp_accounting import dp_event, rdp

import tf_dp
from tf_dp.accounting import events
from tf_dp.mechanism import DPMechanism, FixedBatches
from tf_dp.sampling.schemes import SAMPLING_SCHEMES

DELTA = 1e-5


def _phase(scheme, **changes):
    settings = dict(scheme=scheme, sampling_rate=0.01, noise_multiplier=1.1, num_examples=6000,
                    expected_batch_size=60, steps=250, parameter=4.0 if scheme == "cyclic_poisson" else 0.0)
    return events.Phase(**{**settings, **changes})


@pytest.mark.parametrize("name", sorted(SAMPLING_SCHEMES))
def test_every_sampling_part_declares_its_event_and_the_name_table_holds_it(name):
    part = SAMPLING_SCHEMES[name]
    assert part.event is not None, f"{name} declares no event"
    assert events._EVENTS[name] is part.event  # what a reloaded ledger's names resolve to
    assert events.is_segmented(name) == part.whole_segments
    assert events.scheme_unit(name) == part.unit


def test_fixed_batches_declares_the_unamplified_gaussian():
    mechanism = DPMechanism(FixedBatches(32))
    phase = _phase("batches", sampling_rate=1.0)
    # independently: T Gaussians at σ, composed by dp_accounting's RDP accountant
    accountant = rdp.RdpAccountant()
    accountant.compose(dp_event.GaussianDpEvent(1.1), 250)
    assert events.epsilon(mechanism.event(phase), DELTA) == pytest.approx(accountant.get_epsilon(DELTA), rel=1e-9)
    assert not mechanism.accounted_whole


def test_the_mechanism_asks_its_part_not_the_name_table(monkeypatch):
    scheme = SAMPLING_SCHEMES["poisson"](6000, 60)
    mechanism = DPMechanism(scheme)
    phase = _phase("poisson")
    monkeypatch.setitem(events._EVENTS, "poisson", lambda p: dp_event.NonPrivateDpEvent())
    # the running mechanism's event comes from the part; only the name path sees the swapped table
    accountant = rdp.RdpAccountant()
    accountant.compose(dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(1.1)), 250)
    assert events.epsilon(mechanism.event(phase), DELTA) == pytest.approx(accountant.get_epsilon(DELTA), rel=1e-9)
    assert events.epsilon([phase], DELTA) == np.inf


def test_the_step_plan_holds_the_running_mechanism_without_retracing():
    x = np.random.default_rng(0).normal(size=(64, 3)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    model = tf_dp.DPSequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0), loss="sparse_categorical_crossentropy")
    seen = []

    class Probe(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append((self.model.step_plan.mechanism, self.model.train_function))

    model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=2, verbose=0, callbacks=[Probe()])
    mechanism = seen[0][0]
    assert isinstance(mechanism, DPMechanism) and mechanism.scheme.ledger_scheme == "poisson"
    assert mechanism.privatizer is model.optimizer.privatizer
    assert seen[0][1] is seen[1][1]  # one trace for the fit
    model.train_on_batch(x[:16], y[:16], batch_size=16)
    assert isinstance(model.step_plan.mechanism.scheme, FixedBatches)
    # ε of the ledger (names) equals ε of the phases asked of the parts that ran them
    phases = model.privacy_ledger.accounted_phases()
    by_parts = dp_event.ComposedDpEvent([DPMechanism(mechanism.scheme if p.scheme == "poisson" else FixedBatches(16))
                                         .event(p) for p in phases])
    assert events.epsilon(by_parts, DELTA) == pytest.approx(model.privacy_ledger.epsilon(DELTA), rel=1e-12)
