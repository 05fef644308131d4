"""What every example source shares (docs/algorithms.md §1, §7): ``ExampleSource``, ``SourceError``,
the log of unreadable records (``UnreadableLog``), the column helpers that turn fit's ``x``/``y`` into
columns, and the padding a tolerant read places for a record it could not read. Split from
``tf_dp.sampling.sources``, which re-exports every name."""

from __future__ import annotations

import copy
import threading
from typing import Callable, Optional

import numpy as np
import tensorflow as tf

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


class Unreadable:
    """A record that could not be fetched: the SourceError saying why."""

    def __init__(self, error: SourceError):
        self.error = error


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


def _padding_rows(spec: tf.TensorSpec, count: int) -> np.ndarray:
    """``count`` padding rows of ``spec``: zeros, or empty bytes for strings."""
    if spec.dtype == tf.string:
        return np.full((count, *spec.shape), b"", object)
    return np.zeros((count, *spec.shape), spec.dtype.as_numpy_dtype)


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
