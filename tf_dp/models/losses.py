"""Per-example losses ℓ_i from a Keras loss specification (no reduction over the batch).

Per-example clipping bounds one example's influence by C only if ℓ_i = ℓ(θ; x_i, y_i):
one value per example, depending on row i alone. A loss that reduces over the batch (one
number for the batch: a custom ``reduce_mean``, Keras' ``dice``/``tversky`` with
``axis=None``) or combines rows (``circle``: pairwise distances within the batch) makes
every example's gradient depend on the others — adding one example then moves the
released sum by more than C. Both are refused:

* statically: the result must have rank ≥ 1 and one value per row of y_pred;
* by a probe, on first use for each shape: on a small synthetic batch, changing row k of
  y_pred (or of y_true) must leave ℓ_j, j ≠ k, bit-for-bit unchanged; so must moving one
  row's loss from the smallest of an 8- or 16-row batch to the largest (hard-example mining
  and other losses that depend on the ranks of the ℓ_i within the batch).

Weights are part of the example (they travel with its row, so the sensitivity stays C):

* ``sample_weight`` w_i (shape [P]) or per element w_it (shape [P, T], e.g. a keras-hub
  preprocessor's padding mask for LM fine-tuning) and ``class_weight`` (w_i = cw[y_i]):
  ℓ_i = Σ_t w_it ℓ_it / T — Keras' "sum_over_batch_size" reduction taken per example, so
  Σ_i ℓ_i / P is exactly the batch loss Keras would compute. A loss built with
  ``reduction="mean_with_sample_weight"`` gives ℓ_i = Σ_t w_it ℓ_it / Σ_t w_it instead (0
  when Σ_t w_it = 0): the denominator is example i's own weight total, a function of row i
  alone — never a total over the batch, which would make ℓ_i depend on other examples.
* several outputs with a list/dict of losses and ``loss_weights``: ℓ_i = Σ_o λ_o ℓ_o,i,
  each ℓ_o,i reduced per example as above (Keras' ``CompileLoss`` sums the outputs' batch
  losses with the same weights).
"""

from __future__ import annotations

import inspect
from typing import Callable, NamedTuple, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf
from keras.src.losses import loss as loss_module
from keras.src.losses.losses import LossFunctionWrapper
from keras.src.trainers import compile_utils

PROBE_ROWS = 3  # rows of the probe's row sweep
RANK_PROBE_ROWS = (8, 16)  # batch sizes of the probe's rank moves
FIX = ("Fix: return one loss value per example, computed from that example's row alone (e.g. a "
       "keras.losses.Loss whose call() keeps the batch axis, or `axis=` for dice/tversky); "
       "tf_dp averages any further axes per example.")


class WeightedTargets(NamedTuple):
    """Targets packed with their sample weights (one row per example), as the DP train step
    hands them to the per-example loss: the weights are sliced with the rows of y."""

    targets: object
    sample_weight: object


def unpack_targets(y):
    """(targets, sample_weight or None) of y, packed or not."""
    if isinstance(y, WeightedTargets):
        return y.targets, y.sample_weight
    return y, None


def without_unused_targets(loss_fn, y):
    """``y`` without the None targets of outputs whose loss is None (``loss=[fn, None]``
    with ``y=[y0, None]``, as Keras accepts): what the DP step and the data pipeline take."""
    strip = getattr(loss_fn, "without_unused_targets", None)
    return y if strip is None or y is None else strip(y)


def per_example_loss(loss, loss_weights=None, output_names: Optional[Sequence[str]] = None
                     ) -> Callable[[tf.Tensor, tf.Tensor], tf.Tensor]:
    """Returns f(y_true, y_pred) -> [P] with ℓ_i averaged over any non-batch axes, as
    Keras' "sum_over_batch_size" reduction would weight them, weighted by the sample
    weights when y_true is a ``WeightedTargets``, and summed over the outputs with
    ``loss_weights`` for a list/dict of losses (module docstring). Refuses (ValueError
    naming `loss`) a loss without one value per example or whose ℓ_i depends on other rows."""
    if loss is None:
        raise ValueError("`loss` is required: DP training clips the gradient of each example's loss.")
    several_outputs = output_names is not None and len(output_names) > 1
    if not isinstance(loss, (list, tuple, dict)) and loss_weights is None and not several_outputs:
        return _SingleOutputLoss(loss)
    return _MultiOutputLoss(loss, loss_weights, output_names)


