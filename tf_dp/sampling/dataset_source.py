"""``DatasetSource``: an unbatched ``tf.data.Dataset`` read by ``tf.data.experimental.at`` once the
door's allow-list accepts its pipeline (tf_dp.sampling.dataset_graph), and the choice between it and
a materialized ``ArraySource``. Re-exported by ``tf_dp.sampling.sources``."""

from __future__ import annotations

import warnings

import numpy as np
import tensorflow as tf

from tf_dp.sampling.array_source import ArraySource
from tf_dp.sampling.dataset_graph import (
    ALLOWED_PER_EXAMPLE,
    refused_operations,
)
from tf_dp.sampling.source_base import ExampleSource, SourceError, _zeros_of, as_tf_strings, graph_extras


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
