"""One ``PrivateRun`` per ``fit`` / ``train_on_batch``: the host's bookkeeping of a DP run, in one place.

The run holds what the host knows between executions of the train function (docs/design.md):

  * the mechanism and the phase it recorded in the ledger (``open_phase``), re-recorded when
    a callback replaced or rolled back the ledger (``before_execution``);
  * the stream position — the ledger step the Poisson stream numbers its next batch with —
    and the generation of ``sampling_seed`` it draws from (``tf_dp.sampling.seed_guard``);
  * the ledger's watermark: its state after the last execution, against which the next
    execution detects a ledger a callback replaced.

The train-function wrapper (``DPTrainStep.make_train_function``) calls ``before_execution()``
and ``after_execution(logs)``; callbacks only report. What a noise key and a sampling seed
have drawn is kept with the ledger (``PrivacyLedger.draws``), in one guard for both.
"""

from __future__ import annotations

import threading
from typing import Optional

import keras
import numpy as np

from tf_dp.accounting.callbacks import PrivacyBudget, check_adaptive_clip_split, ledger_state
from tf_dp.models.step import REFUSED_LOG, STEPS_LOG
from tf_dp.sampling import seed_guard


class PrivateRun:
    """The host state of one ``fit`` or ``train_on_batch`` call.

    Args:
      model: the DP model.
      mechanism: the run's ``DPMechanism``.
      sampling_seed: the user's sampling seed (a secret, never shown), or None.
      one_execution: the run executes the train function once (``train_on_batch``): no
        watermark is kept, since its phase was recorded right before its one execution.
      callbacks: the run's callbacks; any ``PrivacyBudget`` among them recomputes its step
        limit whenever the run re-records its phase.
    """

    def __init__(self, model, mechanism, sampling_seed: Optional[int] = None, one_execution: bool = False,
                 callbacks=()):
        seed_guard.check_sampling_seed(sampling_seed)  # before the stream reads it
        self._model, self.mechanism = model, mechanism
        self._sampling_seed, self._one_execution = sampling_seed, one_execution
        self._budgets = tuple(callback for callback in callbacks if isinstance(callback, PrivacyBudget))
        self._lock = threading.Lock()  # the stream reads the position from tf.data's thread
        self._generation, self._first_execution = 0, True
        self.phase_arguments = ()
        self.open_phase()
        self._position = int(model.privacy_ledger.steps.numpy())
        self._watermark = None if one_execution else ledger_state(model, self._position)

    def __repr__(self) -> str:
        return f"PrivateRun({type(self.mechanism).__name__}, position={self._position})"  # never a seed

    # ------------------------------------------------------------------ the phase
    def open_phase(self, new_segment: Optional[bool] = None) -> None:
        """Records the phase the mechanism runs in.

        Args:
          new_segment: start a new segment (None: if the mechanism's scheme starts one with
            every run, as BandMF's "cyclic_poisson" does; docs/algorithms.md §10.3).
        """
        model, mechanism = self._model, self.mechanism
        self.phase_arguments = mechanism.ledger_arguments()
        new_segment = mechanism.new_segment if new_segment is None else new_segment
        sigma = model.optimizer.noise_multiplier
        if sigma is None:
            raise ValueError(
                "The optimizer's `noise_multiplier` is None: set it, or pass `target_epsilon` to compile() "
                "so that fit() calibrates it."
            )
        if mechanism.declared_batch_size is not None:
            model._declared_batch_size.assign(mechanism.declared_batch_size)
        scheme, sampling_rate, num_examples, expected_batch_size, parameter = self.phase_arguments
        model.privacy_ledger.open_phase(scheme, sampling_rate, sigma, num_examples, expected_batch_size,
                                        parameter, new_segment=new_segment)
        if new_segment and mechanism.privatizer is not None:
            mechanism.privatizer.reset(int(model.privacy_ledger.steps.numpy()))  # a new sampler: fresh noise state

    # ------------------------------------------------------------------ the stream
    def start(self) -> None:
        """Reads the ledger's count once every callback's ``on_train_begin`` has run (after
        BackupAndRestore may have restored it), and asks the draw guard which generation of
        ``sampling_seed`` the stream draws from (re-keyed after a rollback, docs/algorithms.md B.3)."""
        with self._lock:
            self._position = int(self._model.privacy_ledger.steps.numpy())
            self._generation = seed_guard.stream_generation(self._model.privacy_ledger, self._sampling_seed,
                                                            self._position)

    def position(self) -> int:
        """The ledger step the stream's next iterator starts at (read when an iterator starts)."""
        with self._lock:
            return self._position

    def seed_generation(self) -> int:
        """The generation of the sampling seed this run's stream draws from (0: the seed itself)."""
        return self._generation

    # ------------------------------------------------------------------ executions
    def before_execution(self, ledger) -> None:
        """Before each execution of the train function, after every callback: re-records the
        phase if the ledger changed other than by the run's own steps (a callback that loaded
        another file: load_weights rolls the ledger back; BackupAndRestore) — the steps that
        follow are the run's, and for a segmented scheme a new segment — then recomputes the
        run's budget limits, and guards the noise key against the ledger's count (re-keyed on
        a rollback, a seeded resume refused: no (key, step) pair draws twice).

        Args:
          ledger: the ledger the step records into (the step plan's).
        """
        reopened = False
        if self._watermark is None:
            steps = int(ledger.steps.numpy())
        else:
            now = ledger_state(self._model)
            if now != self._watermark:
                self.open_phase(new_segment=self.mechanism.accounted_whole)
                now, reopened = ledger_state(self._model), True
            self._watermark, steps = now, now[2]
        if self._first_execution and not self._one_execution:
            check_adaptive_clip_split(self._model)
        if reopened:  # a limit computed for the phase before (PrivacyBudget.on_train_batch_begin)
            for budget in self._budgets:
                budget.refresh()
        self._first_execution = False
        self._model.optimizer.guard_noise_counter(steps, ledger)

    def after_execution(self, logs, ledger):
        """After each execution: notes the steps drawn — the ledger's count as the step logged
        it (``STEPS_LOG``; read from the ledger only for a ``train_step`` of a model's own that
        does not log it) — for the noise key and the sampling seed, advances the stream by the
        execution's batches, notes the watermark, and stops training on a step the ledger
        could not record.

        Args:
          logs: the train function's logs; the run's own entries are popped.
          ledger: the ledger the step records into.

        Returns:
          The logs without the run's entries.
        """
        logged = isinstance(logs, dict)
        steps = logs.pop(STEPS_LOG, None) if logged else None
        steps = int(ledger.steps.numpy()) if steps is None else _logged_count(steps)
        self._model.optimizer.record_noise_counter(steps)
        if not self._one_execution:
            with self._lock:  # every execution of a fit draws steps_per_execution batches of its stream
                self._position += int(self._model.steps_per_execution)
                seed_guard.record_drawn(ledger, self._sampling_seed, self._position)
            self.note_ledger(steps)
        refused = logs.pop(REFUSED_LOG, None) if logged else None
        if refused is None or np.any(np.asarray(refused) > 0):  # None: a train_step of its own
            ledger.raise_if_refused()
        return logs

    def note_ledger(self, steps: Optional[int] = None) -> None:
        """Notes the ledger as it is now: the watermark the next execution compares against.

        Args:
          steps: its step count if just read (the step logs it), else None: read here.
        """
        if not self._one_execution:
            self._watermark = ledger_state(self._model, steps)

    @property
    def watermark(self) -> Optional[tuple]:
        """The ledger's state after the last execution (None for ``train_on_batch``)."""
        return self._watermark


def _logged_count(value) -> int:
    """A count the step logged (a scalar, or [1] per worker under multi-worker reduction)."""
    return int(np.asarray(value).reshape(-1)[0])


class RunStart(keras.callbacks.Callback):
    """Starts ``run``'s stream after every other callback's ``on_train_begin``: the Poisson
    stream's iterator, and tf.data's prefetch thread with it, start before the first
    execution, so the run reads the ledger's count (a ledger BackupAndRestore restored) at
    the one point between the two. It keeps no count of its own.

    Args:
      run: the ``PrivateRun``.
    """

    def __init__(self, run: PrivateRun):
        super().__init__()
        self._run = run

    def on_train_begin(self, logs=None):
        self._run.start()
