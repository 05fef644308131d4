"""``ArraySource``: columns of numpy arrays or lazily indexed array-likes (``numpy.memmap``,
``h5py.Dataset``, zarr), read by fancy indexing in increasing index order. Re-exported by
``tf_dp.sampling.sources``."""

from __future__ import annotations

from typing import Optional

import numpy as np
import tensorflow as tf

from tf_dp.sampling.source_base import ExampleSource, _take_rows, column_dtype, input_columns, num_rows, target_columns


NO_TARGETS = ()  # the y of examples without targets: a structure with no leaves, which tf.data carries


def no_targets_as_none(y):
    """None for ``NO_TARGETS`` (what a model reads as "no y", as Keras' ``fit(x)``), else y.

    Args:
      y: the targets of a batch or of examples read from a source.

    Returns:
      y, or None.
    """
    return None if isinstance(y, tuple) and not y else y


class ArraySource(ExampleSource):
    """Columns ``x`` (an array, or a list/tuple/dict of arrays: one per model input) and
    ``y`` with one row per example. Text columns are held as object arrays of bytes
    (tf.string rows; padding rows of a chunk are b"").

    Args:
      x: the inputs: an array, or a list/tuple/dict of arrays (one per model input).
      y: the targets: an array, or one per output of a multi-output model; None with
        ``targets_optional`` (a model whose own ``compute_loss`` or ``train_step`` reads
        no targets: the examples' y is ``NO_TARGETS``).
      extras: optional per-example arrays by name (e.g. user ids), read with each example.
      targets_optional: accept ``y=None``.

    Raises:
      ValueError: ``x`` or ``y`` is missing, or the columns' row counts differ.
    """

    def __init__(self, x, y, extras: Optional[dict] = None, targets_optional: bool = False):
        if x is None or (y is None and not targets_optional):
            raise ValueError("DP fit needs both `x` and `y`.")
        self.x = input_columns(x)  # fit([x1, x2], y): one column per input, as Keras reads a list
        # One column, or one per output of a multi-output model; NO_TARGETS (no leaves) without y.
        self.y = NO_TARGETS if y is None else target_columns(y)
        sizes = {num_rows(c) for c in tf.nest.flatten(self.x)} | {num_rows(c) for c in tf.nest.flatten(self.y)}
        if len(sizes) != 1:
            raise ValueError(f"`x` and `y` must have the same number of rows, got sizes {sorted(sizes)}.")
        self._count = sizes.pop()
        column_spec = lambda c: tf.TensorSpec(c.shape[1:], column_dtype(c))  # noqa: E731
        self.spec = (tf.nest.map_structure(column_spec, self.x), tf.nest.map_structure(column_spec, self.y))
        self.extras = {}
        if extras:
            self.extras = self.with_extras(extras).extras

    def __len__(self) -> int:
        return self._count

    def read_examples(self, rows):
        take = lambda column: _take_rows(column, rows)  # noqa: E731
        return tf.nest.map_structure(take, self.x), tf.nest.map_structure(take, self.y)

    def in_memory(self) -> bool:
        return all(isinstance(c, np.ndarray) and not isinstance(c, np.memmap)
                   for c in tf.nest.flatten(self.x) + tf.nest.flatten(self.y))
