"""A generic guard against layers and losses that mix examples (catches custom layers).

Per-example clipping bounds example i's influence by C only if row i's output and loss
depend on row i alone: f(X)_j = f(X')_j for every j ≠ k whenever X and X' differ only in
row k. ``validate`` refuses the Keras layers known to break this (BatchNormalization,
MixUp, ...); this guard tests the property itself, once per (model, loss), on a few real
examples before the first DP step:

  for each row k of a small batch X (the first ``rows`` examples), X' = X with row k
  replaced by another example: every other row's outputs and losses must be bit-identical.

Randomness: both forward passes run in ``training=True`` mode inside a
``keras.StatelessScope`` that maps every model variable to its current value and every
seed-generator state to a fixed value, so Dropout/RandomFlip/... draw the same per-row
randomness for X and X', and no state (seeds, moving statistics) is updated by the guard.
The comparison is repeated for ``RANDOM_DRAWS`` seed values, so a layer that mixes rows
at random (a MixUp-like permutation that can leave rows in place) is caught too. If the model is still
not reproducible (randomness outside Keras seed generators, e.g. an unseeded tf.random
op), the comparison falls back to ``training=False`` with a warning (a layer mixing rows
only in training would then pass); if even that is not reproducible the guard warns that
it could not check. A training-mode call must also update no non-trainable state (a
running mean of private rows would be released un-noised). Limits: the guard is a test
on ``GUARD_ROWS`` rows, not a proof — a layer that mixes only larger batches passes.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Callable, Optional

import keras
import numpy as np
import tensorflow as tf

from tf_dp.models.losses import without_unused_targets

GUARD_ROWS = 3
DONOR_SEARCH = 64  # examples searched for one that differs from the row it replaces
RANDOM_DRAWS = 4

_checked: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def check_rows_independent(model, per_example_loss: Optional[Callable], x, y=None, rows: int = GUARD_ROWS) -> None:
    """Raises ValueError if changing one example of a small batch changes another example's
    output or loss (see module docstring). ``x, y``: the training arrays (or tensors), or a
    batched tf.data.Dataset of (x, y), whose first batch is used. Runs once per
    (model, per_example_loss)."""
    if per_example_loss in _checked.get(model, ()):
        return
    if isinstance(x, tf.data.Dataset):
        x, y = _first_batch(x)
        y = without_unused_targets(per_example_loss, y)  # (y0, None) for loss=[fn, None]
    x, y = _as_numpy(x), None if y is None else _as_numpy(y)
    count = _num_rows(x)
    if count < 2:
        return
    batch = _take((x, y), np.arange(min(rows, count)))
    if not model.built:
        model(batch[0], training=False)
    _require_no_state_updates(model, batch)
    training = _reproducible_mode(model, per_example_loss, batch)
    if training is False:
        warnings.warn("tf_dp could check only inference mode (training=False) for layers that mix rows: the model's "
                      "training-mode outputs differ between two identical calls even with Keras' random seeds fixed "
                      "(randomness outside keras.random, e.g. tf.random.shuffle). A layer that mixes rows only in "
                      "training (MixUp-like) would not be caught: draw randomness with keras.random and a SeedGenerator.",
                      stacklevel=2)
    if training is None:
        warnings.warn("tf_dp could not check that the model's rows are independent: its outputs differ between two "
                      "identical calls even with Keras' random seeds fixed.", stacklevel=2)
        return
    donors = {k: _donor(x, y, k, count) for k in range(_num_rows(batch[0]))}
    changed_batches = {k: _replace_row(batch, k, _take((x, y), np.array([donor])))
                       for k, donor in donors.items() if donor is not None}
    for draw in range(RANDOM_DRAWS if training else 1):
        _require_rows_unmoved(model, per_example_loss, batch, changed_batches, training, draw)
    _checked.setdefault(model, weakref.WeakSet() if _weakrefable(per_example_loss) else set()).add(per_example_loss)


def _require_rows_unmoved(model, per_example_loss, batch, changed_batches: dict, training: bool, draw: int) -> None:
    """For each k: f(X')_j = f(X)_j for all j ≠ k, X' = ``changed_batches[k]``, same randomness."""
    base = _row_values(model, per_example_loss, batch, training, draw)
    for k, changed in changed_batches.items():
        _require_same_other_rows(base, _row_values(model, per_example_loss, changed, training, draw), k, training)


def _first_batch(dataset: tf.data.Dataset):
    element = next(iter(dataset.take(1)))
    x, y, _ = keras.utils.unpack_x_y_sample_weight(element)
    return x, y


def _as_numpy(structure):
    return tf.nest.map_structure(np.asarray, structure)


def _num_rows(x) -> int:
    return int(np.shape(tf.nest.flatten(x)[0])[0])


def _take(structure, indices: np.ndarray):
    return tf.nest.map_structure(lambda a: None if a is None else a[indices], structure)


def _weakrefable(value) -> bool:
    try:
        weakref.ref(value)
        return True
    except TypeError:
        return False


def _row_values(model, per_example_loss, batch, training: bool, draw: int = 0) -> list[tuple[str, np.ndarray]]:
    """(name, values) of every output leaf and of ℓ, batch axis first, from a forward pass
    under a StatelessScope pinning all model variables to their current values, the seed
    states shifted by ``draw``: identical randomness for equal ``draw``, no state updated."""
    x, y = batch
    with keras.StatelessScope(state_mapping=_pinned_state(model, draw)):
        outputs = model(x, training=training)
        values = [("output", np.asarray(o)) for o in tf.nest.flatten(outputs)]
        if per_example_loss is not None and y is not None:
            targets = tf.nest.map_structure(tf.convert_to_tensor, y)
            values.append(("loss", np.asarray(per_example_loss(targets, outputs))))
    return values


def _require_no_state_updates(model, batch) -> None:
    """Refuses non-trainable variables that a training-mode call updates (running means,
    counters, caches): such state is an exact, un-noised function of the private batches,
    saved with the model and outside ε."""
    seeds = _seed_states(model)
    pinned = _pinned_state(model, 0)
    with keras.StatelessScope(state_mapping=pinned) as scope:
        model(batch[0], training=True)
    updated = [v.path for v, value in pinned
               if id(v) not in seeds and not v.trainable
               and not np.array_equal(np.asarray(scope.get_current_value(v)), np.asarray(value))]
    if updated:
        raise ValueError(
            f"This model updates non-trainable state from the training batch ({', '.join(updated)}): that state is "
            "an exact function of private examples, released with the model without noise. Remove the update (or "
            "make the layer stateless), as for BatchNormalization's moving statistics.")


def _seed_states(model) -> set:
    return {id(generator.state) for layer in model._flatten_layers(include_self=True)
            for generator in getattr(layer, "_seed_generators", [])}


def _pinned_state(model, draw: int) -> list:
    seeds = _seed_states(model)
    return [(v, v.value + tf.cast(draw, v.dtype) if id(v) in seeds else v.value) for v in model.variables]


def _reproducible_mode(model, per_example_loss, batch) -> Optional[bool]:
    """training=True if two identical pinned calls agree bit for bit, else training=False
    if those agree, else None."""
    for training in (True, False):
        first = _row_values(model, per_example_loss, batch, training)
        second = _row_values(model, per_example_loss, batch, training)
        if all(_same(a, b).all() for (_, a), (_, b) in zip(first, second)):
            return training
    return None


def _same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise a == b, NaN equal to NaN."""
    equal = a == b
    if np.issubdtype(a.dtype, np.inexact):
        equal |= np.isnan(a) & np.isnan(b)
    return equal


def _donor(x, y, k: int, count: int) -> Optional[int]:
    """The index of the first example (after the guard's rows, then among them) whose x or
    y differs from example k's; None if every example searched equals it."""
    row = _take((x, y), np.array([k]))
    candidates = [*range(GUARD_ROWS, min(count, GUARD_ROWS + DONOR_SEARCH)), *range(min(GUARD_ROWS, count))]
    for index in candidates:
        other = _take((x, y), np.array([index]))
        leaves = zip(tf.nest.flatten(row), tf.nest.flatten(other))
        if any(a is not None and not np.array_equal(a, b) for a, b in leaves):
            return index
    return None


def _replace_row(batch, k: int, donor):
    def replace(rows, new_row):
        if rows is None:
            return None
        changed = rows.copy()
        changed[k] = new_row[0]
        return changed

    return tf.nest.map_structure(replace, batch, donor)


def _require_same_other_rows(base: list, changed: list, k: int, training: bool) -> None:
    for (what, before), (_, after) in zip(base, changed):
        moved = ~_same(before, after).reshape(len(before), -1).all(axis=1)
        moved[k] = False
        if moved.any():
            raise ValueError(
                f"The model mixes examples: changing example {k} of a batch changed the {what} of example "
                f"{int(np.flatnonzero(moved)[0])} (training={training}). Per-example clipping bounds one example's "
                "influence only if each example's output and loss depend on that example alone. Remove or replace "
                "the layer (or loss) that combines rows of the batch — batch statistics (BatchNormalization → "
                "GroupNormalization/LayerNormalization), x - mean(x, axis=0), MixUp/CutMix, attention or pooling "
                "across the batch axis — or make it act on each example separately."
            )
