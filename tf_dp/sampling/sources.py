"""Example sources for Poisson sampling: only the sampled examples are ever read.

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

import collections
import concurrent.futures
import copy
import os
import struct
import threading
import warnings
from typing import Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_dp.sampling.dataset_graph import (ALLOWED_PER_EXAMPLE, grain_duplicating_idioms, is_grain_dataset,
                                         refused_operations)

MARKER = "tf_dp source error"


class SourceError(ValueError):
    """A record that could not be read or does not match the source's example spec.

    Args:
      message: what went wrong (prefixed with the source-error marker).
    """

    def __init__(self, message: str):
        super().__init__(f"{MARKER}: {message}")


def _why(error: Exception) -> str:
    """One line saying why a record failed: a SourceError's own message, else the error's type and first line."""
    message = str(error).splitlines()[0] if str(error) else ""
    if isinstance(error, SourceError):
        return message[len(MARKER) + 2:] if message.startswith(MARKER) else message
    return f"{type(error).__name__}: {message}"


class UnreadableLog:
    """Records that failed to read or parse during training, kept in host memory only: a count
    per (ledger step, replica slot) that read them, and the first few (index, error) seen.
    Nothing here is logged per step: fit reports ``total(below_step)`` after training, so the
    count never tells WHEN a record was sampled (docs/algorithms.md §7, unreadable records)."""

    NAMED = 3  # distinct bad records named (index and error) in the report

    def __init__(self):
        self._lock = threading.Lock()
        self._counts: dict = {}
        self._named: dict = {}

    def __getstate__(self):  # picklable with its source (a lock is not)
        with self._lock:
            return {"_counts": dict(self._counts), "_named": dict(self._named)}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self._counts.clear()
            self._named.clear()

    def note(self, index: int, error: Exception) -> None:
        """The record ``index`` failed with ``error`` (kept for the report, a few distinct ones)."""
        with self._lock:
            if len(self._named) < self.NAMED:
                self._named.setdefault(int(index), _why(error))

    def record(self, step, slot, count) -> np.int64:
        """Step ``step``'s read for replica slot ``slot`` found ``count`` unreadable records (a
        re-read of the same step, after a rollback, replaces its count)."""
        with self._lock:
            self._counts[(int(step), int(slot))] = int(count)
        return np.int64(count)

    def total(self, below_step: Optional[int] = None) -> int:
        """Unreadable records of the steps below ``below_step`` (all recorded steps if None):
        steps the pipeline read ahead but never trained are left out."""
        with self._lock:
            return sum(count for (step, _), count in self._counts.items()
                       if below_step is None or step < below_step)

    def named(self) -> dict:
        """{index: error} of the first few distinct unreadable records."""
        with self._lock:
            return dict(self._named)


# ----------------------------------------------------------------------------- specs
def is_string_array(array: np.ndarray) -> bool:
    """Whether ``array`` holds text: numpy str/bytes dtypes, or objects that are all str or
    bytes (a column of Python strings is strings, not ragged rows)."""
    if array.dtype.kind in "US":
        return True
    return array.dtype == object and array.size > 0 and all(isinstance(v, (str, bytes)) for v in array.reshape(-1))


def as_tf_strings(array: np.ndarray) -> np.ndarray:
    """A string array as tf.string holds it: an object array of bytes (str encoded as UTF-8,
    as TensorFlow converts it; bytes kept exactly, trailing NUL bytes included)."""
    array = np.asarray(array)
    out = np.empty(array.shape, object)
    out.reshape(-1)[:] = [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in array.reshape(-1)]
    return out


def column_dtype(column) -> tf.DType:
    """The tf dtype of a column's rows: tf.string for object arrays of bytes (as_tf_strings)."""
    return tf.string if column.dtype == object or column.dtype.kind in "US" else tf.as_dtype(column.dtype)


def _leaf_spec(value) -> tf.TensorSpec:
    array = np.asarray(value)
    if is_string_array(array):
        return tf.TensorSpec(array.shape, tf.string)
    if array.dtype == object:
        raise TypeError("records must hold dense fixed-shape arrays, numbers or bytes, not Python objects.")
    return tf.TensorSpec(array.shape, tf.as_dtype(array.dtype))


def describe(spec) -> str:
    """x: float32[28, 28, 1], y: int64[] — for error messages."""
    def one(leaf):
        return f"{leaf.dtype.name}[{', '.join(str(d) for d in leaf.shape)}]"

    x_spec, y_spec = spec
    return f"x: {tf.nest.map_structure(one, x_spec)}, y: {tf.nest.map_structure(one, y_spec)}"


def _is_lazy_array(value) -> bool:
    """An array-like read by row on demand (numpy.memmap, h5py.Dataset, zarr), not converted whole."""
    if isinstance(value, np.memmap):
        return True
    if isinstance(value, (np.ndarray, tf.Tensor, list, tuple, dict)) or hasattr(value, "to_numpy"):
        return False  # in memory already (pandas objects included: converted, never indexed by label)
    return all(hasattr(value, name) for name in ("shape", "dtype", "__getitem__", "__len__"))


def _column(value, name: str):
    if isinstance(value, (tf.RaggedTensor, tf.SparseTensor)):
        raise TypeError(
            f"`{name}` is a {type(value).__name__}; DP training needs dense, fixed-shape examples "
            "(pad sequences, e.g. keras.utils.pad_sequences)."
        )
    if _is_lazy_array(value):
        return value
    array = np.asarray(value)
    if is_string_array(array):  # text (str, bytes, tf.string): fixed-shape rows of tf.string
        return as_tf_strings(array)
    if array.dtype == object:
        raise TypeError(f"`{name}` has ragged/object rows (not all strings); pad them to one shape first "
                        "(e.g. keras.utils.pad_sequences).")
    return array


def input_columns(x, name: str = "x"):
    """fit's ``x`` as a structure of columns, as Keras reads it: a dict of inputs stays a
    dict; a list or tuple whose entries are all arrays (or structures of arrays) is one
    input per entry — a tuple, since tf.data would stack a list into one tensor; anything
    else (an array, a tensor, a list of strings or numbers) is one column."""
    if isinstance(x, dict):
        return {key: input_columns(value, f"{name}[{key!r}]") for key, value in x.items()}
    if _is_structure_of_arrays(x):
        return tuple(input_columns(value, f"{name}[{i}]") for i, value in enumerate(x))
    return _column(x, name)


