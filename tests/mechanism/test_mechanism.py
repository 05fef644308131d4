"""DPMechanism (tf_dp/mechanism.py): the parts of a run checked together once, answering the
model's and the accountant's questions by asking its parts; and no module of tf_dp.models or the
callbacks compares a scheme's name (the test that fails on the code before it)."""

import ast
import pathlib

import keras
import pytest
from dp_accounting import dp_event

import tf_dp
from tf_dp.accounting import events
from tf_dp.accounting.events import Phase
from tf_dp.mechanism import DPMechanism, FixedBatches
from tf_dp.noise import BandMF
from tf_dp.sampling.cyclic_poisson import CyclicPoissonSampling
from tf_dp.sampling.schemes import PoissonSampling

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _optimizer(noise=None):
    return tf_dp.DPOptimizer(keras.optimizers.SGD(0.1), l2_norm_clip=1.0, noise_multiplier=1.1, noise=noise)


def test_parts_are_the_optimizers_and_the_ledger_phase_is_the_schemes():
    optimizer = _optimizer()
    mechanism = DPMechanism.of(optimizer, PoissonSampling(1000, 10))
    assert mechanism.privatizer is optimizer.privatizer and mechanism.clipping is optimizer.clipping
    assert mechanism.clip_bound is None  # a constant C
    assert mechanism.ledger_arguments() == ("poisson", 0.01, 1000, 10, 0.0)
    assert not mechanism.new_segment and not mechanism.accounted_whole and mechanism.declared_batch_size is None
    batches = DPMechanism.of(optimizer, FixedBatches(32))
    assert batches.ledger_arguments() == ("batches", 1.0, 0, 32, 0.0) and batches.declared_batch_size == 32.0


def test_a_privatizer_needing_its_sampling_is_refused_with_explicit_batches_only():
    optimizer = _optimizer(BandMF(4))
    with pytest.raises(ValueError, match="needs 'cyclic_poisson' sampling.*explicit batches"):
        DPMechanism.of(optimizer, FixedBatches(32))
    with pytest.raises(ValueError, match="needs 'cyclic_poisson' sampling.*'poisson' sampling"):
        DPMechanism.of(optimizer, PoissonSampling(1000, 10))
    cyclic = DPMechanism.of(optimizer, CyclicPoissonSampling(1000, 10, num_bands=4))
    assert cyclic.new_segment and cyclic.accounted_whole and cyclic.ledger_arguments()[4] == 4.0


def test_event_is_the_registered_one_of_its_own_phases_only():
    mechanism = DPMechanism.of(_optimizer(), PoissonSampling(1000, 10))
    phase = Phase("poisson", 0.01, 1.1, 1000, 10.0, 50)
    assert mechanism.event(phase) == dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(1.1)), 50)
    with pytest.raises(ValueError, match="not one of this mechanism's"):
        mechanism.event(Phase("batches", 1.0, 1.1, 0, 10.0, 5))


def _compared_scheme_names(path: pathlib.Path) -> list:
    names = set(events.SCHEME_CODES) - {"batches"}  # "batches": the explicit batches the model itself handles
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                if isinstance(operand, ast.Constant) and operand.value in names:
                    found.append((path.name, node.lineno, operand.value))
    return found


def test_models_and_callbacks_hold_no_branch_on_a_scheme_name():
    paths = sorted((ROOT / "tf_dp" / "models").glob("*.py")) + [ROOT / "tf_dp" / "accounting" / "callbacks.py"]
    assert [hit for path in paths for hit in _compared_scheme_names(path)] == []
