"""Random-access collections of records: ``RecordSource`` (``len`` and ``source[i]``, with an optional
per-example ``transform``; the tolerant read of §7) and ``TFRecordSource`` (TFRecord shards indexed
by one sequential pass), and the test of whether fit's ``x`` is such a source. Re-exported by
``tf_dp.sampling.sources``."""

from __future__ import annotations

import concurrent.futures
import os
import struct
from typing import Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_dp.sampling.dataset_graph import (
    grain_duplicating_idioms,
    is_grain_dataset,
)
from tf_dp.sampling.source_base import (
    ExampleSource,
    SourceError,
    Unreadable,
    _conform,
    _is_lazy_array,
    _leaf_spec,
    _scatter,
    describe,
)


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