class _SingleOutputLoss:
    """ℓ_i of one output: the loss's values reduced per example (weighted if y is packed)."""

    def __init__(self, loss):
        self.identifier = loss
        self.unreduced, self.by_weight_total = None, False
        if not _chosen_by_shapes(loss):
            self._resolve(resolve_loss(loss))
        self._probed = set()

    def _resolve(self, resolved: keras.losses.Loss) -> None:
        self.unreduced = resolved.call
        _require_two_argument_call(self.unreduced)
        self.by_weight_total = getattr(resolved, "reduction", None) == "mean_with_sample_weight"

    def __call__(self, y_true, y_pred):
        if tf.nest.is_nested(y_pred):  # one loss for every output, as Keras' CompileLoss broadcasts it
            if not hasattr(self, "_every_output"):
                self._every_output = _MultiOutputLoss(self.identifier, None, None)
            return self._every_output(y_true, y_pred)
        y_true, sample_weight = unpack_targets(y_true)
        y_true = tf.convert_to_tensor(y_true)
        if self.unreduced is None:  # "crossentropy": binary, sparse or categorical by the shapes, as Keras
            self._resolve(compile_utils.get_loss(self.identifier, y_true, y_pred))
        values = _per_row(self.unreduced, y_true, y_pred, sample_weight, self.by_weight_total, output_mask(y_pred))
        signature = _signature(y_true, y_pred)
        if signature not in self._probed:
            with tf.init_scope():  # eager, also while a train step is being traced
                check_loss_rows_independent(self.unreduced, y_true, y_pred)
            self._probed.add(signature)
        return values