def _is_structure_of_arrays(value) -> bool:
    if isinstance(value, dict):
        return bool(value) and all(_is_structure_of_arrays(v) or _is_array_column(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return bool(value) and all(_is_structure_of_arrays(v) or _is_array_column(v) for v in value)
    return False


def target_columns(y):
    """y as a structure of columns: a dict of targets, or a list/tuple whose entries are all
    arrays (one per output of a multi-output model), stays a structure; anything else (an
    array, a plain list of labels) is one column."""
    if isinstance(y, dict):
        return {name: _column(value, f"y[{name!r}]") for name, value in y.items()}
    if isinstance(y, (list, tuple)) and y and all(_is_array_column(v) for v in y):
        return tuple(_column(v, f"y[{i}]") for i, v in enumerate(y))  # a tuple: tf.data takes no lists
    return _column(y, "y")


def _is_array_column(value) -> bool:
    return (isinstance(value, (np.ndarray, tf.Tensor)) or _is_lazy_array(value)) and len(np.shape(value)) >= 1


def num_rows(x) -> int:
    """The number of rows of ``x``, an array-like column or a structure of them: the leading
    size of its first leaf, read from ``.shape`` where it has one (a lazy array is not
    loaded), else ``len``."""
    first = tf.nest.flatten(x)[0]
    return int(first.shape[0]) if hasattr(first, "shape") else len(first)


def _take_rows(column, rows: np.ndarray) -> np.ndarray:
    """column[rows] for increasing ``rows``; array-likes that refuse a fancy index are read row by row."""
    if isinstance(column, np.ndarray):
        return column[rows]
    try:
        return np.asarray(column[rows])
    except (TypeError, ValueError, IndexError):
        return np.stack([np.asarray(column[int(i)]) for i in rows]) if len(rows) else \
            np.zeros((0, *column.shape[1:]), column.dtype)


def _scatter(values: np.ndarray, real: np.ndarray, count: int) -> np.ndarray:
    """A [count, ...] array holding ``values`` at the positions ``real`` and zeros (empty
    bytes) elsewhere."""
    if values.dtype == object or values.dtype.kind in "US":  # strings: padding rows are "", never an example
        out = np.full((count, *values.shape[1:]), b"", object)
    else:
        out = np.zeros((count, *values.shape[1:]), values.dtype)
    out[real] = values
    return out


# --------------------------------------------------------------------------- sources
class ExampleSource:
    """N examples, each an (x, y) of a fixed spec, plus per-example ``extras`` arrays
    (e.g. RaCO-DP's group ids) read alongside.

    ``read(indices, mask)`` returns (x, y, extras) as numpy structures [n, ...] with the
    examples at ``indices`` where ``mask`` is 1 and zeros (empty bytes) where it is 0 —
    padding rows are neutral values, never a copy of an example; only the masked-in rows
    are read. ``graph_read`` is the same inside a tf.data pipeline."""

    spec: tuple  # (x spec structure, y spec), tf.TensorSpec per leaf, no batch axis
    extras: dict

    def __len__(self) -> int:
        raise NotImplementedError

    def read_examples(self, rows: np.ndarray):
        """(x, y) numpy structures [len(rows), ...] of the examples ``rows`` (increasing)."""
        raise NotImplementedError

    def read(self, indices: np.ndarray, mask: np.ndarray):
        indices, mask = np.asarray(indices).reshape(-1), np.asarray(mask).reshape(-1)
        real = np.flatnonzero(mask != 0)
        x, y = self.read_examples(indices[real])
        place = lambda values: _scatter(values, real, len(indices))  # noqa: E731
        return tf.nest.map_structure(place, x), tf.nest.map_structure(place, y), self.read_extras(indices, mask)

    def read_extras(self, indices: np.ndarray, mask: np.ndarray) -> dict:
        indices, mask = np.asarray(indices).reshape(-1), np.asarray(mask).reshape(-1)
        real = np.flatnonzero(mask != 0)
        return {name: _scatter(_take_rows(column, indices[real]), real, len(indices))
                for name, column in self.extras.items()}

    def head(self, count: int):
        """(x, y) of the first ``count`` examples (the row-independence guard and the model build read these)."""
        return self.read_examples(np.arange(min(count, len(self))))

    def first(self, count: int) -> "ExampleSource":
        """A copy holding only examples [0, count) (indices unchanged): what
        ``fit(validation_split=...)`` trains on; the rest is never sampled."""
        if not 0 < count <= len(self):
            raise ValueError(f"first({count}) of a source of {len(self)} examples.")
        self.unreadable_log()  # shared with the copy: what the copy's reads meet, fit reports
        source = copy.copy(self)
        source._count = count
        source.extras = {name: column[:count] for name, column in self.extras.items()}
        return source

    def with_extras(self, extras: Optional[dict]) -> "ExampleSource":
        """A copy of this source that also reads the per-example ``extras`` arrays."""
        extras = {name: _column(value, name) for name, value in (extras or {}).items()}
        for name, column in extras.items():
            if num_rows(column) != len(self):
                raise ValueError(f"`{name}` has {num_rows(column)} rows but the source has {len(self)} examples.")
        self.unreadable_log()  # shared with the copy
        source = copy.copy(self)
        source.extras = extras
        return source

    def output_specs(self) -> tuple:
        """(x, y, extras) TensorSpecs without the batch axis."""
        extras = {name: tf.TensorSpec(column.shape[1:], tf.as_dtype(column.dtype))
                  for name, column in self.extras.items()}
        return (*self.spec, extras)

    def graph_read(self, indices: tf.Tensor, mask: tf.Tensor):
        """``read`` inside a graph (a tf.data map function): (x, y, extras) tensors [n, ...]."""
        return self._numpy_graph_read(self.read, indices, mask, self.output_specs())

    def graph_read_tolerant(self, indices: tf.Tensor, mask: tf.Tensor):
        """``graph_read`` for training: (x, y, extras, unreadable), ``unreadable`` a bool [n]
        marking the masked-in rows whose record failed to read or parse; such a row holds the
        padding value and the loader sets its mask to 0 (a zero-weight example, never an
        exception mid-training). Sources whose reads cannot fail (arrays): none is."""
        x, y, extras = self.graph_read(indices, mask)
        return x, y, extras, tf.zeros(tf.shape(mask), tf.bool)

    def unreadable_named(self) -> dict:
        """{index: why} of the first few records that failed to read or parse in training."""
        return self.unreadable_log().named()

    def unreadable_log(self) -> UnreadableLog:
        """This source's record of the unreadable records met during training."""
        log = self.__dict__.get("_unreadable")
        if log is None:
            log = self._unreadable = UnreadableLog()
        return log

    @staticmethod
    def _numpy_graph_read(read: Callable, indices: tf.Tensor, mask: tf.Tensor, specs):
        """``read(indices, mask)`` (numpy structures [n, ...] of ``specs``) run in the graph."""
        flat_specs = tf.nest.flatten(specs)

        @tf.autograph.experimental.do_not_convert
        def run(indices, mask):
            return [np.asarray(v) for v in tf.nest.flatten(read(indices, mask))]

        flat = tf.numpy_function(run, [indices, mask], [s.dtype for s in flat_specs], stateful=False)
        for tensor, spec in zip(flat, flat_specs):
            tensor.set_shape([None, *spec.shape])
        return tf.nest.pack_sequence_as(specs, flat)


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


class RecordSource(ExampleSource):
    """``source[i]`` (or ``transform(source[i])``) is example i as an (x, y) pair.

    Records are fetched with ``source.__getitems__`` when the source has it, else one by
    one; ``transform`` runs on ``workers`` threads (decoders such as PIL and numpy release
    the GIL). The spec is that of example 0; every record read is checked against it.

    Args:
      source: a sequence of records (``__len__`` and ``__getitem__``), e.g. a list of file paths.
      transform: a callable mapping a record to an (x, y) example, or None if records are examples.
      workers: threads that run ``transform`` (default: the CPU count, at most 8).
      spec: the (x, y) TensorSpecs of an example, or None to take them from example 0.

    Raises:
      TypeError: ``source`` is not a sequence or ``transform`` is not callable.
      ValueError: ``source`` is empty.
    """

    def __init__(self, source, transform: Optional[Callable] = None, workers: Optional[int] = None,
                 spec: Optional[tuple] = None):
        if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
            raise TypeError(f"A source needs `__len__` and `__getitem__`, got {type(source).__name__}.")
        if transform is not None and not callable(transform):
            raise TypeError(f"`transform` must be callable, got {transform!r}.")
        refuse_duplicating_source(source)
        self.source, self.transform = source, transform
        # Threads inside one read: decoders and I/O release the GIL. On 2 shared cores 1, 2 and 4
        # threads were within noise (tf.data already overlaps reads of successive steps).
        self.workers = workers or min(8, os.cpu_count() or 1)
        self._count = len(source)
        if self._count <= 0:
            raise ValueError("The source holds no examples.")
        self.extras = {}
        self.spec = None
        if spec is None:
            x, y = self._example(0, self._fetch_one(0))
            spec = (tf.nest.map_structure(_leaf_spec, x), tf.nest.map_structure(_leaf_spec, y))
        self.spec = spec
        self._pool = None

    def __len__(self) -> int:
        return self._count

    def __getstate__(self):  # picklable for multiprocessing (the pool is per process)
        return {**self.__dict__, "_pool": None}

    def _fetch_one(self, index: int):
        try:
            return self.source[index]
        except Exception as error:  # noqa: BLE001 — named and re-raised, never skipped
            raise SourceError(f"reading example {index} of {type(self.source).__name__} failed "
                              f"({type(error).__name__}: {error}); {self._expected()}") from error

    def _fetch_one_or_failure(self, index: int):
        """source[index], or an ``Unreadable`` holding the SourceError."""
        try:
            return self._fetch_one(index)
        except SourceError as error:
            return Unreadable(error)

    def _fetch(self, rows: np.ndarray, tolerant: bool = False) -> list:
        """The records ``rows``; with ``tolerant`` a record that fails is an ``Unreadable``."""
        getitems = getattr(self.source, "__getitems__", None)
        if getitems is not None and len(rows) > 1:
            try:
                records = list(getitems([int(i) for i in rows]))
                if len(records) == len(rows):
                    return records
            except Exception:  # noqa: BLE001 — found and named one by one below
                pass
        fetch_one = self._fetch_one_or_failure if tolerant else self._fetch_one
        return [fetch_one(int(i)) for i in rows]

    def _expected(self) -> str:
        if self.spec is None:
            return "expected an (x, y) pair" + (" from transform(record)" if self.transform else "")
        return f"expected {describe(self.spec)}"

    def _example(self, index: int, record):
        """(x, y) of one record, transformed and checked against the spec."""
        if self.transform is not None:
            try:
                record = self.transform(record)
            except Exception as error:  # noqa: BLE001
                raise SourceError(f"transform failed on example {index} ({type(error).__name__}: {error}); "
                                  f"{self._expected()}") from error
        if not isinstance(record, (tuple, list)) or len(record) != 2:
            raise SourceError(f"example {index} is a {type(record).__name__}, not an (x, y) pair; {self._expected()}"
                              + ("" if self.transform else " (pass transform=... to turn records into (x, y))"))
        x, y = record
        if self.spec is None:
            return x, y
        fast = self._fast_leaves()
        if fast is not None:  # one array x, one label y already of the spec's shape and dtype: no conversion
            (x_shape, x_dtype), (y_shape, y_dtype) = fast
            if getattr(x, "shape", None) == x_shape and getattr(x, "dtype", None) == x_dtype and \
                    getattr(y, "shape", None) == y_shape and getattr(y, "dtype", None) == y_dtype and \
                    isinstance(x, (np.ndarray, np.generic)) and isinstance(y, (np.ndarray, np.generic)):
                return x, y
        try:
            tf.nest.assert_same_structure(self.spec[0], x)
            tf.nest.assert_same_structure(self.spec[1], y)
            leaves = [_conform(v, s) for v, s in zip(tf.nest.flatten(x) + tf.nest.flatten(y),
                                                      tf.nest.flatten(self.spec[0]) + tf.nest.flatten(self.spec[1]))]
        except (ValueError, TypeError) as error:
            got = tuple(tf.nest.map_structure(lambda v: f"{np.asarray(v).dtype}{list(np.shape(v))}", part)
                        for part in (x, y))
            raise SourceError(f"example {index} does not match the source's spec: {describe(self.spec)}; "
                              f"got x: {got[0]}, y: {got[1]}") from error
        count = len(tf.nest.flatten(self.spec[0]))
        return (tf.nest.pack_sequence_as(self.spec[0], leaves[:count]),
                tf.nest.pack_sequence_as(self.spec[1], leaves[count:]))

    def _fast_leaves(self):
        """((shape, numpy dtype) of x, of y) when both are single numeric tensors, else None."""
        if not hasattr(self, "_fast"):
            x_spec, y_spec = self.spec
            numeric = lambda s: isinstance(s, tf.TensorSpec) and s.dtype != tf.string  # noqa: E731
            self._fast = (((tuple(x_spec.shape), np.dtype(x_spec.dtype.as_numpy_dtype)),
                           (tuple(y_spec.shape), np.dtype(y_spec.dtype.as_numpy_dtype)))
                          if numeric(x_spec) and numeric(y_spec) else None)
        return self._fast

    def _example_or_none(self, index: int, record):
        """(x, y) of one record, or None (noted in the log) when it cannot be read or parsed."""
        if isinstance(record, Unreadable):
            self.unreadable_log().note(index, record.error)
            return None
        try:
            return self._example(index, record)
        except SourceError as error:
            self.unreadable_log().note(index, error)
            return None

    def _examples(self, rows: np.ndarray, threads: bool = True, tolerant: bool = False) -> list:
        """(x, y) of each record of ``rows``; with ``tolerant`` None for one that fails."""
        make = self._example_or_none if tolerant else self._example
        fetch_one = self._fetch_one_or_failure if tolerant else self._fetch_one
        batched = hasattr(self.source, "__getitems__")
        if not threads or self.workers <= 1 or len(rows) < 2 * self.workers or (self.transform is None and batched):
            return [make(int(i), r) for i, r in zip(rows, self._fetch(rows, tolerant))]
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix="tf_dp_source")
        parts = np.array_split(np.arange(len(rows)), self.workers)
        if batched:  # one batched read (TFDS, ArrayRecord), then the transform on the threads
            records = self._fetch(rows, tolerant)
            work = lambda part: [make(int(rows[j]), records[j]) for j in part]  # noqa: E731
        else:  # each thread reads its records too (a grain MapDataset runs its map functions in source[i])
            work = lambda part: [make(int(rows[j]), fetch_one(int(rows[j]))) for j in part]  # noqa: E731
        return [example for done in self._pool.map(work, parts) for example in done]

    def head(self, count: int):
        """The first examples, read in the calling thread (the guard's and the build's rows)."""
        return self.read_examples(np.arange(min(count, len(self))), threads=False)

    def read_tolerant(self, indices: np.ndarray, mask: np.ndarray):
        """``read`` for training: (x, y, extras, unreadable) — a masked-in record that fails to
        read or parse gets the padding row (zeros, empty bytes) and ``unreadable`` True."""
        indices, mask = np.asarray(indices).reshape(-1), np.asarray(mask).reshape(-1)
        real = np.flatnonzero(mask != 0)
        examples = self._examples(indices[real].astype(np.int64), tolerant=True)
        failed = np.asarray([example is None for example in examples], bool)
        padding = self._padding_example()
        x, y = self._stacked([padding if example is None else example for example in examples], len(real))
        unreadable = np.zeros(len(indices), bool)
        unreadable[real[failed]] = True
        place = lambda values: _scatter(values, real, len(indices))  # noqa: E731
        return (tf.nest.map_structure(place, x), tf.nest.map_structure(place, y), self.read_extras(indices, mask),
                unreadable)

    def graph_read_tolerant(self, indices: tf.Tensor, mask: tf.Tensor):
        specs = (*self.output_specs(), tf.TensorSpec([], tf.bool))
        return self._numpy_graph_read(self.read_tolerant, indices, mask, specs)

    def _padding_example(self):
        """The padding row's (x, y): zeros of the spec, empty bytes for strings."""
        def zeros(spec):
            if spec.dtype == tf.string:
                return np.full(spec.shape, b"", object) if spec.shape.rank else b""
            return np.zeros(spec.shape, spec.dtype.as_numpy_dtype)

        return tf.nest.map_structure(zeros, self.spec[0]), tf.nest.map_structure(zeros, self.spec[1])

    def read_examples(self, rows, threads: bool = True):
        rows = np.asarray(rows, np.int64)
        return self._stacked(self._examples(rows, threads), len(rows))

    def _stacked(self, examples: list, count: int):
        """(x, y) numpy structures [count, ...] stacking ``examples``' (x, y) pairs."""
        x_spec, y_spec = self.spec
        if self._fast_leaves() is not None:  # one x array, one y: stacked without a nest walk per example
            if not examples:
                return (np.empty((0, *x_spec.shape), x_spec.dtype.as_numpy_dtype),
                        np.empty((0, *y_spec.shape), y_spec.dtype.as_numpy_dtype))
            return np.stack([e[0] for e in examples]), np.stack([e[1] for e in examples])
        x_leaves = [np.empty((count, *s.shape), s.dtype.as_numpy_dtype) for s in tf.nest.flatten(x_spec)]
        y_leaves = [np.empty((count, *s.shape), s.dtype.as_numpy_dtype) for s in tf.nest.flatten(y_spec)]
        for j, (x_j, y_j) in enumerate(examples):
            for leaf, value in zip(x_leaves + y_leaves, tf.nest.flatten(x_j) + tf.nest.flatten(y_j)):
                leaf[j] = value
        return tf.nest.pack_sequence_as(x_spec, x_leaves), tf.nest.pack_sequence_as(y_spec, y_leaves)


class Unreadable:
    """A record that could not be fetched: the SourceError saying why."""

    def __init__(self, error: SourceError):
        self.error = error


def refuse_duplicating_source(source) -> None:
    """Raises ValueError if a grain MapDataset repeats records (a repeat, a concatenate/mix
    of the same source, more elements than distinct records): len(source) would count one
    person several times in N. Other collections are taken at their word: record i must
    be a different example for every i."""
    idioms = grain_duplicating_idioms(source) if is_grain_dataset(source) else []
    if idioms:
        raise ValueError(
            f"This source repeats its records ({'; '.join(idioms)}): each copy would count as an example, so N and "
            "the sampling rate q would be wrong and one person would be sampled as several. Pass the source without "
            ".repeat() or self-concatenation, each record once; fit's `epochs` repeats the data.")


def _conform(value, spec: tf.TensorSpec) -> np.ndarray:
    array = np.asarray(value)
    if tuple(array.shape) != tuple(spec.shape):
        raise ValueError("shape")
    if spec.dtype == tf.string:  # text of any length, as bytes
        if not (is_string_array(array) or (array.dtype == object and array.size == 0)):
            raise TypeError("dtype")
        array = as_tf_strings(array)
        return array if array.ndim else array.item()
    want = np.dtype(spec.dtype.as_numpy_dtype)
    if array.dtype != want:
        if not np.can_cast(array.dtype, want, "same_kind"):
            raise TypeError("dtype")
        array = array.astype(want)
    return array


PARSE_PROBE = 8  # records SerializedSource's per-example check parses together and one by one


def _same_row(alone: np.ndarray, together: np.ndarray) -> bool:
    """Equal up to float rounding (a batched kernel may sum in another order); all else exactly."""
    if alone.shape != together.shape:
        return False
    if alone.dtype.kind == "f":
        return bool(np.allclose(alone, together, rtol=1e-5, atol=1e-6, equal_nan=True))
    return bool(np.array_equal(alone, together))


class SerializedSource(ExampleSource):
    """Records are serialized bytes (an ArrayRecord reader, ``TFRecordSource``, the
    ``data_source`` inside a ``tfds.data_source``) and ``parse(serialized) -> (x, y)``
    turns a BATCH of them ([n] strings → [n, ...] tensors) into examples with TensorFlow
    ops (``tf.io.parse_example``, ``tf.io.decode_raw``, ...): per step one Python call
    fetches the sampled records and runs ``parse``'s traced graph once on all of them,
    vectorized — no Python per record (TFDS' own per-record decoding costs ~40 µs a record,
    more than an MNIST DP step's share of the time). Only when that parse fails is each record
    parsed alone, and the failing one trains as a zero-weight example (``read_tolerant``)."""

    def __init__(self, records, parse: Callable):
        if not (hasattr(records, "__len__") and hasattr(records, "__getitem__")):
            raise TypeError(f"A source needs `__len__` and `__getitem__`, got {type(records).__name__}.")
        record_spec = (tf.TensorSpec([], tf.string), tf.TensorSpec([], tf.int8))
        self.records, self.parse = RecordSource(records, spec=record_spec), parse
        self._count = len(records)
        self.extras = {}
        self._recent = collections.deque(maxlen=16)
        # Eager reads (the guard's head rows, diagnose, the loader's) run one graph of parse.
        self._parse_function = tf.function(parse, autograph=False, reduce_retracing=True)
        # The loader's reads call this concrete function once per step (no retracing check).
        self._parse_batch = self._parse_function.get_concrete_function(tf.TensorSpec([None], tf.string))
        outputs = self._parse_batch.structured_outputs
        if not isinstance(outputs, (tuple, list)) or len(outputs) != 2:
            raise ValueError("`parse(serialized)` must return an (x, y) pair of batched tensors.")
        self.spec = tuple(tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape[1:], t.dtype), tuple(outputs)))
        for leaf in tf.nest.flatten(self.spec):
            if not leaf.shape.is_fully_defined():
                raise ValueError(f"`parse` must give examples of a static shape, got {leaf.shape}.")

    def __len__(self) -> int:
        return self._count

    def _serialized(self, rows: np.ndarray) -> np.ndarray:
        self._recent.append(np.array(rows, np.int64))  # for naming a record the graph parse fails on
        values = self.records._fetch(np.asarray(rows, np.int64))
        for index, value in zip(rows, values):
            if not isinstance(value, bytes):
                raise SourceError(f"example {int(index)} is a {type(value).__name__}, not serialized bytes")
        out = np.empty(len(values), object)
        out[:] = values
        return out

    def _serialized_tolerant(self, rows: np.ndarray):
        """(serialized [n], fetched [n] bool): a record that fails to read, or is not bytes, is
        b"" with fetched False (noted in the log)."""
        self._recent.append(np.array(rows, np.int64))
        values = self.records._fetch(np.asarray(rows, np.int64), tolerant=True)
        out, fetched = np.empty(len(values), object), np.ones(len(values), bool)
        for j, (index, value) in enumerate(zip(rows, values)):
            if isinstance(value, Unreadable) or not isinstance(value, bytes):
                error = value.error if isinstance(value, Unreadable) else \
                    SourceError(f"example {int(index)} is a {type(value).__name__}, not serialized bytes")
                self.unreadable_log().note(int(index), error)
                value, fetched[j] = b"", False
            out[j] = value
        return out, fetched

    def _parse(self, serialized, first_index=None):
        try:
            return self._parse_function(serialized)
        except (tf.errors.OpError, ValueError) as error:
            raise SourceError(f"parse failed on the records of examples starting at {first_index} "
                              f"({type(error).__name__}: {error}); expected {describe(self.spec)}") from error

    def head(self, count: int):
        """The first examples (what fit's guard and build read), after checking on the first
        ``PARSE_PROBE`` records that ``parse`` treats each record on its own."""
        self.check_parse_per_example(min(count, PARSE_PROBE))
        return super().head(count)

    def check_parse_per_example(self, count: int = PARSE_PROBE) -> None:
        """Raises ValueError unless parse(records) equals the stack of parse([record]) over the
        first ``count`` records. A parse that computes across the batch (standardizing by the
        batch's mean and spread, say) lets one record move every row: the row guard sees only
        parsed rows, and the clipped gradients of the others carry that record too."""
        rows = np.arange(min(count, len(self)))
        if len(rows) < 2:
            return
        serialized = tf.constant(self._serialized(rows), tf.string)
        together = tf.nest.flatten(self._parse(serialized, 0))
        for i in rows:
            alone = tf.nest.flatten(self._parse(serialized[i:i + 1], int(i)))
            if not all(_same_row(np.asarray(a)[0], np.asarray(t)[i]) for a, t in zip(alone, together)):
                name = getattr(self.parse, "__qualname__", repr(self.parse))
                raise ValueError(
                    f"The parse function `{name}` of this SerializedSource does not treat each record on its own: "
                    f"parsing records 0..{len(rows) - 1} together gives another example {int(i)} than parsing record "
                    f"{int(i)} alone. It computes across the batch (e.g. standardizes by the batch's mean or spread), "
                    "so one person's record would move every example of the batch (sensitivity above C). Make parse "
                    "per example (normalize with fixed constants, not batch statistics), or map it over single "
                    "records (tf.map_fn); randomness belongs in fit(augment=...).")

    def read_examples(self, rows):
        rows = np.asarray(rows, np.int64)
        if not len(rows):
            empty = lambda s: np.zeros((0, *s.shape), s.dtype.as_numpy_dtype)  # noqa: E731
            return tf.nest.map_structure(empty, self.spec[0]), tf.nest.map_structure(empty, self.spec[1])
        x, y = self._parse(tf.constant(self._serialized(rows), tf.string), int(rows[0]))
        return tf.nest.map_structure(np.asarray, x), tf.nest.map_structure(np.asarray, y)

    def diagnose(self) -> Optional[SourceError]:
        """After the graph parse failed on some batch: parse the recently fetched records one
        by one (eagerly) and name the first that fails, with the expected spec."""
        for rows in reversed(list(self._recent)):
            for index in rows:
                error = self.parse_error(int(index))
                if error is not None:
                    return error
        return None

    def parse_error(self, index: int) -> Optional[SourceError]:
        """The SourceError of fetching and parsing record ``index`` alone (eagerly), or None."""
        try:
            serialized = self._serialized([index])
            x, y = self._parse_function(tf.constant(serialized, tf.string))
            for leaf, spec in zip(tf.nest.flatten((x, y)), tf.nest.flatten(self.spec)):
                if tuple(leaf.shape[1:]) != tuple(spec.shape) or leaf.dtype != spec.dtype:
                    raise ValueError(f"parsed as {leaf.dtype.name}{list(leaf.shape[1:])}")
        except SourceError as error:
            return error
        except Exception as error:  # noqa: BLE001 — named below
            return SourceError(f"parsing example {index} failed ({type(error).__name__}: "
                               f"{str(error).splitlines()[0] if str(error) else ''}); "
                               f"expected {describe(self.spec)}")
        return None

    def graph_read(self, indices, mask):
        real = tf.reshape(tf.where(mask > 0), [-1])
        rows = tf.gather(indices, real)
        fetch = tf.autograph.experimental.do_not_convert(lambda r: self._serialized(r))
        serialized = tf.numpy_function(fetch, [rows], tf.string, stateful=False)
        serialized.set_shape([None])
        x, y = self.parse(serialized)
        is_real = mask > 0
        slot_of = tf.maximum(tf.cumsum(tf.cast(is_real, tf.int32)) - 1, 0)  # slot → its row among the real ones

        def place(values):  # real rows at their slots, zeros in padding slots
            spread = tf.gather(values, slot_of)
            shape = tf.concat([tf.shape(is_real), tf.ones([values.shape.rank - 1], tf.int32)], 0)
            return tf.where(tf.reshape(is_real, shape), spread, tf.zeros_like(spread))

        extras = {}
        if self.extras:
            specs, names = self.output_specs()[2], sorted(self.extras)
            read = tf.autograph.experimental.do_not_convert(lambda i, m: [self.read_extras(i, m)[n] for n in names])
            flat = tf.numpy_function(read, [indices, mask], [specs[n].dtype for n in names], stateful=False)
            extras = {n: tf.ensure_shape(t, [None, *specs[n].shape]) for n, t in zip(names, flat)}
        return tf.nest.map_structure(place, x), tf.nest.map_structure(place, y), extras


    def read_tolerant(self, indices: np.ndarray, mask: np.ndarray):
        """``read`` for training: (x, y, extras, unreadable). The sampled records are parsed
        together (one vectorized call of ``parse``); only when that fails is each parsed alone,
        and a record that fails to fetch or parse gets the padding row (zeros) and
        ``unreadable`` True, named in the log with the error."""
        indices, mask = np.asarray(indices).reshape(-1), np.asarray(mask).reshape(-1)
        real = np.flatnonzero(mask != 0)
        rows = indices[real].astype(np.int64)
        serialized, fetched = self._serialized_tolerant(rows)
        groups = self._parsed_groups(serialized, rows, np.flatnonzero(fetched))
        if len(groups) == 1 and len(groups[0][0]) == len(rows) and groups[0][1] is not None:
            leaves, parsed = groups[0][1], np.ones(len(rows), bool)  # all read and parsed: no copy
        else:
            leaves = [_padding_rows(spec, len(rows)) for spec in tf.nest.flatten(self.spec)]
            parsed = np.zeros(len(rows), bool)
            for group, values in groups:
                if values is not None:
                    for leaf, value in zip(leaves, values):
                        leaf[group] = value
                    parsed[group] = True
        unreadable = np.zeros(len(indices), bool)
        unreadable[real[~parsed]] = True
        if len(real) < len(indices):  # padding slots: zeros
            leaves = [_scatter(leaf, real, len(indices)) for leaf in leaves]
        x, y = tf.nest.pack_sequence_as(self.spec, leaves)
        return x, y, self.read_extras(indices, mask), unreadable

    def graph_read_tolerant(self, indices, mask):
        specs = (*self.output_specs(), tf.TensorSpec([], tf.bool))
        return self._numpy_graph_read(self.read_tolerant, indices, mask, specs)

    def _parsed_groups(self, serialized: np.ndarray, rows: np.ndarray, good: np.ndarray) -> list:
        """(positions, parsed leaves or None) pairs covering ``good``: all parsed together when
        that succeeds (the usual case), else each half on its own, down to the failing records
        (about 2·log2(n) parses for one bad record among n, not n)."""
        if not len(good):
            return []
        together = self._parsed_leaves(serialized[good], rows[good])
        if together is not None or len(good) == 1:
            return [(good, together)]
        half = len(good) // 2
        return (self._parsed_groups(serialized, rows, good[:half])
                + self._parsed_groups(serialized, rows, good[half:]))

    def _parsed_leaves(self, serialized: np.ndarray, rows: np.ndarray) -> Optional[list]:
        """The flat (x, y) leaves of ``parse(serialized)`` as numpy arrays, checked against the
        spec; None if it fails (a single record's failure is noted in the log)."""
        try:
            # Eagerly, op by op: a traced graph's arithmetic rewrites (x / 255 → x · (1/255)) would
            # round differently from the parse the user wrote and tested.
            flat = [np.asarray(t) for t in tf.nest.flatten(tuple(self.parse(tf.constant(serialized, tf.string))))]
            for leaf, spec in zip(flat, tf.nest.flatten(self.spec)):
                if leaf.shape != (len(rows), *spec.shape) or tf.as_dtype(leaf.dtype) != spec.dtype:
                    raise ValueError(f"parsed as {tf.as_dtype(leaf.dtype).name}{list(leaf.shape[1:])}")
            return flat
        except (tf.errors.OpError, ValueError, TypeError) as error:
            if len(rows) == 1:
                self.unreadable_log().note(int(rows[0]), SourceError(
                    f"parsing example {int(rows[0])} failed ({_why(error)}); expected {describe(self.spec)}"))
            return None


