"""The privacy ledger: what a model actually ran, saved with the model (docs/algorithms.md A.2).

One row per phase — a stretch of steps with the same sampling scheme, sampling rate q,
noise multiplier σ, N, L and scheme parameter — plus the count of DP steps taken. Rows and
the counter are Keras variables, so ``model.save(".keras")`` and checkpoints keep them, and ε
after a reload covers every step ever taken. ε is the composition of all phases, each turned
into a dp_accounting event by its scheme (``tf_dp.accounting.events``):

    poisson:  T_k × PoissonSampled(q_k, Gaussian(σ_k))
    batches:  T_k × Gaussian(σ_k)   (batches we could not resample: no amplification
              is claimed; each step may contain any example)
    others:   the event their package registered (``register_event``).

A row is [scheme code, q, σ, N, L, first step, parameter, segment].
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf
from dp_accounting import dp_event

from tf_dp.accounting import events
from tf_dp.accounting.draws import DrawGuard
from tf_dp.accounting.events import Phase, composed_event  # noqa: F401  (Phase is part of the ledger's API)

MAX_PHASES = 256
# scheme, sampling_rate, noise_multiplier, num_examples, expected_batch_size, first_step, parameter, segment
_COLUMNS = 8
_SCHEME, _SIGMA, _FIRST_STEP, _PARAMETER, _SEGMENT = 0, 2, 5, 6, 7
_SETTINGS = [0, 1, 2, 3, 4, 6]  # what must match for open_phase to continue the current phase
# Ledgers written before the scheme table (7 columns, and older): a "poisson" row with a
# nonzero column 6 (the scheme's parameter) is a phase of events.LEGACY_PARAMETERISED_POISSON.
_LEGACY_CODE, _LEGACY_PARAMETERISED_SCHEME = events.SCHEME_CODES["poisson"], events.LEGACY_PARAMETERISED_POISSON


def _scheme_name(code: float, parameter: float) -> str:
    names = {c: name for name, c in events.SCHEME_CODES.items()}
    if int(code) == _LEGACY_CODE and parameter:
        return _LEGACY_PARAMETERISED_SCHEME
    if int(code) not in names:
        raise ValueError(f"The privacy ledger holds a phase of unknown scheme code {int(code)} (known: {names}); "
                         "import the package that registers it.")
    return names[int(code)]


def _scheme_code(scheme: str) -> int:
    if scheme not in events.SCHEME_CODES:
        raise ValueError(f"`scheme` must be one of {sorted(events.SCHEME_CODES)}, got {scheme!r}.")
    return events.SCHEME_CODES[scheme]


class PrivacyLedger(tf.Module):
    """Keeps the phases and the DP step counter as TF variables.

    Deliberately not a Keras layer: it is not among ``model.weights``, so copying weights
    between models (``set_weights``) can never reset a model's privacy record. DP models
    write it into ``.keras`` files and checkpoints themselves.
    """

    STORE_KEYS = ("privacy_ledger_phases", "privacy_ledger_steps")

    def __init__(self):
        super().__init__(name="privacy_ledger")
        # ONLY_FIRST_REPLICA: under tf.distribute every replica runs the step, one counts it.
        once = tf.VariableAggregation.ONLY_FIRST_REPLICA
        self.phase_table = tf.Variable(np.zeros((MAX_PHASES, _COLUMNS)), dtype=tf.float64, trainable=False,
                                       name="phases", aggregation=once)
        self.steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="steps", aggregation=once)
        # Steps the compiled step refused because they could not be recorded (a transient
        # flag for the host, hidden from every saver).
        self._refusals = _Untracked(count=tf.Variable(0, dtype=tf.int64, trainable=False, name="refused_steps",
                                                      aggregation=once))
        self._restorer = _Untracked(table=_PhaseTableRestorer(self))
        # What each noise key and sampling seed has drawn on this ledger, in this process only.
        self._draws = _Untracked(guard=DrawGuard())

    # A tf.train.Checkpoint saves and restores "phase_table" through ``_PhaseTableRestorer``
    # (same key, same value), which restores every saved layout (7 columns before the segment
    # column, 64 rows); SavedModel export keeps the variable itself.
    def _trackable_children(self, save_type="checkpoint", **kwargs):
        children = super()._trackable_children(save_type, **kwargs)
        if getattr(save_type, "value", save_type) == "checkpoint" and "phase_table" in children:
            children = {**children, "phase_table": self._restorer.table}
        return children

    def _lookup_dependency(self, name, cached_dependencies=None):
        if name == "phase_table" and "_restorer" in self.__dict__:  # (absent while __init__ runs)
            return self._restorer.table
        return super()._lookup_dependency(name, cached_dependencies)

    def save_to(self, store) -> None:
        store[self.STORE_KEYS[0]] = self.phase_table.numpy()
        store[self.STORE_KEYS[1]] = self.steps.numpy()

    def load_from(self, store) -> None:
        self.phase_table.assign(upgraded_table(np.asarray(store[self.STORE_KEYS[0]])))
        self.steps.assign(np.asarray(store[self.STORE_KEYS[1]]))

    @property
    def draws(self) -> DrawGuard:
        """What each noise key and sampling seed has drawn on this ledger object in this
        process (``tf_dp.accounting.draws``): never saved, so a loaded file starts with none."""
        return self._draws.guard

    def _rows(self) -> np.ndarray:
        table = np.asarray(self.phase_table.numpy())
        return table[table[:, _SCHEME] > 0]

    def phases(self) -> list[Phase]:
        rows, total = self._rows(), int(self.steps.numpy())
        ends = list(rows[1:, _FIRST_STEP].astype(np.int64)) + [total]
        return [
            Phase(_scheme_name(r[0], r[6]), float(r[1]), float(r[2]), int(r[3]), float(r[4]), int(end - r[5]),
                  float(r[6]), int(r[7]))
            for r, end in zip(rows, ends)
        ]

    def open_phase(self, scheme: str, sampling_rate: float, noise_multiplier: float, num_examples: int,
                   expected_batch_size: float, parameter: float = 0.0, *, new_segment: bool = False) -> None:
        """Starts a phase at the current step unless the current phase has the same settings.

        Args:
          scheme: a scheme of ``events.SCHEME_CODES`` ("poisson", "batches", ...).
          sampling_rate, noise_multiplier, num_examples, expected_batch_size: q, σ, N, L.
          parameter: the scheme's parameter (``Phase.parameter``; 0.0 for "poisson" and
            "batches"). A nonzero parameter with scheme "poisson" is the call of models
            that predate the scheme table: it records a "raco_poisson" phase.
          new_segment: start a new phase (and segment) even at the same settings — a sampler
            whose run restarts (e.g. BandMF's noise buffer) must not continue the last one.
        """
        if scheme == "poisson" and parameter:
            scheme = _LEGACY_PARAMETERISED_SCHEME
        row = np.array([_scheme_code(scheme), sampling_rate, noise_multiplier, num_examples, expected_batch_size,
                        0.0, float(parameter), 0.0], dtype=np.float64)
        rows = self._rows()
        if len(rows) and not new_segment and np.array_equal(rows[-1, _SETTINGS], row[_SETTINGS]):
            return  # the settings alone decide: the step count is read only for a new row
        row[_FIRST_STEP] = int(self.steps.numpy())
        row[_SEGMENT] = rows[:, _SEGMENT].max() + 1 if len(rows) else 1
        if len(rows) and rows[-1, _FIRST_STEP] == row[_FIRST_STEP]:  # the current phase took no step: replace it
            index = len(rows) - 1
        else:
            index = len(rows)
        if index >= MAX_PHASES:
            raise RuntimeError(f"The privacy ledger holds at most {MAX_PHASES} phases.")
        table = np.asarray(self.phase_table.numpy()).copy()
        table[index] = row
        self.phase_table.assign(table)

    def current_phase(self):
        phases = self.phases()
        return phases[-1] if phases else None

    def record_step(self, noise_multiplier: tf.Tensor, taken: tf.Tensor | int = 1) -> tf.Tensor:
        """Counts one DP step at the σ it actually used (runs inside the compiled step).

        If σ differs from the current phase's (a callback or schedule changed it), a new
        phase opens at this step — a copy of the current one with this σ — so the ledger
        composes exactly what ran, step by step. ``taken`` is 1, or 0 for a step a privacy
        budget blocked. Runs before the step's update.

        A step that needs a new phase when the table is full cannot be recorded: it is
        refused — not counted, and the returned flag is 0, so the step must release
        nothing — and ``raise_if_refused`` stops training from the host right after.
        (No in-graph assertion: XLA compiles ``tf.debugging.Assert`` to a no-op.)

        Returns:
          float32 1.0 if the step is recorded (it may release), else 0.0.
        """
        table, steps = self.phase_table.read_value(), self.steps.read_value()
        sigma = tf.cast(noise_multiplier, tf.float64)
        wanted = tf.cast(taken, tf.bool)
        count = tf.reduce_sum(tf.cast(table[:, 0] > 0, tf.int32))
        last = tf.maximum(count - 1, 0)
        # A gather, not table[last]: a slice at a data-dependent offset makes XLA take the
        # table as a compile-time constant, recompiling the step at every new phase.
        current = tf.gather(table, last)
        new_phase = tf.logical_and(count > 0, current[2] != sigma)
        # A phase that has not taken a step yet is replaced rather than followed.
        index = tf.where(current[5] == tf.cast(steps, tf.float64), last, count)
        recorded = tf.logical_and(wanted, tf.logical_or(tf.logical_not(new_phase), index < MAX_PHASES))
        row = tf.tensor_scatter_nd_update(current, [[2], [5]], tf.stack([sigma, tf.cast(steps, tf.float64)]))
        updated = tf.tensor_scatter_nd_update(table, [[tf.minimum(index, MAX_PHASES - 1)]], row[None])
        self.phase_table.assign(tf.where(tf.logical_and(recorded, new_phase), updated, table))
        self.steps.assign_add(tf.cast(recorded, tf.int64))
        self._refusals.count.assign_add(tf.cast(tf.logical_and(wanted, tf.logical_not(recorded)), tf.int64))
        return tf.cast(recorded, tf.float32)

    def refused_steps(self) -> tf.Tensor:
        """Steps refused since the host last checked (read inside the compiled step)."""
        return self._refusals.count.read_value()

    def raise_if_refused(self) -> None:
        """Raises if the compiled step refused steps it could not record (called by the
        host after every execution of the train function)."""
        refused = int(self._refusals.count.numpy())
        if refused:
            self._refusals.count.assign(0)
            raise RuntimeError(
                f"tf_dp: training stopped: the privacy ledger holds at most {MAX_PHASES} phases and noise_multiplier "
                f"changed again, so {refused} step(s) were refused (they released nothing; the ledger and ε cover "
                f"the {int(self.steps.numpy())} steps that ran). Change noise_multiplier less often, e.g. once per "
                "epoch or in a few stages, rather than every step.")

    def accounted_phases(self) -> list[Phase]:
        """The phases, refusing a ledger with steps that no phase covers (``train_step``
        called before any ``fit``/``train_on_batch`` opened one): their q and σ are not
        recorded, so no ε can be stated for them."""
        rows, total = self._rows(), int(self.steps.numpy())
        uncovered = int(rows[0, 5]) if len(rows) else total
        if uncovered:
            raise ValueError(
                f"The privacy ledger counts {uncovered} DP step(s) taken before any phase was recorded (train_step "
                "called directly, outside fit/train_on_batch): their sampling rate and noise_multiplier are unknown, "
                "so no ε can be reported. Train through fit or train_on_batch, which record each phase.")
        return self.phases()

    def event(self) -> dp_event.DpEvent:
        return composed_event(self.accounted_phases())

    def epsilon(self, delta: float, accountant: str = events.DEFAULT_ACCOUNTANT) -> float:
        """ε at δ of every step taken so far (0 before the first step)."""
        if int(self.steps.numpy()) == 0:
            return 0.0
        return events.epsilon(self.accounted_phases(), delta, accountant)

    def epsilon_if_continued(self, extra_steps: int, noise_multiplier: float, delta: float,
                             accountant: str = events.DEFAULT_ACCOUNTANT) -> float:
        """ε after ``extra_steps`` more steps of the current phase at ``noise_multiplier``
        (the σ the next steps will use, which a callback may have changed)."""
        phases = self.accounted_phases()
        if not phases:
            raise ValueError("No phase is open: the ledger cannot project future steps.")
        future = dataclasses.replace(phases[-1], noise_multiplier=float(np.float32(noise_multiplier)),
                                     steps=int(extra_steps))
        return events.epsilon(phases + [future], delta, accountant)


def upgraded_table(saved: np.ndarray) -> np.ndarray:
    """A saved phase table in today's layout: MAX_PHASES rows (files of older versions held
    64), 8 columns (7 before the segment column: each old row is its own segment)."""
    saved = np.asarray(saved, dtype=np.float64)
    if saved.ndim != 2 or not 6 <= saved.shape[1] <= _COLUMNS:
        raise ValueError(f"The saved privacy ledger's phase table has shape {saved.shape}; "
                         f"expected (rows, {_COLUMNS}).")
    if len(saved) > MAX_PHASES and saved[MAX_PHASES:, _SCHEME].any():
        raise ValueError(f"The saved privacy ledger has more than {MAX_PHASES} phases.")
    table = np.zeros((MAX_PHASES, _COLUMNS))
    kept = saved[:MAX_PHASES]
    table[: len(kept), : saved.shape[1]] = kept
    if saved.shape[1] <= _SEGMENT:
        used = table[:, _SCHEME] > 0
        table[used, _SEGMENT] = np.arange(1, used.sum() + 1)
    return table


def epsilon_of_phases(phases: list[Phase], delta: float, accountant: str = events.DEFAULT_ACCOUNTANT) -> float:
    """ε at δ of the composition of ``phases`` (``tf_dp.accounting.events.epsilon``)."""
    return events.epsilon(list(phases), delta, accountant)


class _PhaseTableRestorer(tf.__internal__.tracking.Trackable):
    """The phase table as a ``tf.train.Checkpoint`` sees it: saved as the variable's value
    (the key a variable would have), restored into the ledger's [MAX_PHASES, 8] variable through
    ``upgraded_table``, so a checkpoint written before the segment column (7 columns; each old
    row its own segment, as for .keras files) or with 64 rows restores with its phases, steps
    and ε unchanged."""

    def __init__(self, ledger: PrivacyLedger):
        self._ledger = ledger

    def _serialize_to_tensors(self):
        return {_VARIABLE_VALUE: self._ledger.phase_table.read_value()}

    def _restore_from_tensors(self, restored_tensors):
        saved = tf.convert_to_tensor(restored_tensors[_VARIABLE_VALUE])
        table = tf.numpy_function(upgraded_table, [tf.cast(saved, tf.float64)], tf.float64, stateful=False)
        table.set_shape((MAX_PHASES, _COLUMNS))
        return self._ledger.phase_table.assign(table)


_VARIABLE_VALUE = "VARIABLE_VALUE"  # the key of a variable's value in a checkpoint (a Trackable's tensor)


class _Untracked:
    """Attributes hidden from TF tracking (so from every saver): a plain object."""

    def __init__(self, **values):
        self.__dict__.update(values)