class _MultiOutputLoss:
    """ℓ_i = Σ_o λ_o ℓ_o,i over the model's outputs, matched to losses, targets, sample
    weights and ``loss_weights`` by output name (dicts) or position (lists), as Keras'
    CompileLoss does; a single loss applies to every output."""

    def __init__(self, loss, loss_weights, output_names):
        self.loss, self.loss_weights = loss, loss_weights
        self.output_names = list(output_names) if output_names else None
        for leaf in (loss.values() if isinstance(loss, dict) else loss if isinstance(loss, (list, tuple)) else [loss]):
            if leaf is not None and not _chosen_by_shapes(leaf):
                resolve_loss(leaf)  # an unknown name is refused at compile
        self._per_output: dict = {}

    def __call__(self, y_true, y_pred):
        y_true, sample_weight = unpack_targets(y_true)
        names, predictions = self._outputs(y_pred)
        for structure, what in ((self.loss, "loss"), (self.loss_weights, "loss_weights")):
            _require_known_keys(structure, names, what)
        with_loss = [name for index, name in enumerate(names)
                     if _pick(self.loss, name, index, len(names), "loss", broadcast=True) is not None]
        y_true = _onto_outputs_with_loss(y_true, names, with_loss)
        sample_weight = _onto_outputs_with_loss(sample_weight, names, with_loss)
        total = None
        for index, (name, prediction) in enumerate(zip(names, predictions)):
            loss = _pick(self.loss, name, index, len(names), "loss", broadcast=True)
            if loss is None:
                continue
            weight = _pick(self.loss_weights, name, index, len(names), "loss_weights", broadcast=True)
            weight = 1.0 if weight is None else float(weight)
            targets = _pick(y_true, name, index, len(names), "y", broadcast=False)
            if targets is None:
                raise ValueError(f"`y` has no targets (None) for output {name!r}, which has a loss: give its targets, "
                                 "or set its loss to None.")
            weights = _pick(sample_weight, name, index, len(names), "sample_weight", broadcast=True)
            if name not in self._per_output:
                self._per_output[name] = _SingleOutputLoss(loss)
            packed = targets if weights is None else WeightedTargets(targets, weights)
            term = self._per_output[name](packed, prediction) * tf.cast(weight, prediction.dtype)
            term = tf.cast(term, tf.float32) if total is not None and total.dtype != term.dtype else term
            total = term if total is None else tf.cast(total, term.dtype) + term
        if total is None:
            raise ValueError("`loss` assigns no loss to any of the model's outputs.")
        return total

    def without_unused_targets(self, y):
        """``y`` without the None targets of outputs that have no loss, as Keras accepts
        ``y=[y0, None]`` (or ``y0`` alone) for ``loss=[fn, None]``: the targets left, one
        per output with a loss (a single array if one is left). Refuses (ValueError naming
        `y`) None targets for an output that has a loss."""
        if isinstance(y, dict):
            names = list(y)
            unused = {name for name in names if y[name] is None and self._loss_of(name, names) is None}
            return {name: value for name, value in y.items() if name not in unused}
        if not isinstance(y, (list, tuple)) or all(target is not None for target in y):
            return y
        names = self.output_names if self.output_names and len(self.output_names) == len(y) \
            else [str(i) for i in range(len(y))]
        for index, (name, target) in enumerate(zip(names, y)):
            if target is None and self._loss_of(name, names) is not None:
                raise ValueError(f"`y[{index}]` is None, but output {name!r} has a loss: give its targets, or set "
                                 "its loss to None.")
        kept = tuple(target for target in y if target is not None)
        return kept[0] if len(kept) == 1 else kept

    def _loss_of(self, name: str, names: list):
        """The loss of output ``name`` (``names``: the outputs in order, when the model's are unknown)."""
        if isinstance(self.loss, dict):
            return self.loss.get(name)
        if not isinstance(self.loss, (list, tuple)):
            return self.loss
        order = self.output_names if self.output_names and name in self.output_names else names
        return self.loss[order.index(name)] if len(self.loss) == len(order) else self.loss  # a mismatch: refused later

    def _outputs(self, y_pred):
        if isinstance(y_pred, dict):
            names = list(self.output_names) if self.output_names and set(self.output_names) == set(y_pred) \
                else list(y_pred)
            return names, [y_pred[name] for name in names]
        predictions = list(y_pred) if isinstance(y_pred, (list, tuple)) else [y_pred]
        names = self.output_names if self.output_names and len(self.output_names) == len(predictions) \
            else [str(i) for i in range(len(predictions))]
        return list(names), predictions


_BY_SHAPES = ("crossentropy", "ce")


def _chosen_by_shapes(loss) -> bool:
    """Keras' "crossentropy"/"ce": the loss is picked from the target and output shapes."""
    return isinstance(loss, str) and loss.lower() in _BY_SHAPES


def resolve_loss(loss) -> keras.losses.Loss:
    """The Keras Loss that ``compile(loss=loss)`` evaluates: a string or a function is
    wrapped as Keras wraps it (``LossFunctionWrapper``, whose ``call`` first aligns the
    ranks of y_true and y_pred: labels [B] against outputs [B, 1]); a Loss stays itself.
    Raises ValueError naming `loss` for an unknown identifier."""
    if isinstance(loss, keras.losses.Loss):
        return loss
    try:
        resolved = keras.losses.get(loss)
    except ValueError as error:
        raise ValueError(f"Unknown `loss`: {loss!r} ({error}). Fix: pass a Keras loss name (e.g. "
                         "'binary_crossentropy'), a keras.losses.Loss or a function (y_true, y_pred).") from None
    if resolved is None:
        raise ValueError(f"Unknown `loss`: {loss!r}.")
    if isinstance(resolved, keras.losses.Loss):
        return resolved
    _require_two_argument_call(resolved)
    name = loss if isinstance(loss, str) else getattr(resolved, "__name__", None)
    return LossFunctionWrapper(resolved, name=name)