def _padding_rows(spec: tf.TensorSpec, count: int) -> np.ndarray:
    """``count`` padding rows of ``spec``: zeros, or empty bytes for strings."""
    if spec.dtype == tf.string:
        return np.full((count, *spec.shape), b"", object)
    return np.zeros((count, *spec.shape), spec.dtype.as_numpy_dtype)


class DatasetSource(ExampleSource):
    """An unbatched, finite ``tf.data.Dataset`` with random access
    (``tf.data.experimental.at``): example i is computed on demand, in the graph.

    Args:
      dataset: the unbatched, finite dataset of (x, y) pairs.
      count: its number of examples.
    """

    def __init__(self, dataset: tf.data.Dataset, count: int):
        self.dataset, self._count = dataset, count
        spec = dataset.element_spec
        self.spec = (spec[0], spec[1])
        self.extras = {}

    def __len__(self) -> int:
        return self._count

    def read_examples(self, rows):
        examples = [tf.data.experimental.at(self.dataset, int(i)) for i in rows]
        def stack(*leaves):  # string leaves as object arrays of bytes (numpy would pad them to one width)
            rows = np.stack([np.asarray(v) for v in leaves])
            return as_tf_strings(rows) if rows.dtype.kind in "SUO" else rows

        if not examples:
            empty = lambda s: np.zeros((0, *s.shape), s.dtype.as_numpy_dtype)  # noqa: E731
            return tf.nest.map_structure(empty, self.spec[0]), tf.nest.map_structure(empty, self.spec[1])
        return (tf.nest.map_structure(stack, *[e[0] for e in examples]),
                tf.nest.map_structure(stack, *[e[1] for e in examples]))

    def graph_read(self, indices, mask):
        real = tf.cast(mask > 0, tf.bool)
        rows = tf.where(real, indices, 0)
        dataset = self.dataset

        def one(index):
            return tf.data.experimental.at(dataset, index)

        x, y = tf.map_fn(one, rows, fn_output_signature=self.spec, parallel_iterations=16)

        def zero_padding(values):
            shape = tf.concat([tf.shape(real), tf.ones([values.shape.rank - 1], tf.int32)], axis=0)
            return tf.where(tf.reshape(real, shape), values, tf.zeros_like(values))

        return tf.nest.map_structure(zero_padding, x), tf.nest.map_structure(zero_padding, y), graph_extras(
            self, indices, mask)


    def graph_read_tolerant(self, indices, mask):
        """``graph_read`` for training, in the graph: (x, y, extras, unreadable). The masked-in
        rows are read through a dataset with ``ignore_errors``, so a record whose map raises is
        skipped: its row holds zeros and ``unreadable`` marks it (a zero-weight example, never
        an exception mid-training); its index is noted in the log on the host. A dataset whose
        element shapes are not fully defined (variable-length audio) has no padding row to
        stand in for a failed record: it is read as before, and a record that fails raises."""
        if not all(leaf.shape.is_fully_defined() for leaf in tf.nest.flatten(self.spec)):
            return super().graph_read_tolerant(indices, mask)  # no padding row to stand in (variable shapes)
        count = tf.shape(indices, out_type=tf.int64)[0]
        whole = tf.data.Dataset.from_tensors(indices).map(lambda rows: (True, self.graph_read(rows, mask)[:2]))
        padding = _zeros_of(self.spec, leading=[count])
        read_all, (x, y) = whole.ignore_errors().concatenate(tf.data.Dataset.from_tensors((False, padding))) \
            .take(1).get_single_element()  # the usual case: every record read, in one pass

        def per_record():
            return self._read_each(indices, mask)

        def all_read():
            return x, y, tf.zeros(tf.shape(indices), tf.bool)

        x, y, unreadable = tf.cond(read_all, all_read, per_record)
        return x, y, graph_extras(self, indices, mask), unreadable

    def _read_each(self, indices, mask):
        """(x, y, unreadable) read record by record, a record whose map raises left as zeros."""
        real = tf.cast(mask > 0, tf.bool)
        count = tf.shape(indices, out_type=tf.int64)[0]
        dataset = self.dataset
        slots = tf.data.Dataset.range(count).filter(lambda j: tf.gather(real, j))
        read = slots.map(lambda j: (j, tf.data.experimental.at(dataset, tf.gather(indices, j))),
                         num_parallel_calls=16, deterministic=True).ignore_errors()
        sentinel = tf.data.Dataset.from_tensors((tf.constant(-1, tf.int64), _zeros_of(self.spec)))
        positions, values = read.concatenate(sentinel).batch(count + 1).get_single_element()
        positions, values = positions[:-1], tf.nest.map_structure(lambda v: v[:-1], values)
        found = tf.scatter_nd(positions[:, None], tf.ones_like(positions, tf.bool), [count])
        where = tf.scatter_nd(positions[:, None], tf.range(tf.shape(positions, out_type=tf.int64)[0]), [count])

        def placed(values):
            gathered = tf.gather(values, where)
            shape = tf.concat([tf.shape(found), tf.ones([values.shape.rank - 1], tf.int32)], axis=0)
            return tf.where(tf.reshape(found, shape), gathered, tf.zeros_like(gathered))

        x, y = tf.nest.map_structure(placed, values)
        return x, y, self._noted(indices, real & ~found)

    def _noted(self, indices, unreadable):
        """``unreadable``, after noting the failed records' indices in the log (a host call only
        when there are any)."""
        def note(failed):
            for index in np.asarray(failed).reshape(-1):
                self.unreadable_log().note(int(index), SourceError(
                    f"the dataset's pipeline raised on example {int(index)}"))
            return np.int64(len(failed))

        failed = tf.boolean_mask(indices, unreadable)
        noted = tf.cond(tf.size(failed) > 0,
                        lambda: tf.numpy_function(tf.autograph.experimental.do_not_convert(note), [failed],
                                                  tf.int64, stateful=True),
                        lambda: tf.constant(0, tf.int64))
        with tf.control_dependencies([noted]):
            return tf.identity(unreadable)


