"""Per-example losses ℓ_i from a Keras loss specification (no reduction over the batch).

Per-example clipping bounds one example's influence by C only if ℓ_i = ℓ(θ; x_i, y_i):
one value per example, depending on row i alone. A loss that reduces over the batch (one
number for the batch: a custom ``reduce_mean``, Keras' ``dice``/``tversky`` with
``axis=None``) or combines rows (``circle``: pairwise distances within the batch) makes
every example's gradient depend on the others — adding one example then moves the
released sum by more than C. Both are refused:

* statically: the result must have rank ≥ 1 and one value per row of y_pred;
* by a probe, on first use for each shape: on a small synthetic batch, changing row k of
  y_pred (or of y_true) must leave ℓ_j, j ≠ k, bit-for-bit unchanged.
"""

from __future__ import annotations

import inspect
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

PROBE_ROWS = 3
FIX = ("Fix: return one loss value per example, computed from that example's row alone (e.g. a "
       "keras.losses.Loss whose call() keeps the batch axis, or `axis=` for dice/tversky); "
       "tf_dp averages any further axes per example.")


def per_example_loss(loss) -> Callable[[tf.Tensor, tf.Tensor], tf.Tensor]:
    """Returns f(y_true, y_pred) -> [P] with ℓ_i averaged over any non-batch axes, as
    Keras' "sum_over_batch_size" reduction would weight them. Refuses (ValueError naming
    `loss`) a loss without one value per example or whose ℓ_i depends on other rows."""
    unreduced = _unreduced(loss)
    probed = set()

    def losses(y_true, y_pred):
        values = _per_row(unreduced, y_true, y_pred)
        signature = _signature(y_true, y_pred)
        if signature not in probed:
            with tf.init_scope():  # eager, also while a train step is being traced
                check_loss_rows_independent(unreduced, y_true, y_pred)
            probed.add(signature)
        return values

    return losses


def _unreduced(loss) -> Callable:
    if loss is None:
        raise ValueError("`loss` is required: DP training clips the gradient of each example's loss.")
    if isinstance(loss, (list, tuple, dict)):
        raise ValueError(
            "tf_dp supports one loss for a single-output model; got a structure of losses. "
            "Combine the outputs' losses into one keras.losses.Loss."
        )
    resolved = keras.losses.get(loss)
    if resolved is None:
        raise ValueError(f"Unknown `loss`: {loss!r}.")
    unreduced = resolved.call if isinstance(resolved, keras.losses.Loss) else resolved
    _require_two_argument_call(unreduced)
    return unreduced


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


def _per_row(unreduced, y_true, y_pred) -> tf.Tensor:
    """ℓ_i, i < P: the loss's values, averaged per example over its non-batch axes."""
    y_true = tf.cast(y_true, y_pred.dtype)
    values = tf.convert_to_tensor(unreduced(y_true, y_pred))
    _require_one_value_per_row(values, y_pred)
    if values.shape.rank is None or values.shape.rank > 1:
        values = tf.reduce_mean(tf.reshape(values, [tf.shape(values)[0], -1]), axis=1)
    return values


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
    """On a synthetic batch of ``rows`` rows shaped like (y_true, y_pred): for each row k,
    replacing y_pred[k] (then y_true[k]) leaves ℓ_j for every j ≠ k exactly unchanged.

    Synthetic values: y_pred ~ U(0.05, 0.95) (valid probabilities, logits, positive rates);
    y_true alternates 0/1 across rows and entries (valid labels for sparse, one-hot and
    binary losses, and two classes, so pairwise losses see both positives and negatives)."""
    true, pred = _synthetic_batch(y_true, y_pred, rows)
    try:
        base = _probe_values(unreduced, true, pred)
        for k in range(rows):
            for name, changed in (("y_pred", (true, _replace_row(pred, k, 1.0 - pred[k]))),
                                  ("y_true", (_replace_row(true, k, 1 - true[k]), pred))):
                _compare_other_rows(base, _probe_values(unreduced, *changed), k, name)
    except ValueError as error:
        if "`loss`" in str(error):
            raise
        raise _probe_failed(error, true, pred) from error
    except (TypeError, tf.errors.OpError) as error:
        raise _probe_failed(error, true, pred) from error


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
            f"({float(base[j]):.7g} -> {float(changed[j]):.7g}). Each example's loss must depend on that example "
            f"alone (no batch statistics, pairwise terms or batch reductions), or per-example clipping does not "
            f"bound it. {FIX}"
        )


def _probe_failed(error: Exception, true: np.ndarray, pred: np.ndarray) -> ValueError:
    return ValueError(
        f"tf_dp could not check that `loss` is computed per example: it failed on a probe batch "
        f"(y_true shape {list(true.shape)}, y_pred shape {list(pred.shape)}): {type(error).__name__}: {error}. "
        f"{FIX}"
    )
