"""Example sources for Poisson sampling: only the sampled examples are ever read.

The sources live in their own modules (``source_base``, ``array_source``, ``record_sources``,
``serialized_source``, ``dataset_source``); this module chooses one for fit (``example_source``)
and re-exports every name, so ``from tf_dp.sampling.sources import ...`` keeps working.

Poisson sampling (docs/algorithms.md §1) draws INDICES; a source turns the indices of one batch
into rows. Whatever the source, memory grows with the batch, never with the number of
examples N, unless the data were handed over in memory in the first place:

* :class:`ArraySource` — columns: numpy arrays (in memory or ``numpy.memmap``) or
  array-likes with ``shape``/``dtype``/``__getitem__`` (``h5py.Dataset``, zarr); rows are
  read by fancy indexing (in increasing index order, as h5py requires).
* :class:`RecordSource` — any random-access collection: ``len(source)`` and
  ``source[i]`` returning example i as an ``(x, y)`` pair, or as a record that a
  per-example ``transform(record) -> (x, y)`` turns into one (``tfds.data_source(...)``,
  an ArrayRecord reader, a grain ``MapDataset``, a list of file paths with a decode
  function). ``source.__getitems__(indices)`` is used when present (TFDS/grain sources
  read a batch of records in parallel there).
* :class:`DatasetSource` — an unbatched ``tf.data.Dataset`` that supports random access
  (``tf.data.experimental.at``: from_tensor_slices, range, map, take, ...), once the door's
  allow-list (tf_dp.sampling.dataset_graph) accepts its pipeline.
* :class:`TFRecordSource` — TFRecord shards (no random access of their own): one
  sequential pass records every record's byte offset (an index of 16 bytes per record,
  never the records), after which any record is one seek and read away.

A record read before training (the first rows, which fit's guards and the model build read)
that cannot be read, or does not match the source's spec (the shapes and dtypes of the first
example), raises :class:`SourceError` naming the index and the expected spec. During training a
sampled record of a :class:`RecordSource` or :class:`SerializedSource` that fails to read or
parse is a ZERO-WEIGHT example (``graph_read_tolerant``): its row holds the padding value and its
mask is 0, so it contributes nothing (as padding, or a non-finite example) and the sampling the
accountant assumes is unchanged. An exception there would stop every contributor's training at
the first step that sampled the record, telling when it was sampled. The loader counts such
records per step in the source's :class:`UnreadableLog`; fit reports only the total, after
training (``model.unreadable_examples``), like ``nonfinite_examples`` outside ε.
"""

from __future__ import annotations

from typing import Callable, Optional

import tensorflow as tf

# Every source's name, re-exported: imports of tf_dp.sampling.sources keep working.
from tf_dp.sampling.array_source import NO_TARGETS, ArraySource, no_targets_as_none  # noqa: F401
from tf_dp.sampling.dataset_source import DatasetSource, dataset_source, materialized_source  # noqa: F401
from tf_dp.sampling.record_sources import (PairedRecords, RecordSource, TFRecordSource,  # noqa: F401
                                           _scan_tfrecord, is_record_source, refuse_duplicating_source)
from tf_dp.sampling.serialized_source import PARSE_PROBE, SerializedSource, _same_row  # noqa: F401
from tf_dp.sampling.source_base import (MARKER, ExampleSource, SourceError, Unreadable,  # noqa: F401
                                        UnreadableLog, _column, _conform, _is_array_column, _is_lazy_array,
                                        _is_structure_of_arrays, _leaf_spec, _padding_rows, _scatter,
                                        _take_rows, _why, _zeros_of, as_tf_strings, column_dtype, describe,
                                        graph_extras, input_columns, is_string_array, num_rows, target_columns)


def example_source(x, y=None, transform: Optional[Callable] = None,
                   targets_optional: bool = False) -> ExampleSource:
    """The ExampleSource of fit's (x, y): arrays (lazy ones stay lazy), an unbatched dataset
    (random access when it has it, else materialized with a warning), or a record source.

    Args:
      x: arrays (or a dict of them), an unbatched ``tf.data.Dataset``, an ``ExampleSource``,
        or a random-access sequence of records.
      y: the labels, or None (e.g. when ``x`` is a dataset that yields them).
      transform: a function mapping a record to an example, for record sources; None for arrays.
      targets_optional: arrays ``x`` may come without ``y`` (``ArraySource``).

    Returns:
      The ``ExampleSource`` that serves the examples by index.

    Raises:
      ValueError: ``y`` or ``transform`` is passed with an ``x`` that cannot take it.
    """
    if isinstance(x, ExampleSource):
        if transform is not None:
            raise ValueError("Pass `transform` to the source, not to fit, when x is already an ExampleSource.")
        return x
    if isinstance(x, tf.data.Dataset):
        if y is not None:
            raise ValueError("Pass `y` inside the dataset, not as a separate argument.")
        if transform is not None:
            raise ValueError("`transform` applies to random-access sources; map a tf.data.Dataset with .map(...).")
        return dataset_source(x)
    if is_record_source(x, y, transform):
        return RecordSource(x, transform)
    if transform is not None:
        if y is None or isinstance(x, (dict, tf.Tensor)) or not hasattr(x, "__getitem__"):
            raise ValueError("`transform` needs `x` to be a random-access source of records (e.g. a list of file "
                             "paths, with labels in `y`), not arrays.")
        return RecordSource(PairedRecords(x, y), transform)
    return ArraySource(x, y, targets_optional=targets_optional)