def _zeros_of(spec, leading=()):
    """Zeros (empty bytes for strings) of ``spec`` with ``leading`` dimensions first: the
    sentinel of a tolerant read."""
    def zeros(leaf):
        shape = tf.concat([tf.cast(leading, tf.int64), tf.constant(leaf.shape.as_list(), tf.int64)], 0) \
            if len(leading) else leaf.shape
        return tf.fill(shape, "") if leaf.dtype == tf.string else tf.zeros(shape, leaf.dtype)

    return tf.nest.map_structure(zeros, spec)


def graph_extras(source: ExampleSource, indices, mask) -> dict:
    """``source.read_extras`` inside a graph: {name: tensor [n, ...]} (empty without extras)."""
    if not source.extras:
        return {}
    specs = source.output_specs()[2]
    names = sorted(source.extras)
    read = tf.autograph.experimental.do_not_convert(lambda i, m: [source.read_extras(i, m)[n] for n in names])
    flat = tf.numpy_function(read, [indices, mask], [specs[n].dtype for n in names], stateful=False)
    return {n: tf.ensure_shape(t, [None, *specs[n].shape]) for n, t in zip(names, flat)}


# ---------------------------------------------------------------------- TFRecord index
class TFRecordSource:
    """Random access to (uncompressed) TFRecord shards: one sequential pass over the files
    records each record's (shard, byte offset, length) — 16 bytes per record, the records
    themselves are not kept — then ``source[i]`` is one seek and read of the serialized
    record (bytes). Pair it with a ``transform`` that parses it, e.g.
    ``lambda b: parse(tf.train.Example.FromString(b))``.

    The honest alternative for shards that cannot be indexed (compressed files, streams):
    ``fit(dataset.batch(L))``, trained as fixed batches and accounted WITHOUT sampling
    amplification (a much larger ε; fit warns).

    Args:
      files: one path or a sequence of paths of uncompressed TFRecord shards.
      verify_crc: accepted for compatibility; this version does not check the records' CRCs.

    Raises:
      ValueError: no file is given.
    """

    def __init__(self, files: Sequence[str], verify_crc: bool = False):
        self.files = [os.fspath(f) for f in ([files] if isinstance(files, (str, os.PathLike)) else files)]
        if not self.files:
            raise ValueError("TFRecordSource needs at least one file.")
        shards, offsets, lengths = [], [], []
        for shard, path in enumerate(self.files):
            for offset, length in _scan_tfrecord(path):
                shards.append(shard)
                offsets.append(offset)
                lengths.append(length)
        self.shard = np.asarray(shards, np.int32)
        self.offset = np.asarray(offsets, np.int64)
        self.length = np.asarray(lengths, np.int32)
        self._handles: dict = {}

    def __len__(self) -> int:
        return len(self.offset)

    def __getstate__(self):
        return {**self.__dict__, "_handles": {}}

    def __getitem__(self, index):
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"record {index} out of range [0, {len(self)})")
        shard = int(self.shard[index])
        import threading
        key = (shard, threading.get_ident())  # one handle per thread: seek + read are not atomic
        handle = self._handles.get(key)
        if handle is None:
            handle = self._handles[key] = open(self.files[shard], "rb")
        handle.seek(int(self.offset[index]))
        data = handle.read(int(self.length[index]))
        if len(data) != int(self.length[index]):
            raise IOError(f"{self.files[shard]} is truncated at record {index}")
        return data


