"""``SerializedSource``: serialized records parsed in a batch by one traced ``parse`` per step, with
the per-example check that the batched parse equals parsing each record alone. Re-exported by
``tf_dp.sampling.sources``."""

from __future__ import annotations

import collections
from typing import Callable, Optional

import numpy as np
import tensorflow as tf

from tf_dp.sampling.record_sources import RecordSource
from tf_dp.sampling.source_base import ExampleSource, SourceError, Unreadable, _padding_rows, _scatter, _why, describe

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
