"""The DP train step (docs/algorithms.md §1): chunks → per-example clipped sums → noise → update → ledger.

The batch arrives as Poisson-sampled chunks of static size P with a 0/1 mask (from
``fit``) or as an explicit batch; the clipping engine returns Σ_i c_i g_i over all chunks;
the DP optimizer adds N(0, σ²C² I) once, divides by L (a public constant) and updates; the
ledger records the step with the σ it used.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import keras
import numpy as np
import tensorflow as tf

from tf_dp.clipping.engine import view_of
from tf_dp.models.chunk_loop import chunk_clipper, clipped_sum_over_chunks
from tf_dp.models.custom_step import regularization_gradients, targets_and_objective
from tf_dp.models.data import is_poisson_batch
from tf_dp.models.losses import (WeightedTargets, class_weights_of, metric_weights_for_masks, unpack_targets,
                                  without_unused_targets)
from tf_dp.models.objective import COMPILED_LOSS, PerExampleObjective
from tf_dp.models.plan import StepPlan, class_weight_table
from tf_dp.models.row_independence import reprobe_on_trace
from tf_dp.optimizers import ClippedSum, DPOptimizer
from tf_dp.sampling.sources import no_targets_as_none


REFUSED_LOG = "tf_dp_refused_steps"  # popped from the logs before Keras or a callback sees them
STEPS_LOG = "tf_dp_ledger_steps"  # the ledger's step count after the step (public), popped likewise


class DPTrainStep:
    """``train_step`` of DP models (mixed into DPModelMixin)."""

    def train_step(self, data):
        """One DP step in the graph: clipping, N(0, σ²C²) noise, the ledger record and the
        in-step budget limit. The host checks run around the train function that ``fit`` and
        ``train_on_batch`` call (``make_train_function``), and the step runs only inside it: a
        loop of the user's own that calls ``train_step`` (eagerly or in its own ``tf.function``)
        is refused when it runs or traces (``StepDoor``), before anything is released."""
        if not isinstance(self.optimizer, DPOptimizer):
            raise TypeError("A DPModel trains only with a tf_dp DP optimizer; recompile with one.")
        x, y, mask, expected_batch_size = self._unpack_dp_batch(data)
        y, objective = targets_and_objective(self, x, y)  # a compute_loss of the model's own reads x too
        logs, _ = self._dp_step(x, y, mask, expected_batch_size, objective=objective)
        return logs

    def _dp_step(self, x, y, mask, expected_batch_size, objective: PerExampleObjective = COMPILED_LOSS):
        """One DP step. σ is read once: the noise and the ledger use the same value, and the
        noise counter is the ledger's step count (unique over the model's life).

        Args:
          objective: the per-example term whose gradients are clipped and the labels the
            metrics read (tf_dp.models.objective; default: the compiled loss ℓ_i, §1).

        Returns:
          (logs, release): the step's logs and its release factor (1 if the step was
          released, 0 if the budget or the full ledger refused it: nothing was applied).
        """
        self._step_door.require_open(self.name)  # at trace time (or per eager call): Python only
        reprobe_on_trace(self, self._dp_loss)  # Python, so at trace time only: the verdict must describe this graph
        optimizer, ledger = self.optimizer, self._ledger_of_plan()
        dp_step, sigma = ledger.steps.read_value(), optimizer.noise_multiplier_tensor()
        points = optimizer.evaluation_points(self.trainable_variables)
        wants_norms = getattr(optimizer, "adaptive_clip", None) is not None  # C_{t+1} from the batch's norms
        clipped_sums, squared_norms = self._clipped_sum_over_chunks(x, y, mask, optimizer.clip_bound(), points,
                                                                    wants_norms, objective)
        # Before the update: a step is released only if the budget allows it AND the ledger
        # recorded it (0 when its table is full: the host then stops training).
        release = ledger.record_step(sigma, self.step_limit.allows(dp_step, sigma))
        optimizer.apply(ClippedSum(
            clipped_sums, expected_batch_size, dp_step, noise_multiplier=sigma, release=release,
            public_gradients=regularization_gradients(self.trainable_variables), squared_norms=squared_norms,
            mask=tf.reshape(mask, [-1]) if wants_norms else None), self.trainable_variables)
        # The ledger's refusal count and step count ride with the logs (public: functions of σ
        # and the table); the host reads them from there, cheaper than variable reads per
        # execution. Read after record_step: the trace orders reads of a variable after its writes.
        host = {REFUSED_LOG: ledger.refused_steps(), STEPS_LOG: ledger.steps.read_value()}
        return {**self._step_logs(), **for_multi_worker_reduce(host)}, release

    def make_train_function(self, force=False):
        """Keras' train function between two host checks.

        Before every execution — after every callback has run, so whatever a callback did
        (``load_weights`` of an older file, a new seed) is seen — the call is refused unless
        ``fit``/``train_on_batch`` hold a phase open (Keras' cached function called after they
        returned); the call's ``PrivateRun`` then re-records its phase if a callback replaced
        the ledger and guards the noise key (``before_execution``). The step may trace or run
        only during the execution (``StepDoor``), and draw noise only inside the optimizer's
        drawing window. After it the run notes the steps drawn and stops training on a step the
        ledger could not record (``after_execution``; tf_dp.models.private_run).
        """
        super().make_train_function(force)
        function = self.train_function
        if getattr(function, "checks_the_ledger", False):
            return function

        def train_function_then_check_the_ledger(*args, **kwargs):
            door = self._step_door
            door.require_phase(self.name)
            run, ledger = self._private_run, self._ledger_of_plan()
            run.before_execution(ledger)
            executing, door.executing = door.executing, True
            try:
                with self.optimizer.drawing_window():
                    logs = function(*args, **kwargs)
            finally:
                door.executing = executing
            return run.after_execution(logs, ledger)

        train_function_then_check_the_ledger.checks_the_ledger = True
        self.train_function = train_function_then_check_the_ledger
        return self.train_function

    def _step_logs(self) -> dict:
        """Train loss, metrics and the non-finite count — exact functions of the private
        batch, outside ε — unless ``compile(private_logs=True)``, which logs none of them."""
        if self._dp["private_logs"]:  # Keras needs one log: the public noise std σC/L
            return for_multi_worker_reduce({"noise_std": self.optimizer.averaged_noise_stddev()})
        return for_multi_worker_reduce(
            {**self.get_metrics_result(), "nonfinite_examples": self.nonfinite_examples.read_value()})

    def test_step(self, data):
        return for_multi_worker_reduce(super().test_step(data))

    @property
    def _step_door(self) -> "StepDoor":
        return self._untracked.step_door

    def _unpack_dp_batch(self, data):
        """(x, y, mask, L) with x, y, mask shaped [chunks, P, ...]. L of an explicit batch is
        the phase's declared batch size, never the batch's realized size (docs/algorithms.md §7).
        The first call of every train step (RaCO-DP's draws its histogram noise next): a step
        outside fit/train_on_batch is refused here, before it computes anything."""
        self._step_door.require_open(self.name)
        if is_poisson_batch(data):
            weight = poisson_sample_weight(data, self.step_plan.sample_weights)
            y = self._weighted_targets(no_targets_as_none(data.get("y")), weight)  # fit(x): y=None
            return data["x"], y, data["mask"], data["expected_batch_size"][0]
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y = without_unused_targets(self._dp_loss, y)
        if y is None and not getattr(self._dp_loss, "reads_inputs", False):
            raise ValueError("DP training needs targets `y` to compute each example's loss.")
        batch = tf.shape(tf.nest.flatten(x)[0])[0]
        add_chunk_axis = lambda t: tf.expand_dims(t, 0)  # noqa: E731
        mask = tf.ones([1, batch], tf.float32)
        if sample_weight is not None:
            sample_weight = tf.nest.map_structure(add_chunk_axis, sample_weight)
        y = self._weighted_targets(None if y is None else tf.nest.map_structure(add_chunk_axis, y), sample_weight)
        return tf.nest.map_structure(add_chunk_axis, x), y, mask, self._declared_batch_size.read_value()

    # ------------------------------------------------------- the step plan
    @property
    def step_plan(self) -> StepPlan:
        """The StepPlan the train step is traced with (tf_dp.models.plan)."""
        return self._untracked.step_plan

    @step_plan.setter
    def step_plan(self, plan: StepPlan) -> None:
        """Sets the plan; a plan that differs from the current one drops the traced train
        function — the only place that does: every field of the plan is a constant of the
        trace, so a changed option retraces by construction."""
        if not isinstance(plan, StepPlan):
            raise TypeError(f"`step_plan` must be a tf_dp.models.plan.StepPlan, got {type(plan).__name__}.")
        if plan != self._untracked.step_plan:
            self.train_function = None
        self._untracked.step_plan = plan

    @contextlib.contextmanager
    def use_plan(self, plan: StepPlan):
        """``plan`` for the duration of the block (one ``fit``), the previous plan after it,
        also when the block raises."""
        previous = self.step_plan
        self.step_plan = plan
        try:
            yield plan
        finally:
            self.step_plan = previous

    def _ledger_of_plan(self):
        """The plan's ledger, which must be the model's: a ``privacy_ledger`` replaced by
        hand (not by ``continue_ledger_of``) would leave the traced step counting into the
        old one while ε is read from the new one."""
        ledger = self.step_plan.ledger
        if ledger is not self.privacy_ledger:
            raise RuntimeError(f"{self.name}.privacy_ledger was replaced by assignment, which the traced step "
                               "cannot see: use model.continue_ledger_of(other) to carry another model's ledger.")
        return ledger

    def _weights_plan(self, sample_weight=None, class_weight: Optional[dict] = None,
                      num_examples: Optional[int] = None, where: str = "fit") -> StepPlan:
        """The plan of a ``fit``/``train_on_batch`` call with its example weights (one view):
        ``sample_weight`` (fit: an array per example [N] or per loss value [N, T], carried
        with each Poisson batch as a per-example extra; train_on_batch: Keras passes it with
        the batch; a batched dataset: its elements' third entry) and ``class_weight``
        ({class: weight}, looked up from each example's label inside the step). Weights are
        part of the example (ℓ_i = weighted loss of example i, see tf_dp.models.losses): the
        sensitivity stays C. ``where``: "fit", "dataset" or "batch"."""
        if where == "dataset" and sample_weight is not None:
            raise ValueError("`sample_weight` cannot be passed with a dataset: yield (x, y, sample_weight) elements.")
        weighted = sample_weight is not None or class_weight is not None
        if weighted and type(self).train_step is not DPTrainStep.train_step:
            raise ValueError(f"`sample_weight`/`class_weight` are supported by DPModel's own train step; "
                             f"{type(self).__name__} overrides train_step.")
        if sample_weight is not None and class_weight is not None:
            raise ValueError("Pass either `sample_weight` or `class_weight`, not both (as Keras): fold the class "
                             "weights into the sample weights.")
        if sample_weight is not None and where == "fit":
            sample_weight = _checked_fit_sample_weight(sample_weight, num_examples)
        return StepPlan(ledger=self.privacy_ledger,
                        class_weights=None if class_weight is None else class_weight_table(class_weight),
                        sample_weights=sample_weight if where == "fit" else None)  # fit's Poisson extra

    def _weighted_targets(self, y, sample_weight):
        """y, or y packed with the sample weights of its rows (class weights looked up from the labels)."""
        table = self.step_plan.class_weights
        if table is not None:
            if sample_weight is not None:
                raise ValueError("Pass either `sample_weight` or `class_weight`, not both.")
            sample_weight = class_weights_of(y, table)
        return y if sample_weight is None else WeightedTargets(y, sample_weight)

    def _clipped_sum_over_chunks(self, x, y, mask, clip, points, with_squared_norms=False,
                                 objective: PerExampleObjective = COMPILED_LOSS):
        """Σ over the batch's chunks of Σ_i c_i g_i, and — if asked, for an adaptive clip
        bound — every example's squared norm concatenated over chunks ([chunks·P]; else
        None); also counts non-finite examples. The loop is ``private_update``'s too
        (tf_dp.models.chunk_loop)."""
        totals = clipped_sum_over_chunks(self._clip_chunk(clip, points, objective), x, y, mask,
                                         self.trainable_variables, with_squared_norms)
        if not self._dp["private_logs"]:
            # Outside the loop: a cross-replica variable update may not sit in control flow.
            self.nonfinite_examples.assign_add(totals.nonfinite)
        return totals.sums, totals.squared_norms

    def _clip_chunk(self, clip, points, objective: PerExampleObjective):
        """The built-in step's clipping of one chunk: ``objective``'s term of the model's
        outputs, clipped with the plan's views, and the train metrics (unless private_logs)."""
        clip_chunk = chunk_clipper(self, self, objective.per_example_loss(self._dp_loss), clip, points)
        if self._dp["private_logs"]:
            return clip_chunk

        def clip_and_track(x, y, mask):
            result = clip_chunk(x, y, mask)
            self._track_train_metrics(x, y, mask, result, objective)
            return result

        return clip_and_track

    def _track_train_metrics(self, x, y, mask, result, objective: PerExampleObjective):
        if self.step_plan.views.targets_per_view:  # user-level (§11): the engine
            y = view_of(y, 0)  # reports view 0's predictions and losses, each sampled user's first example
        real = tf.reduce_sum(mask)
        losses = tf.cast(result.losses, tf.float32)  # bfloat16 when the output layer computes in bfloat16
        real_losses = tf.where(tf.cast(mask, tf.bool), losses, 0.0)  # padding rows may give NaN losses
        mean_loss = tf.math.divide_no_nan(tf.reduce_sum(real_losses), real)
        self._loss_tracker.update_state(mean_loss + self._regularization_loss(), sample_weight=real)
        weights = metric_weights_for_masks(self._metric_weights(y, mask), result.y_pred)  # Keras output masks
        self.compute_metrics(x, objective.labels_of(y), result.y_pred, sample_weight=weights)

    def _metric_weights(self, y, mask):
        """Metric weights: the 0/1 padding mask times the examples' sample weights, if any.
        Class weights weigh the loss only: metrics count examples, as in Keras."""
        _, sample_weight = unpack_targets(y)
        if sample_weight is None or self.step_plan.class_weights is not None:
            return mask

        def times_mask(weight):
            weight = tf.cast(weight, tf.float32)
            rank = weight.shape.rank or 1
            return tf.reshape(mask, tf.concat([tf.shape(mask), tf.ones([rank - 1], tf.int32)], 0)) * weight

        return tf.nest.map_structure(times_mask, sample_weight)

    def _regularization_loss(self):
        terms = [v.regularizer(v) for v in self.trainable_variables if getattr(v, "regularizer", None)]
        return tf.add_n(terms) if terms else 0.0



class StepDoor:
    """Whether a DP step may run now: a host-side flag pair owned by one model (its
    ``_untracked``, never saved), read in Python only — no work in the compiled step.

    ``fit``/``train_on_batch`` hold ``phase_open`` for their whole call (``open_phase``,
    closed in a ``finally`` when they return or raise); the train-function wrapper refuses an
    execution without it and sets ``executing`` around each execution. The step checks
    ``executing`` where it runs Python: at trace time in a graph, at every call eagerly. So a
    loop of one's own that calls ``model.train_step`` eagerly, traces it in a ``tf.function``
    (after ``fit``, or during it from a callback, which runs between executions), or calls
    Keras' cached ``model.train_function`` after ``fit`` returned is refused on the host
    before anything is released (docs/algorithms.md A.2).
    """

    __slots__ = ("phase_open", "executing", "one_execution")

    def __init__(self):
        self.phase_open = False
        self.executing = False
        self.one_execution = False

    @contextlib.contextmanager
    def open_phase(self, one_execution: bool = False):
        """Holds the phase open for the block (one ``fit``/``train_on_batch`` call); nested calls restore.

        Args:
          one_execution: the phase runs the train function once (``train_on_batch``).
        """
        previous = self.phase_open, self.one_execution
        self.phase_open, self.one_execution = True, one_execution
        try:
            yield
        finally:
            self.phase_open, self.one_execution = previous

    def require_phase(self, model_name: str) -> None:
        """Raises unless a ``fit``/``train_on_batch`` call holds a phase open (the train function's check)."""
        if not self.phase_open:
            raise RuntimeError(_outside_phase_message(model_name, "model.train_function was called"))

    def require_open(self, model_name: str) -> None:
        """Raises unless the train function of an open phase is executing (the step's check)."""
        if not self.executing:
            raise RuntimeError(_outside_phase_message(model_name, "a DP step (model.train_step) was run"))


def _outside_phase_message(model_name: str, what: str) -> str:
    return (f"{model_name}: {what} outside fit()/train_on_batch(). tf_dp takes a DP step only inside the phase "
            "those calls open, with their checks (the accounted sampling, the noise-key guard, the "
            "row-independence probe): a loop of one's own calling model.train_step — eagerly, in a tf.function, "
            "or through model.train_function after fit returned — would release noise the ledger cannot account "
            "for. Nothing was released. Use model.fit() (Poisson-sampled) or model.train_on_batch() (an explicit "
            "batch, accounted without amplification).")


SAMPLE_WEIGHT = "sample_weight"


def sample_weight_extras(sample_weight) -> dict:
    """fit's sample weights as Poisson extras (flat name → array, read with each example's
    row): one array as "sample_weight", one per output as "sample_weight/<i>"."""
    if sample_weight is None:
        return {}
    if not tf.nest.is_nested(sample_weight):
        return {SAMPLE_WEIGHT: sample_weight}
    return {f"{SAMPLE_WEIGHT}/{i}": w for i, w in enumerate(tf.nest.flatten(sample_weight))}


def poisson_sample_weight(data: dict, structure):
    """The sample weights of a Poisson batch, in the structure fit was given (inverse of
    ``sample_weight_extras``)."""
    if SAMPLE_WEIGHT in data:
        return data[SAMPLE_WEIGHT]
    flat = [data[key] for key in sorted((k for k in data if k.startswith(SAMPLE_WEIGHT + "/")),
                                        key=lambda k: int(k.split("/")[1]))]
    if not flat:
        return None
    return tf.nest.pack_sequence_as(structure, flat)


def _checked_fit_sample_weight(sample_weight, num_examples: int):
    """fit's sample weights as float32 arrays (a list as a tuple, a structure tf.data carries),
    each with one row per training example."""
    sample_weight = tf.nest.map_structure(lambda w: np.asarray(w, np.float32), sample_weight)
    for w in tf.nest.flatten(sample_weight):
        if w.ndim == 0 or w.shape[0] != num_examples:
            raise ValueError(f"`sample_weight` needs one row per training example ({num_examples}), "
                             f"got shape {list(w.shape)}.")
    return tuple(sample_weight) if isinstance(sample_weight, list) else sample_weight


def for_multi_worker_reduce(logs: dict) -> dict:
    """Keras 3 reduces step logs across workers with reduce("MEAN", axis=0), which fails on
    scalars (tensorflow/tensorflow#72388): give each a length-1 axis there."""
    strategy = tf.distribute.get_strategy()
    if not strategy.extended._in_multi_worker_mode():
        return logs
    return {name: tf.reshape(value, [1]) for name, value in logs.items()}