def _pick(structure, name: str, index: int, count: int, what: str, broadcast: bool):
    """The part of ``structure`` for output (name, index): by key, by position, or the
    whole of a non-nested value (a single loss, weight or array for every output)."""
    if structure is None:
        return None
    if isinstance(structure, dict):
        if name in structure:
            return structure[name]
        if not broadcast:
            raise ValueError(f"`{what}` has no entry for output {name!r} (keys: {sorted(structure)}).")
        return None
    if isinstance(structure, (list, tuple)):
        if len(structure) != count:
            raise ValueError(f"`{what}` has {len(structure)} entries for a model with {count} outputs.")
        return structure[index]
    if not broadcast and count > 1:
        raise ValueError(f"`{what}` must be a list or dict with one entry per output for a model with {count} outputs.")
    return structure


def _onto_outputs_with_loss(structure, names: list, with_loss: list):
    """Targets (or sample weights) given only for the outputs that have a loss — one
    array, or a list with one entry per such output, for a model with more outputs — as
    {output name: entry}, in the outputs' order (Keras' CompileLoss does the same);
    anything else unchanged."""
    if structure is None or isinstance(structure, dict) or len(with_loss) == len(names):
        return structure
    flat = list(structure) if isinstance(structure, (list, tuple)) else [structure]
    if len(flat) != len(with_loss) or (isinstance(structure, (list, tuple)) and len(flat) == len(names)):
        return structure
    return dict(zip(with_loss, flat))


def _require_known_keys(structure, names, what: str) -> None:
    if isinstance(structure, dict) and set(structure) - set(names):
        raise ValueError(f"`{what}` has keys {sorted(set(structure) - set(names))} that name no output of the model "
                         f"(outputs: {list(names)}).")


