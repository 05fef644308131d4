"""A ``tf.train.Checkpoint`` written before the ledger's segment column (7 columns, docs/algorithms.md
A.2) restores into today's 8-column ledger with its steps, phases and ε unchanged; today's
checkpoints round-trip exactly. Reference: the ε the old code itself computed (expected.json) and
dp_accounting through the phases (tests/data/legacy_ledger/README.md)."""

import json
import pathlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp.accounting.ledger import MAX_PHASES

DATA = pathlib.Path(__file__).parents[1] / "data" / "legacy_ledger" / "checkpoint"
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 3)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32")


def _model():
    inputs = keras.Input((3,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0), loss=LOSS)
    return model


def _trained():
    """Two Poisson phases and one of explicit batches (what the legacy files hold)."""
    x, y = _data()
    model = _model()
    model.fit(x, y, batch_size=20, epochs=1, verbose=0, sampling_seed=0)
    model.optimizer.noise_multiplier = 1.5
    model.fit(x, y, batch_size=40, epochs=1, verbose=0, sampling_seed=1)
    model.train_on_batch(x[:25], y[:25])
    return model


def _used_rows(model):
    table = model.privacy_ledger.phase_table.numpy()
    return table[table[:, 0] > 0]


def test_a_checkpoint_written_by_the_7_column_ledger_restores_with_steps_and_epsilon_unchanged():
    expected = json.loads((DATA / "expected.json").read_text())
    assert expected["phase_table_shape"] == [MAX_PHASES, 7]
    model = _model()
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).restore(str(DATA / expected["checkpoint"]))
    assert int(model.privacy_ledger.steps.numpy()) == expected["steps"] == 16
    rows = _used_rows(model)
    np.testing.assert_array_equal(rows[:, :7], np.asarray(expected["phase_table_rows"]))
    np.testing.assert_array_equal(rows[:, 7], np.arange(1, len(rows) + 1))  # each old row its own segment
    for accountant, epsilon in expected["epsilon"].items():  # the old code's own ε
        assert model.get_epsilon(1e-5, accountant) == pytest.approx(epsilon, rel=1e-9)
    for restored, saved in zip(model.get_weights(), expected["weights"]):
        np.testing.assert_array_equal(restored, np.asarray(saved, dtype=np.float32))
    x, y = _data()
    before = model.get_epsilon(1e-5)
    model.fit(x, y, batch_size=20, epochs=1, verbose=0)  # the restored ledger keeps counting
    assert int(model.privacy_ledger.steps.numpy()) == 26 and model.get_epsilon(1e-5) > before


class _SevenColumnLedger(tf.Module):
    """The ledger's variables as the code before the segment column created them
    (``git show 52aa179^:tf_dp/accounting/ledger.py``: phases [MAX_PHASES, 7] float64, steps int64)."""

    def __init__(self, table, steps):
        super().__init__(name="privacy_ledger")
        self.phase_table = tf.Variable(table, dtype=tf.float64, trainable=False, name="phases")
        self.steps = tf.Variable(steps, dtype=tf.int64, trainable=False, name="steps")


class _Holder(tf.Module):
    def __init__(self, ledger):
        super().__init__()
        self.privacy_ledger = ledger


def test_a_freshly_written_7_column_checkpoint_restores_into_a_new_model(tmp_path):
    original = _trained()
    table = original.privacy_ledger.phase_table.numpy()
    old = _SevenColumnLedger(table[:, :7], int(original.privacy_ledger.steps.numpy()))
    path = tf.train.Checkpoint(model=_Holder(old)).write(str(tmp_path / "ckpt"))
    assert dict(tf.train.list_variables(path))["model/privacy_ledger/phase_table/.ATTRIBUTES/VARIABLE_VALUE"] \
        == [MAX_PHASES, 7]
    restored = _model()
    tf.train.Checkpoint(model=restored).restore(path).expect_partial()
    assert int(restored.privacy_ledger.steps.numpy()) == int(original.privacy_ledger.steps.numpy())
    np.testing.assert_array_equal(restored.privacy_ledger.phase_table.numpy(), table)  # segments 1, 2, 3
    for accountant in ("rdp", "pld"):
        assert restored.get_epsilon(1e-5, accountant) == pytest.approx(original.get_epsilon(1e-5, accountant),
                                                                      rel=1e-12)


def test_an_older_64_row_checkpoint_restores_too(tmp_path):
    original = _trained()
    table = original.privacy_ledger.phase_table.numpy()
    old = _SevenColumnLedger(table[:64, :7], int(original.privacy_ledger.steps.numpy()))
    path = tf.train.Checkpoint(model=_Holder(old)).write(str(tmp_path / "ckpt"))
    restored = _model()
    tf.train.Checkpoint(model=restored).restore(path).expect_partial()
    np.testing.assert_array_equal(restored.privacy_ledger.phase_table.numpy(), table)


def test_todays_checkpoint_round_trips_the_8_columns_exactly(tmp_path):
    original = _trained()
    table = original.privacy_ledger.phase_table.numpy().copy()
    table[1, 7] = 1.0  # a segment spanning two phases (BandMF's σ change): not the legacy default
    original.privacy_ledger.phase_table.assign(table)
    path = tf.train.Checkpoint(model=original, optimizer=original.optimizer).save(str(tmp_path / "ckpt"))
    assert dict(tf.train.list_variables(path))["model/privacy_ledger/phase_table/.ATTRIBUTES/VARIABLE_VALUE"] \
        == [MAX_PHASES, 8]
    restored = _model()
    status = tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).restore(path)
    status.assert_existing_objects_matched()  # the table's restorer is bound like the variable was
    np.testing.assert_array_equal(restored.privacy_ledger.phase_table.numpy(), table)
    assert int(restored.privacy_ledger.steps.numpy()) == int(original.privacy_ledger.steps.numpy())
