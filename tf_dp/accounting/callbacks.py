"""ε in the progress bar and History, and a hard stop at the privacy budget."""

from __future__ import annotations

import warnings

import keras
import numpy as np

from tf_dp.accounting import events
from tf_dp.accounting.accountant import largest_fitting

_UNBOUNDED = 10**8  # more steps than any run takes: the budget does not bind


class PrivacyReport(keras.callbacks.Callback):
    """Adds ``epsilon`` (all steps so far, at the model's δ) to each epoch's logs, and with an
    ``AdaptiveClip`` bound the current (public) clip bound C_t as ``l2_norm_clip``.

    It only reports. The run's phase — re-recorded when a callback's ``on_train_begin``
    (BackupAndRestore) or a later callback (load_weights) replaced the ledger — and the
    noise-key guard are the ``PrivateRun``'s, before every execution of the train function,
    after all callbacks (tf_dp.models.private_run)."""

    def on_epoch_begin(self, epoch, logs=None):
        self.model.nonfinite_examples.assign(0.0)


    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["epsilon"] = self.model.get_epsilon()
            optimizer = self.model.optimizer
            logs["noise_std"] = float(optimizer.averaged_noise_stddev().numpy())  # σ_w = σC/L
            attenuation = getattr(optimizer, "attenuation", None)
            if attenuation is not None:  # FIBER: noise std left in the filtered gradient
                logs["filtered_noise_std"] = float(attenuation**0.5 * logs["noise_std"])
            if getattr(optimizer, "adaptive_clip", None) is not None:  # C_t is public (docs/algorithms.md §12)
                logs["l2_norm_clip"] = optimizer.l2_norm_clip


def check_adaptive_clip_split(model) -> None:
    """Refuses, before the first step, an adaptive clip bound whose count noise σ_b ≤ σ/2
    leaves no σ_Δ for the gradient (docs/algorithms.md §12): the step's own check is an
    in-graph assertion, which XLA (jit_compile=True) compiles to nothing.

    Args:
      model: the DP model, its run's phase recorded.
    """
    optimizer = model.optimizer
    adaptive, phase = getattr(optimizer, "adaptive_clip", None), model.privacy_ledger.current_phase()
    if adaptive is None or phase is None or optimizer.noise_multiplier is None:
        return
    adaptive.gradient_noise_multiplier(float(optimizer.noise_multiplier),
                                       expected_batch_size=float(phase.expected_batch_size))


def ledger_state(model, steps: int | None = None) -> tuple:
    """(ledger object, its phase table, its step count): what a replaced ledger changes.

    Args:
      model: the DP model.
      steps: the ledger's step count if the caller has just read it (the step logs it), else
        None: read here.

    Returns:
      The state, compared with ``==``.
    """
    ledger = model.privacy_ledger
    return id(ledger), ledger.phase_table.numpy().tobytes(), int(ledger.steps.numpy()) if steps is None else steps