def _scan_tfrecord(path: str):
    """(offset of the data, length) of every record of an uncompressed TFRecord file:
    uint64 length, uint32 masked CRC of the length, data, uint32 masked CRC of the data."""
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        position = 0
        while position < size:
            header = handle.read(12)
            if len(header) < 12:
                raise ValueError(f"{path} is not an uncompressed TFRecord file (truncated header at byte {position}); "
                                 "compressed shards cannot be indexed: train on them as fixed batches.")
            (length,) = struct.unpack("<Q", header[:8])
            if position + 16 + length > size:
                raise ValueError(f"{path} is not an uncompressed TFRecord file (record at byte {position} runs past "
                                 "the end); compressed shards cannot be indexed: train on them as fixed batches.")
            yield position + 12, length
            position += 16 + length
            handle.seek(position)


# ------------------------------------------------------------------ choosing a source
def is_record_source(x, y, transform) -> bool:
    """Whether fit's ``x`` is a random-access source of records (rather than arrays)."""
    if isinstance(x, ExampleSource):
        return True
    if y is not None or x is None or isinstance(x, (tf.data.Dataset, tf.Tensor, np.ndarray, dict)):
        return False
    if transform is not None:
        return hasattr(x, "__len__") and hasattr(x, "__getitem__")
    if isinstance(x, (list, tuple)) or _is_lazy_array(x):
        return False
    return hasattr(x, "__len__") and hasattr(x, "__getitem__")