def _require_two_argument_call(function) -> None:
    """The loss must be callable as f(y_true, y_pred): no further required argument."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # no signature to read: the probe will call it
        return
    required = [p.name for p in parameters if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if len(required) > 2:
        raise ValueError(
            f"`loss` {getattr(function, '__name__', function)!r} needs arguments besides (y_true, y_pred): "
            f"{', '.join(required[2:])}. Fix: pass a keras.losses.Loss instance (e.g. "
            "keras.losses.CategoricalGeneralizedCrossEntropy(q=0.5)) or functools.partial(loss, ...)."
        )


def output_mask(y_pred):
    """The Keras mask of an output (``compute_mask`` of the layer that made it, e.g. an
    Embedding(mask_zero=True) carried through the sequence layers), or None."""
    return getattr(y_pred, "_keras_mask", None)


def _per_row(unreduced, y_true, y_pred, sample_weight=None, by_weight_total: bool = False,
             mask=None) -> tf.Tensor:
    """ℓ_i, i < P: the loss's values averaged per example over its non-batch axes, or with
    sample weights w (one per example, or one per value of the loss): Σ_t w_it ℓ_it / T, or
    Σ_t w_it ℓ_it / Σ_t w_it (``by_weight_total``; 0 where an example's weights sum to 0).
    Both denominators belong to example i alone. With a Keras output ``mask`` m (of y_pred,
    or of the loss values, as keras.losses.Loss reads them; both: their conjunction), the
    values at masked positions weigh 0 and T becomes example i's own count of unmasked
    values, Σ_t m_it (0 if none): ℓ_i = Σ_t m_it w_it ℓ_it / Σ_t m_it, resp.
    Σ_t m_it w_it ℓ_it / Σ_t m_it w_it (docs/algorithms.md §1.2)."""
    y_true = tf.cast(y_true, y_pred.dtype)
    values = tf.convert_to_tensor(unreduced(y_true, y_pred))
    _require_one_value_per_row(values, y_pred)
    mask = _combined_mask(mask, getattr(values, "_keras_mask", None))
    if mask is not None:
        return _masked_per_row(values, mask, sample_weight, by_weight_total)
    if sample_weight is None:
        if values.shape.rank is None or values.shape.rank > 1:
            values = tf.reduce_mean(tf.reshape(values, [tf.shape(values)[0], -1]), axis=1)
        return values
    rows = tf.shape(values)[0]
    flat = tf.reshape(values, [rows, -1])
    weights = tf.reshape(tf.cast(sample_weight, values.dtype), [rows, -1])
    _require_weights_match(weights, flat, sample_weight, values)
    weights = weights * tf.ones_like(flat)  # one weight per example: the same for each of its values
    weighted = tf.reduce_sum(flat * weights, axis=1)
    if by_weight_total:
        return tf.math.divide_no_nan(weighted, tf.reduce_sum(weights, axis=1))
    return weighted / tf.cast(tf.shape(flat)[1], values.dtype)


def _combined_mask(in_mask, out_mask):
    if in_mask is None or out_mask is None:
        return out_mask if in_mask is None else in_mask
    return tf.logical_and(tf.cast(in_mask, tf.bool), tf.cast(out_mask, tf.bool))


def _masked_per_row(values, mask, sample_weight, by_weight_total: bool) -> tf.Tensor:
    """ℓ_i = Σ_t m_it w_it ℓ_it / Σ_t m_it (or / Σ_t m_it w_it): Keras' masked reduction with
    the batch's count of unmasked values replaced by example i's own (``_per_row``)."""
    mask = tf.cast(mask, values.dtype)
    values, mask = loss_module.squeeze_or_expand_to_same_rank(values, mask)  # as Keras aligns them
    rows = tf.shape(values)[0]
    mask = tf.reshape(mask * tf.ones_like(values), [rows, -1])  # broadcast: one weight per value
    flat = tf.reshape(values, [rows, -1])
    weights = mask
    if sample_weight is not None:
        per_value = tf.reshape(tf.cast(sample_weight, values.dtype), [rows, -1])
        _require_weights_match(per_value, flat, sample_weight, values)
        weights = mask * per_value
    weighted = tf.reduce_sum(flat * weights, axis=1)
    return tf.math.divide_no_nan(weighted, tf.reduce_sum(weights if by_weight_total else mask, axis=1))


def metric_weights_for_masks(weights, y_pred):
    """Metric sample weights that fit Keras' merge with the outputs' masks: per-example
    weights [P] (the padding mask of the step) take trailing axes of size 1 up to the rank
    of an output's mask ([P, 1] against a [P, T] mask), so that Keras multiplies them into
    the mask rather than broadcasting [P] along T (which crashes, or at P = T weighs
    positions by examples). One weight structure per output when outputs are nested."""
    if weights is None or not any(output_mask(p) is not None for p in tf.nest.flatten(y_pred)):
        return weights
    if tf.nest.is_nested(y_pred) and not tf.nest.is_nested(weights):
        weights = tf.nest.map_structure(lambda _: weights, y_pred)
    if not tf.nest.is_nested(y_pred):
        return _expand_to_mask(weights, output_mask(y_pred))
    return tf.nest.map_structure(lambda w, p: _expand_to_mask(w, output_mask(p)), weights, y_pred)


def _expand_to_mask(weight, mask):
    if mask is None or weight is None:
        return weight
    weight = tf.convert_to_tensor(weight)
    missing = mask.shape.rank - weight.shape.rank
    return tf.reshape(weight, tf.concat([tf.shape(weight), tf.ones([missing], tf.int32)], 0)) if missing > 0 \
        else weight


def class_weights_of(y, table: Sequence[float]) -> tf.Tensor:
    """w_i = cw[label of example i] for y shaped [chunks, P] (class ids), [chunks, P, 1] or
    [chunks, P, K] (one-hot / probabilities: the argmax, as Keras); classes beyond the table
    weigh 1. A function of example i's own label only (module docstring)."""
    if tf.nest.is_nested(y):
        raise ValueError("`class_weight` is supported for models with one output (as in Keras).")
    rank = y.shape.rank
    if rank == 3 and y.shape[-1] == 1:
        labels = y[..., 0]
    elif rank == 3:
        labels = tf.argmax(y, axis=-1)
    elif rank == 2:
        labels = y
    else:
        raise ValueError(f"`class_weight` needs one label per example (y of shape [batch], [batch, 1] or one-hot "
                         f"[batch, classes]); got y with {rank - 1 if rank else 'unknown'} dimensions per batch. "
                         "For per-token weights pass `sample_weight`.")
    labels = tf.cast(tf.round(tf.cast(labels, tf.float32)), tf.int32) if labels.dtype.is_floating \
        else tf.cast(labels, tf.int32)
    inside = (labels >= 0) & (labels < len(table))
    weights = tf.gather(tf.constant(table, tf.float32), tf.clip_by_value(labels, 0, len(table) - 1))
    return tf.where(inside, weights, 1.0)


def _require_weights_match(weights, flat, sample_weight, values) -> None:
    per_row, count = weights.shape[1], flat.shape[1]
    if per_row is not None and count is not None and per_row not in (1, count):
        raise ValueError(
            f"`sample_weight` of shape {list(tf.convert_to_tensor(sample_weight).shape)} does not fit a loss of shape "
            f"{values.shape.as_list()}: give one weight per example ([batch]) or one per loss value "
            f"({values.shape.as_list()}, e.g. a per-token padding mask for a sequence loss).")


def _require_one_value_per_row(values: tf.Tensor, y_pred: tf.Tensor) -> None:
    """Static: rank(values) ≥ 1 and values.shape[0] = y_pred.shape[0] when both are known."""
    rows, batch = (values.shape[0] if values.shape.rank else None), y_pred.shape[0]
    if values.shape.rank == 0 or (rows is not None and batch is not None and rows != batch):
        raise ValueError(
            f"`loss` returned shape {values.shape.as_list()} for a batch of {batch} predictions: DP training needs "
            "one loss value per example (shape [batch, ...]); a loss reduced over the batch makes each example's "
            f"gradient depend on the others, which per-example clipping cannot bound. {FIX}"
        )


def _signature(y_true, y_pred) -> tuple:
    return (tuple(y_true.shape[1:]), y_true.dtype, tuple(y_pred.shape[1:]), y_pred.dtype)


def check_loss_rows_independent(unreduced, y_true, y_pred, rows: int = PROBE_ROWS) -> None:
    """Refuses a loss whose ℓ_j moves when only another row k of the batch changes, on
    synthetic batches shaped like (y_true, y_pred):

    * row sweep, ``rows`` rows: for each row k, replacing y_pred[k] (then y_true[k]) leaves
      ℓ_j for every j ≠ k exactly unchanged;
    * rank moves, at each size in ``RANK_PROBE_ROWS``: the row with the smallest loss takes
      the (y_true, y_pred) of the row with the largest — its loss moves from the smallest to
      the largest — and the other way round. A loss that depends on the ranks of the ℓ_i
      within the batch (hard-example mining: keep the top ⌈f·B⌉ losses, zero the others) may
      pass a sweep — on 3 rows ⌈0.7·3⌉ keeps every row — but every row's rank moves here, on
      batches where any fraction f ≤ 15/16 drops a row (rows 8 and 16).

    Synthetic values: y_pred ~ U(0.05, 0.95) (valid probabilities, logits, positive rates);
    y_true alternates 0/1 across rows and entries (valid labels for sparse, one-hot and
    binary losses, and two classes, so pairwise losses see both positives and negatives).
    13 evaluations of the loss at the defaults (each on at most 16 rows), once per shape."""
    for size in sorted({rows, *RANK_PROBE_ROWS}):
        true, pred = _synthetic_batch(y_true, y_pred, size)
        try:
            base = _probe_values(unreduced, true, pred)
            changes = (_row_changes(true, pred) if size == rows else []) + _rank_moves(base, true, pred)
            for k, what, changed in changes:
                _compare_other_rows(base, _probe_values(unreduced, *changed), k, what)
        except ValueError as error:
            if "`loss`" in str(error):
                raise
            raise _probe_failed(error, true, pred) from error
        except (TypeError, tf.errors.OpError) as error:
            raise _probe_failed(error, true, pred) from error


def _row_changes(true: np.ndarray, pred: np.ndarray) -> list:
    """(k, what changed, (y_true, y_pred)) with row k of y_pred, then of y_true, replaced."""
    changes = []
    for k in range(len(pred)):
        changes.append((k, "y_pred", (true, _replace_row(pred, k, 1.0 - pred[k]))))
        changes.append((k, "y_true", (_replace_row(true, k, 1 - true[k]), pred)))
    return changes


def _rank_moves(base: np.ndarray, true: np.ndarray, pred: np.ndarray) -> list:
    """(k, what changed, (y_true, y_pred)): the smallest-loss row given the largest-loss row's
    (y_true, y_pred), and the largest-loss row given the smallest's (none if all are equal)."""
    if np.all(np.isnan(base)):
        return []
    lowest, highest = int(np.nanargmin(base)), int(np.nanargmax(base))
    if base[lowest] == base[highest]:
        return []
    moves = []
    for k, donor, direction in ((lowest, highest, "smallest to the largest"),
                                (highest, lowest, "largest to the smallest")):
        what = f"y_true and y_pred (moving its loss from the batch's {direction})"
        moves.append((k, what, (_replace_row(true, k, true[donor]), _replace_row(pred, k, pred[donor]))))
    return moves


def _probe_values(unreduced, true: np.ndarray, pred: np.ndarray) -> np.ndarray:
    return _per_row(unreduced, tf.constant(true), tf.constant(pred)).numpy()


def _synthetic_batch(y_true, y_pred, rows: int) -> tuple[np.ndarray, np.ndarray]:
    shape = lambda t: [rows] + [4 if d is None else d for d in t.shape[1:]]  # noqa: E731
    rng = np.random.default_rng(0)
    pred = rng.uniform(0.05, 0.95, size=shape(y_pred)).astype(y_pred.dtype.as_numpy_dtype)
    row_shape = shape(y_true)[1:]
    within_row = np.arange(int(np.prod(row_shape))).reshape(row_shape)
    pattern = (np.arange(rows).reshape([rows] + [1] * len(row_shape)) + within_row) % 2
    return pattern.astype(y_true.dtype.as_numpy_dtype), pred


def _replace_row(array: np.ndarray, k: int, row: np.ndarray) -> np.ndarray:
    changed = array.copy()
    changed[k] = row
    return changed


def _compare_other_rows(base: np.ndarray, changed: np.ndarray, k: int, what: str) -> None:
    others = np.arange(len(base)) != k
    moved = ~((base == changed) | (np.isnan(base) & np.isnan(changed)))
    if np.any(moved & others):
        j = int(np.flatnonzero(moved & others)[0])
        raise ValueError(
            f"`loss` mixes examples: changing row {k} of {what} changed the loss of row {j} "
            f"({float(base[j]):.7g} -> {float(changed[j]):.7g}) in a probe batch of {len(base)} rows. Each example's "
            f"loss must depend on that example alone (no batch statistics, pairwise terms, ranks or top-k selection "
            f"within the batch, or batch reductions), or per-example clipping does not bound it. {FIX}"
        )


def _probe_failed(error: Exception, true: np.ndarray, pred: np.ndarray) -> ValueError:
    return ValueError(
        f"tf_dp could not check that `loss` is computed per example: it failed on a probe batch "
        f"(y_true shape {list(true.shape)}, y_pred shape {list(pred.shape)}): {type(error).__name__}: {error}. "
        f"{FIX}"
    )