class PrivacyBudget(keras.callbacks.Callback):
    """Never lets ε exceed ``max_epsilon``.

    The largest total step count that fits the budget if the current phase continues at
    the optimizer's σ is handed to the model's ``StepLimit``, which the compiled step
    checks before it releases anything — so the budget holds whatever
    ``steps_per_execution``, ``steps_per_epoch`` or ``epochs`` say. The limit is
    recomputed before and after every batch whenever anything it depends on changed: the
    ledger's phases (scheme, q, σ, N, L of each, and where each starts — a resume with
    another batch size, a restored ledger, a phase opened by a σ change) or the optimizer's
    σ; until then the step refuses a σ the limit was not computed for. Training stops once
    the limit is reached.
    """

    def __init__(self, max_epsilon: float, save_path: str | None = None):
        """Sets the budget.

        Args:
          max_epsilon: the largest ε training may reach (at the model's δ).
          save_path: where to ``model.save`` when the budget stops training, or None not to save.
        """
        super().__init__()
        self.max_epsilon = float(max_epsilon)
        self.save_path = save_path
        self._allowed_steps = None
        self._limit_inputs = None  # what the current limit (or "never binds") was computed from

    def on_train_begin(self, logs=None):
        self._allowed_steps, self._limit_inputs, self._warned = None, None, False
        self._check_budget(raise_if_spent=True)  # a clear error before training if nothing is left

    def on_train_batch_begin(self, batch, logs=None):
        # After every on_train_begin (a restored ledger, a phase re-opened with another q).
        self._check_budget()
        self._before_batch = (self.model.optimizer.noise_multiplier, self._steps())

    def on_train_batch_end(self, batch, logs=None):
        self._warn_if_blocked_by_a_later_sigma()
        self._stop_a_segment_a_blocked_step_misaligned()
        self._check_budget()  # a σ changed by a callback, or a phase the step opened
        if self._allowed_steps is not None and self._steps() >= self._allowed_steps:
            self.model.stop_training = True

    def _warn_if_blocked_by_a_later_sigma(self):
        """A callback listed after this one that sets σ in ``on_train_batch_begin`` changes σ
        after the limit was computed: the step refuses that σ, so nothing trains."""
        sigma, steps = self._before_batch
        blocked = self._steps() == steps and (self._allowed_steps is None or steps < self._allowed_steps)
        if not self._warned and blocked and self.model.optimizer.noise_multiplier != sigma:
            self._warned = True
            warnings.warn("tf_dp: noise_multiplier was changed by a callback that runs after PrivacyBudget, after "
                          "the step limit was computed for the previous σ: the step refused the new σ and released "
                          "nothing. List PrivacyBudget after the callback that sets noise_multiplier.", stacklevel=2)

    def _stop_a_segment_a_blocked_step_misaligned(self):
        """A blocked step of a segment accounted whole (a scheme registered with
        ``whole_segments=True``, whose account counts a segment's steps by their positions)
        stops training. The sampler has moved on while the DP counter has not. For BandMF
        (scheme "cyclic_poisson", docs/algorithms.md §10.2) the groups' later released steps
        would be only b − 1 apart from their earlier ones, their rows of C would overlap, and
        the segment's account PoissonSampled(q_b, G(σ))^⌈T/b⌉ would under-state ε. A new
        ``fit`` starts a new segment (new groups, fresh buffer), which is accounted correctly."""
        sigma, steps = self._before_batch
        phase = self.model.privacy_ledger.current_phase()
        if phase is None or not events.is_segmented(phase.scheme) or self._steps() != steps:
            return
        self.model.stop_training = True
        warnings.warn(f"tf_dp: a step of {phase.scheme!r} sampling was blocked by the privacy budget "
                      "(noise_multiplier changed by a callback after PrivacyBudget, or the budget reached): "
                      "training stops, because this scheme is accounted by the positions of its steps (BandMF's "
                      "cyclic Poisson groups must stay b steps apart in the noise's rows) and the sampler has "
                      "moved on while the step count has not. Call fit again to continue (a new segment), and "
                      "list PrivacyBudget after callbacks that set noise_multiplier.", stacklevel=2)

    def on_train_end(self, logs=None):
        reached = self._allowed_steps is not None and self._steps() >= self._allowed_steps
        self.model.step_limit.clear()
        if self.save_path and reached:
            self.model.save(self.save_path)
            print(f"tf_dp: privacy budget ε = {self.max_epsilon} reached (ε = {self.model.get_epsilon():.4f}); "
                  f"training stopped, model saved to {self.save_path}.")

    def refresh(self) -> None:
        """Recomputes the step limit if anything it depends on changed (the run calls it when
        it re-records its phase right before an execution: tf_dp.models.private_run)."""
        self._check_budget()

    def _check_budget(self, raise_if_spent: bool = False):
        inputs = _limit_inputs(self.model)
        if self._limit_inputs is not None and inputs == self._limit_inputs:
            return  # the limit in the step still holds
        limit, sigma = self.model.step_limit, self.model.optimizer.noise_multiplier
        self._allowed_steps = _max_total_steps(self.model, self.max_epsilon)
        # "Never binds" is only known once the run's phase is in the ledger (q, N of this fit).
        self._limit_inputs = inputs if self.model.privacy_ledger.phases() else None
        if self._allowed_steps is None:
            # Never binds at this σ; the step still checks σ, so a σ lowered by a later
            # callback is blocked until the limit is recomputed for it.
            if self._limit_inputs is None:
                limit.clear()
            else:
                limit.set(_UNBOUNDED, sigma)
            return
        limit.set(self._allowed_steps, sigma)
        if self._steps() >= self._allowed_steps:
            self.model.stop_training = True
            if raise_if_spent:
                raise ValueError(_no_step_fits_message(self.model, self.max_epsilon))

    def _steps(self) -> int:
        return int(self.model.privacy_ledger.steps.numpy())