NO_TARGETS = ()  # the y of examples without targets: a structure with no leaves, which tf.data carries


def no_targets_as_none(y):
    """None for ``NO_TARGETS`` (what a model reads as "no y", as Keras' ``fit(x)``), else y.

    Args:
      y: the targets of a batch or of examples read from a source.

    Returns:
      y, or None.
    """
    return None if isinstance(y, tuple) and not y else y


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


class PairedRecords:
    """Record i = (x[i], y[i]): e.g. file paths and their labels, for a ``transform``
    that loads the file — ``fit(paths, labels, transform=lambda r: (decode(r[0]), r[1]))``."""

    def __init__(self, x, y):
        if len(x) != len(y):
            raise ValueError(f"`x` and `y` must have the same number of rows, got {len(x)} and {len(y)}.")
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


def dataset_source(dataset: tf.data.Dataset) -> ExampleSource:
    """An unbatched dataset of (x, y) as a source, once the door's allow-list accepts its
    pipeline (tf_dp.sampling.dataset_graph.refused_operations; anything else is refused naming
    the operation), in this order of preference:

    1. ``from_tensor_slices((x, y))``: its tensors, read as arrays (nothing copied);
    2. a finite dataset with random access (``tf.data.experimental.at``): read on demand;
    3. otherwise it is materialized — with a warning giving its size."""
    spec = dataset.element_spec
    if not isinstance(spec, tuple) or len(spec) != 2:
        raise ValueError("A dataset given to DP fit must yield (x, y) pairs of single examples.")
    refused = refused_operations(dataset, batched=False)
    if refused:
        raise ValueError(
            f"fit() samples examples from a tf.data pipeline only if every operation in it provably keeps one "
            f"element per example ({ALLOWED_PER_EXAMPLE}); this one has {'; '.join(refused)}, which can present "
            "one example several times (every copy would count in N and be sampled on its own) or mix examples "
            "into one element. Fix: do that work per example (a map, or augmentation inside the model or with "
            "fit's `augment=`), or pass the data as arrays (fit(x, y, batch_size=L)) or a random-access source, "
            "each example once and without repeat(); fit's `epochs` repeats the data.")
    tensors = getattr(dataset, "_tensors", None)
    if type(dataset).__name__ == "_TensorSliceDataset" and tensors is not None:
        flat = [np.asarray(t) for t in tensors]
        x, y = tf.nest.pack_sequence_as(spec, flat)
        return ArraySource(x, y)
    count = int(dataset.cardinality())
    if count > 0:
        try:
            tf.data.experimental.at(dataset, 0)
            return DatasetSource(dataset, count)
        except (tf.errors.UnimplementedError, tf.errors.InvalidArgumentError, tf.errors.FailedPreconditionError,
                NotImplementedError):  # e.g. a repeat() inside (timeseries_dataset_from_array's): no random access
            pass
    return materialized_source(dataset)


