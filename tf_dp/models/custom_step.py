"""Your own DP training logic, Keras-native (docs/algorithms.md §1.5; the guide:
docs/guides/keras-models.md#your-own-training-logic).

Two public ways, both clipping each example's gradient to C before one N(0, σ²C²I) draw,
recorded in the ledger like the built-in step:

* ``compute_loss``: a ``tf_dp.DPModel`` subclass overriding
  ``compute_loss(x, y, y_pred, sample_weight, training)`` that returns ONE LOSS PER EXAMPLE
  ([batch], or [batch, ...] averaged per example) trains on it (distillation, VAEs). The
  step calls it per chunk with each example's own row of x, y and the sample weights packed
  into the targets (``ComputeLossTerms``), so the row-independence probe and the per-example
  replay see the same function. A scalar return is refused: a batch mean has no per-example
  gradient to clip.
* ``private_update``: a ``train_step`` of one's own calls
  ``self.private_update(per_example_loss, data, trains=...)`` once per step: the per-example
  objective ``per_example_loss(x, y) -> [batch]`` is clipped, noised, averaged over L and
  applied by the model's DP optimizer (``optimizer.apply(ClippedSum(...))``), the step recorded in
  the ledger (the key guard and the step door are the train function's, as for the built-in
  step). Anything else the train step updates (a GAN's generator) must not read ``data``:
  it is then post-processing of released values and costs no ε.
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from typing import Callable, Optional

import keras
import numpy as np
import tensorflow as tf

from tf_dp.models import row_independence
from tf_dp.models.chunk_loop import chunk_clipper, clipped_sum_over_chunks
from tf_dp.models.losses import per_example_loss as compiled_per_example_loss
from tf_dp.models.objective import INPUTS, TARGETS, WEIGHTS, PerExampleObjective, packed_targets
from tf_dp.optimizers.clipped_sum import ClippedSum
from tf_dp.sampling.sources import no_targets_as_none

LATENT = "latent"  # private_update's per-example N(0, I) draws


def overrides(model, method: str) -> bool:
    """Whether ``type(model)`` (or a user's base class) defines ``method`` rather than Keras or tf_dp.

    Args:
      model: a Keras model.
      method: the method's name ("train_step", "compute_loss").

    Returns:
      True when the nearest definition of ``method`` in the class's MRO is the user's.
    """
    own = getattr(type(model), method, None)
    for owner in type(model).__mro__:
        if method in vars(owner):
            return vars(owner)[method] is own and owner.__module__.split(".")[0] not in ("keras", "tf_dp")
    return False


def objective_loss(model, loss, loss_weights, output_names):
    """The per-example loss the DP step clips, chosen at ``compile``.

    Args:
      model: the DP model being compiled.
      loss: ``compile``'s loss (None when the model computes its own).
      loss_weights: ``compile``'s loss weights.
      output_names: the model's output names (or None).

    Returns:
      ``ComputeLossTerms`` if the model overrides ``compute_loss``; ``OWN_TRAIN_STEP`` for a
      train step of its own without a compiled loss; else the compiled per-example loss.
    """
    if overrides(model, "compute_loss"):
        return ComputeLossTerms(model)
    if loss is None and overrides(model, "train_step"):
        return OWN_TRAIN_STEP
    return compiled_per_example_loss(loss, loss_weights, output_names)


def reads_no_targets(loss) -> bool:
    """Whether a model with this per-example loss may train on examples without targets
    (``fit(x)``, as Keras allows when ``compute_loss`` ignores y: a VAE).

    Args:
      loss: the model's per-example loss (``objective_loss``'s choice).

    Returns:
      True for the model's own ``compute_loss`` (it receives y=None) or a train step of its
      own without a compiled loss (``per_example_loss(x, None)``); False for a compiled loss.
    """
    return getattr(loss, "reads_inputs", False) or loss is OWN_TRAIN_STEP


class _OwnTrainStep:
    """The "loss" of a model whose train step calls ``private_update``: zero per example
    (what the row-independence probe differentiates besides the outputs); the built-in
    step never runs with it."""

    def __call__(self, y_true, y_pred):
        return tf.zeros(tf.shape(tf.nest.flatten(y_pred)[0])[:1])


OWN_TRAIN_STEP = _OwnTrainStep()


class ComputeLossTerms:
    """ℓ_i = the model's own ``compute_loss`` on example i, as a per-example loss of packed
    targets {x, y, sample_weight} (module docstring).

    Args:
      model: the DP model whose ``compute_loss`` is called.
    """

    reads_inputs = True  # the targets this loss reads are ``packed_targets(x, y)``

    def __init__(self, model):
        self._model = weakref.ref(model)
        self._with_training = "training" in inspect.signature(type(model).compute_loss).parameters

    def __call__(self, packed, y_pred):
        """The [P] per-example losses (packed: ``packed_targets``; y_pred: the model's outputs)."""
        model = self._model()
        arguments = dict(x=packed[INPUTS], y=packed.get(TARGETS), y_pred=y_pred, sample_weight=packed.get(WEIGHTS))
        if self._with_training:
            arguments["training"] = True
        return per_example_values(model.compute_loss(**arguments), tf.nest.flatten(packed[INPUTS])[0], model.name)


def per_example_values(values, inputs, name: str) -> tf.Tensor:
    """``values`` ([batch] or [batch, ...]) as [batch], averaged over the non-batch axes;
    refuses a scalar or a first axis that is not the batch's.

    Args:
      values: what ``compute_loss`` (or a per-example objective) returned.
      inputs: a batch input tensor (its first axis is the batch).
      name: the model's name, for the error message.

    Returns:
      One loss per example.
    """
    values = tf.convert_to_tensor(values)
    rank = values.shape.rank
    batch, static = inputs.shape[0], values.shape[0] if rank else None
    if rank == 0 or (batch is not None and static is not None and static != batch):
        raise ValueError(
            f"{name}.compute_loss returned shape {list(values.shape)}; DP training clips each example's gradient "
            f"and needs ONE loss per example, shape [batch] (here [{batch}]) or [batch, ...]. Fix: return the "
            "unreduced losses — Keras losses with reduction=None (e.g. keras.losses.KLDivergence(reduction=None)), "
            "sums or means over the non-batch axes only (axis=-1, not the batch) — and no add of self.losses "
            "(weight regularizers are applied by the optimizer).")
    if rank and rank > 1:
        values = tf.reduce_mean(tf.reshape(values, [tf.shape(values)[0], -1]), axis=1)
    return values


def targets_and_objective(model, x, y):
    """The targets and objective of the built-in step: y and DP-SGD's compiled loss, or, for
    a model with its own ``compute_loss``, the packed targets whose ``labels`` the metrics read.

    Args:
      model: the DP model.
      x: the batch's inputs.
      y: its targets (maybe None, maybe packed with sample weights).

    Returns:
      (targets, PerExampleObjective).
    """
    if not getattr(model._dp_loss, "reads_inputs", False):
        return y, PerExampleObjective()
    return packed_targets(x, y), PerExampleObjective(labels=_labels_of_packed)


def _labels_of_packed(packed):
    return packed.get(TARGETS)


# ----------------------------------------------------- refusals of make_private
_OWN_LOGIC = ("train_step", "compute_loss")


def refuse_own_training_logic(model) -> None:
    """Refuses a Keras model whose class brings its own ``train_step`` or ``compute_loss``:
    ``make_private`` would build a DP model that silently runs tf_dp's step instead.

    Args:
      model: the Keras model given to ``make_private``.
    """
    own = [method for method in _OWN_LOGIC if overrides(model, method)]
    if own:
        raise TypeError(
            f"make_private cannot carry the {' and '.join(own)} that {type(model).__name__} ({model.name}) "
            "defines: the private model would silently run tf_dp's step instead. Fix: subclass tf_dp.DPModel "
            "instead of keras.Model, and either override compute_loss(x, y, y_pred, sample_weight, training) "
            "returning one loss per example, or write train_step(self, data) calling "
            "self.private_update(per_example_loss, data) (docs/guides/keras-models.md#your-own-training-logic).")


def keras_tensors_given(args, kwargs) -> bool:
    """Whether DPModel's constructor arguments are a functional model's (inputs, outputs):
    only when they are Keras tensors (``class VAE(tf_dp.DPModel): __init__(self, encoder,
    decoder)`` takes two positional arguments that are not).

    Args:
      args: the constructor's positional arguments.
      kwargs: its keyword arguments.

    Returns:
      True if the inputs and outputs given are all Keras tensors.
    """
    inputs = args[0] if args else kwargs.get("inputs")
    outputs = args[1] if len(args) > 1 else kwargs.get("outputs")
    leaves = tf.nest.flatten(inputs) + tf.nest.flatten(outputs)
    return bool(leaves) and all(isinstance(leaf, keras.KerasTensor) for leaf in leaves)


# ------------------------------------------------------------ private_update
class _Objective(keras.Model):
    """A model whose outputs are the per-example objective: ``call({x, y}) = fn(x, y)``.
    It tracks ``owner`` (so its layers are tapped and its seed states pinned by the probe)
    but trains only the trainable variables of ``trains``."""

    def __init__(self, owner, trains, fn: Callable):
        super().__init__(name=f"{owner.name}_objective")
        self.owner, self.trains, self.fn = owner, trains, fn

    @property
    def trainable_variables(self):
        return list(self.trains.trainable_variables)

    @property
    def trainable_weights(self):
        return self.trainable_variables

    def call(self, inputs, training=None):
        extra = (inputs[LATENT],) if LATENT in inputs else ()
        return per_example_values(self.fn(inputs[INPUTS], inputs.get(TARGETS), *extra),
                                  tf.nest.flatten(inputs[INPUTS])[0], self.owner.name)


def _objective_losses(unused_targets, losses):
    return losses


class CustomTraining:
    """``private_update`` for a train step of one's own (mixed into DPModelMixin)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        step = vars(cls).get("train_step")
        if step is not None and not getattr(step, "counts_private_updates", False):
            cls.train_step = _one_release_per_step(step)

    def private_update(self, per_example_loss, data, trains: Optional[keras.layers.Layer] = None,
                       latent_shape: Optional[tuple] = None, targets=None, return_release: bool = False):
        """One DP step of a ``train_step`` of your own: clips the gradient of each example's
        term ``per_example_loss(x, y)`` to C, adds N(0, σ²C²I) once, divides by L (the
        expected batch size, never the realized one) and applies the result with the model's
        DP optimizer; the step is recorded in the ledger (a privacy budget may refuse it:
        then nothing is applied). Call it at most once per train step, inside ``fit`` or
        ``train_on_batch``; update anything else (a GAN's generator) from values that do not
        read ``data`` (docs/guides/keras-models.md#your-own-training-logic).

        Args:
          per_example_loss: ``fn(x, y) -> [batch]``, example i's term from its own row of x
            (and y: None without targets); values [batch, ...] are averaged per example.
          data: the ``data`` your ``train_step`` received.
          trains: the layer or sub-model whose trainable variables the step updates
            (default: the whole model).
            A ``tf_dp.models.objective.PerExampleObjective`` instead is a term of the model's
            own outputs, ``loss(y, y_pred) -> [batch]``, clipped exactly as the compiled loss
            (the built-in step with that term: its probe, metrics and logs).
          latent_shape: if given, each example also gets its own N(0, I) draw of this shape,
            passed as ``per_example_loss(x, y, latent)`` (a GAN's generator input): random
            values drawn inside ``per_example_loss`` are shared by the batch, not rows of it.
          targets: the per-example targets the term reads instead of ``data``'s y (same
            leading axes as y, e.g. labels packed with a per-example column; a
            ``PerExampleObjective`` only).
          return_release: also return the step's 0/1 release flag (0: a privacy budget or
            the full ledger refused the step and nothing was applied), to keep state the
            step derives from the same batch only when released.

        Returns:
          The step's logs: {"loss": the mean term over the batch's examples,
          "nonfinite_examples": examples whose gradient was NaN/Inf this epoch (they contribute
          zero)} — functions of the private batch, outside ε; {} with
          ``compile(private_logs=True)``. With ``return_release``: (logs, release).
        """
        self._step_door.require_open(self.name)
        _one_call_per_step(self)
        if isinstance(per_example_loss, PerExampleObjective):
            return self._update_on_outputs(per_example_loss, data, targets, return_release)
        if targets is not None:
            raise ValueError("`targets` goes with a PerExampleObjective; per_example_loss(x, y) reads data's y.")
        x, y, mask, expected_batch_size = self._unpack_custom_batch(data)
        model = _objective_model(self, self if trains is None else trains, per_example_loss)
        _probe_on_trace(self, model, latent_shape)
        optimizer, ledger = self.optimizer, self._ledger_of_plan()
        dp_step, sigma = ledger.steps.read_value(), optimizer.noise_multiplier_tensor()
        variables = model.trainable_variables
        wants_norms = getattr(optimizer, "adaptive_clip", None) is not None
        inputs = self._objective_inputs(x, y, mask, latent_shape)
        clip_chunk = chunk_clipper(self, model, _objective_losses, optimizer.clip_bound(),
                                   optimizer.evaluation_points(variables))
        # The objective model's inputs are its targets too (read by no loss): every leaf has the views' axes.
        totals = clipped_sum_over_chunks(clip_chunk, inputs, inputs, mask, variables, wants_norms)
        release = ledger.record_step(sigma, self.step_limit.allows(dp_step, sigma))
        optimizer.apply(ClippedSum(
            totals.sums, expected_batch_size, dp_step, noise_multiplier=sigma, release=release,
            public_gradients=regularization_gradients(variables), squared_norms=totals.squared_norms,
            mask=tf.reshape(mask, [-1]) if wants_norms else None), variables)
        mean_loss, nonfinite = tf.math.divide_no_nan(totals.loss_total, tf.reduce_sum(mask)), totals.nonfinite
        logs = {}
        if not self._dp["private_logs"]:
            self.nonfinite_examples.assign_add(nonfinite)
            logs = {"loss": mean_loss, "nonfinite_examples": self.nonfinite_examples.read_value()}
        return (logs, release) if return_release else logs

    def _update_on_outputs(self, objective: PerExampleObjective, data, targets, return_release: bool):
        """The built-in DP step with ``objective``'s term of the model's outputs (and ``targets``)."""
        x, y, mask, expected_batch_size = self._unpack_dp_batch(data)
        logs, release = self._dp_step(x, y if targets is None else targets, mask, expected_batch_size,
                                      objective=objective)
        return (logs, release) if return_release else logs

    def _latent_seeds(self) -> keras.random.SeedGenerator:
        """The seed generator of ``latent_shape`` draws (not a saved weight, not the DP noise key)."""
        if "latent_seeds" not in self._untracked.__dict__:
            with tf.init_scope():
                self._untracked.latent_seeds = keras.random.SeedGenerator()
        return self._untracked.latent_seeds

    def _objective_inputs(self, x, y, mask, latent_shape):
        """{x, y, latent} of the objective model, [chunks, P, ...] each. With the plan's
        views on an axis (augmentation multiplicity by ``augment``, docs/algorithms.md §8; a
        user's examples, §11) every leaf carries them on axis 2, so that view k of the unit is
        (x[:, k], y[:, k], latent[:, k]): y is repeated per view unless it holds one target
        per view (§11), and each view draws its own latent."""
        views = self.step_plan.views
        per_view = views.view_axis
        if per_view and y is not None and not views.targets_per_view:
            y = tf.nest.map_structure(lambda t: tf.repeat(tf.expand_dims(t, 2), views.count, axis=2), y)
        inputs = {INPUTS: x, **({} if y is None else {TARGETS: y})}
        if latent_shape is not None:
            leading = tf.concat([tf.shape(mask), tf.constant([views.count] if per_view else [], tf.int32)], 0)
            inputs[LATENT] = keras.random.normal(tf.concat([leading, tf.constant(tuple(latent_shape), tf.int32)], 0),
                                                 seed=self._latent_seeds())
        return inputs

    def _unpack_custom_batch(self, data):
        """(x, y or None, mask, L) with a chunk axis, from a Poisson batch or an explicit one."""
        if isinstance(data, dict) and "mask" in data:
            return data["x"], no_targets_as_none(data.get("y")), data["mask"], data["expected_batch_size"][0]
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if sample_weight is not None:
            raise ValueError("private_update takes no sample weights: weigh the terms inside per_example_loss.")
        chunked = lambda t: tf.expand_dims(t, 0)  # noqa: E731
        mask = tf.ones([1, tf.shape(tf.nest.flatten(x)[0])[0]], tf.float32)
        y = None if y is None else tf.nest.map_structure(chunked, y)
        return tf.nest.map_structure(chunked, x), y, mask, self._declared_batch_size.read_value()


def _objective_model(owner, trains, fn) -> _Objective:
    """One ``_Objective`` per (trains, fn), held where no tracker or saver reaches."""
    cache = owner._untracked.__dict__.setdefault("objectives", {})
    key = (id(trains), fn)
    if key not in cache:
        cache[key] = (trains, _Objective(owner, trains, fn))
    return cache[key][1]


def _one_release_per_step(train_step):
    """Wraps a user's ``train_step``: the outermost call opens the count of its
    ``private_update`` calls (at trace time in a graph, per call eagerly)."""
    @functools.wraps(train_step)
    def counted_train_step(self, data):
        counts = _update_counts(self)
        if counts.get(threading.get_ident()) is not None:  # a train_step calling super().train_step
            return train_step(self, data)
        counts[threading.get_ident()] = 0
        try:
            return train_step(self, data)
        finally:
            del counts[threading.get_ident()]

    counted_train_step.counts_private_updates = True
    return counted_train_step


def _update_counts(owner) -> dict:
    """{thread: private_update calls in the train step it runs}: tf.distribute replicas run
    the step in threads of their own, each its own step on its share of the batch."""
    return owner._untracked.__dict__.setdefault("private_updates_this_step", {})


def _one_call_per_step(owner) -> None:
    """Refuses a second ``private_update`` in one train step: two DP releases of one batch
    are one mechanism at σ_eff = (σ₁⁻² + σ₂⁻²)^(−1/2), which two ledger records at σ₁ and σ₂
    would under-account."""
    counts, thread = _update_counts(owner), threading.get_ident()
    if counts.get(thread) is None:
        raise RuntimeError(f"{owner.name}: private_update is called from the model's own train_step (inside "
                           "fit/train_on_batch).")
    if counts[thread]:
        raise RuntimeError(
            f"{owner.name}: private_update was called twice in one train step. Two releases of the same batch "
            "are ONE mechanism at σ_eff = (σ₁⁻² + σ₂⁻²)^(−1/2), not two steps at σ: tf_dp does not account that "
            "yet. Fix: ONE private_update per step over the joint per-example term of every model that reads "
            "`data` (e.g. a GAN's d_loss + g_loss, the generator's part reading a frozen copy of the "
            "discriminator), with `trains` covering all of them (default: the whole model): one clip, one "
            "draw, one step of ε; update the rest (a GAN's generator) only from values that do not read `data` "
            "(docs/guides/keras-models.md#your-own-training-logic).")
    counts[thread] += 1


def _probe_on_trace(owner, model, latent_shape) -> None:
    """The row-independence probe of the objective (tf_dp.models.row_independence) on the
    head rows of the model's last probe, once per trace (eagerly, nothing in the step)."""
    probed = row_independence._latest.get(owner)
    done = owner._untracked.__dict__.setdefault("objective_probes", {})
    if probed is None or (tf.executing_eagerly() and done.get(id(model)) is probed):  # eagerly: once per fit
        return
    x, y = probed.head
    with tf.init_scope():
        inputs = {INPUTS: x, **({} if y is None else {TARGETS: y})}
        rows = tf.nest.flatten(x)[0].shape[0]
        if latent_shape is not None:  # any values: the probe compares rows, it does not train
            inputs[LATENT] = np.random.default_rng(0).normal(size=(rows, *latent_shape)).astype(np.float32)
        row_independence.check_rows_independent(model, _objective_losses, inputs, tf.zeros([rows]))
    done[id(model)] = probed


def regularization_gradients(variables):
    """∇ of the variables' weight regularizers: a function of θ only, so public (no noise
    needed); the built-in step and ``private_update`` both add it after averaging.

    Args:
      variables: the trainable variables of the step.

    Returns:
      One gradient per variable (zeros where it has no regularizer), or None if none has one.
    """
    regularized = [v for v in variables if getattr(v, "regularizer", None)]
    if not regularized:
        return None
    with tf.GradientTape() as tape:
        penalty = tf.add_n([v.regularizer(v) for v in regularized])
    return [tf.zeros_like(v) if g is None else g for g, v in zip(tape.gradient(penalty, variables), variables)]