def _limit_inputs(model) -> tuple:
    """Everything the step limit is a function of: the ledger (which object, its phases'
    settings and first steps), the optimizer's σ, and — while σ differs from the current
    phase's, so that a new phase opens at the next step — the steps the current phase holds."""
    ledger, sigma = model.privacy_ledger, model.optimizer.noise_multiplier
    table = np.asarray(ledger.phase_table.numpy())
    rows = table[table[:, 0] > 0]
    pending = bool(len(rows)) and sigma != rows[-1, 2]
    return id(ledger), table.tobytes(), sigma, int(ledger.steps.numpy()) if pending else None


def _max_total_steps(model, max_epsilon: float):
    """Largest total step count whose ε stays ≤ max_epsilon if the current phase continues
    at the optimizer's current σ (None: the budget never binds)."""
    ledger, settings = model.privacy_ledger, model.privacy_settings
    if not ledger.phases():
        return None
    taken, sigma = int(ledger.steps.numpy()), model.optimizer.noise_multiplier

    def fits(extra: int) -> bool:
        return ledger.epsilon_if_continued(extra, sigma, settings["delta"], settings["accountant"]) <= max_epsilon

    if not fits(0):
        return taken
    extra = largest_fitting(fits, 0, _UNBOUNDED)
    return None if extra == _UNBOUNDED else taken + extra


def _no_step_fits_message(model, max_epsilon: float) -> str:
    """Why no further step fits the budget, and what to change."""
    ledger, settings = model.privacy_ledger, model.privacy_settings
    delta, sigma = settings["delta"], model.optimizer.noise_multiplier
    spent = model.get_epsilon()
    if spent >= max_epsilon:
        return (f"The privacy budget ε = {max_epsilon} is already spent (ε = {spent:.4f}); "
                "no further step is allowed.")
    phase = ledger.current_phase()
    after_one = ledger.epsilon_if_continued(1, sigma, delta, settings["accountant"])
    sampled = phase.scheme != "batches"  # every other scheme samples at a rate q (as _planned_phase)
    setting = (f"noise_multiplier σ = {sigma:g}, sampling rate q = {phase.sampling_rate:.4g} "
               f"(expected batch {phase.expected_batch_size:g} of N = {phase.num_examples})"
               if sampled else
               f"noise_multiplier σ = {sigma:g}, fixed batches without sampling amplification")
    change = ("Raise noise_multiplier, or lower the sampling rate q = batch_size / N (a smaller batch_size)."
              if sampled else
              "Raise noise_multiplier, or pass arrays (or an unbatched dataset) with batch_size=... so that fit "
              "Poisson-samples the batches (amplification by sampling).")
    if sigma == 0:
        change = "noise_multiplier is 0 (no noise): set it > 0."
    if int(ledger.steps.numpy()) == 0:
        return (f"One DP step alone costs ε = {after_one:.4f} at δ = {delta:g} ({setting}), more than the privacy "
                f"budget ε = {max_epsilon}: no step can run. {change}")
    return (f"The privacy budget ε = {max_epsilon} is nearly spent (ε = {spent:.6g} so far): one more step "
            f"({setting}) would take it to ε = {after_one:.6g}. {change}")