def materialized_source(dataset: tf.data.Dataset) -> ArraySource:
    parts_x, parts_y = [], []
    for x, y in dataset.batch(4096).as_numpy_iterator():
        parts_x.append(x)
        parts_y.append(y)
    if not parts_y:
        raise ValueError("A dataset given to DP fit must yield (x, y) pairs of single examples; it yielded none.")
    x = tf.nest.map_structure(lambda *parts: np.concatenate(parts), *parts_x)
    y = tf.nest.map_structure(lambda *parts: np.concatenate(parts), *parts_y)
    size = sum(a.nbytes for a in tf.nest.flatten(x) + tf.nest.flatten(y))
    warnings.warn(
        f"tf_dp: this tf.data.Dataset has no random access (it reads sequentially: shuffle, filter, TFRecord "
        f"files, ...), so Poisson sampling needs all of it in memory: materialized "
        f"{len(tf.nest.flatten(y)[0]):,} examples "
        f"({size / 2**20:,.1f} MiB). For data that do not fit, pass a random-access source instead (a "
        "tfds.data_source, an ArrayRecord reader, a numpy.memmap, tf_dp.sampling.TFRecordSource(files) with a "
        "parsing transform), or batch the dataset (fixed batches, accounted without sampling amplification).",
        stacklevel=4,
    )
    return ArraySource(x, y)

