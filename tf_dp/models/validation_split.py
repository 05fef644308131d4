"""fit's ``validation_split``, as Keras cuts arrays: the last fraction of the examples validate.

For a random-access source the tail's indices are carved off before sampling, so N is the
training part and a validation index is never sampled.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tf_dp import _checks
from tf_dp.models.data import num_rows
from tf_dp.sampling.sources import ArraySource, no_targets_as_none


def _training_rows(n: int, fraction) -> int:
    """Rows before the validation tail, as Keras cuts arrays: n − round(n · fraction); both parts non-empty."""
    fraction = _checks.in_open_unit_interval("validation_split", fraction)
    cut = n - int(round(n * fraction))
    if not 0 < cut < n:
        raise ValueError(f"validation_split={fraction} of {n} examples leaves {cut} to train on and {n - cut} to "
                         "validate on; both must be at least one.")
    return cut


def keras_array(array):
    """``array`` as Keras' data adapters and symbolic build accept it: a string column (an
    object array of bytes, which Keras has no dtype for) becomes a tf.string tensor.

    Args:
      array: a column of the data.

    Returns:
      The column, a string one as a tf.string tensor.
    """
    if isinstance(array, np.ndarray) and (array.dtype == object or array.dtype.kind in "US"):
        return tf.constant(array, tf.string)
    return array


def carve_validation(source, fraction, sample_weight, validation_batch: int):
    """validation_split as Keras does it: the last ``fraction`` of the examples validate (and
    their sample weights go with them).

    Args:
      source: the example source fit samples from.
      fraction: ``validation_split``.
      sample_weight: the per-example weights, or None.
      validation_batch: the batch size the validation tail is read with.

    Returns:
      (training source, validation data, the training part's weights).
    """
    if isinstance(source, ArraySource):
        (x, y), validation_data = _split_tail(source.x, source.y, fraction)
        y = no_targets_as_none(y)  # fit(x) of a model that reads no targets: x alone validates
        source, validation_data = ArraySource(x, y, targets_optional=y is None), validation_data[:1 + (y is not None)]
    else:  # a source: the tail's indices are carved off before sampling and never sampled
        source, validation_data = _split_source_tail(source, fraction, validation_batch)
    if sample_weight is None:
        return source, validation_data, None
    weights = tf.nest.map_structure(np.asarray, sample_weight)
    head_weights = tf.nest.map_structure(lambda w: w[:len(source)], weights)
    tail_weights = tf.nest.map_structure(lambda w: w[len(source):], weights)
    if isinstance(validation_data, tf.data.Dataset):
        batches = tf.data.Dataset.from_tensor_slices(tail_weights).batch(validation_batch)
        validation_data = tf.data.Dataset.zip((validation_data, batches)).map(lambda xy, w: (*xy, w))
    else:
        validation_data = (*validation_data, tail_weights)
    return source, validation_data, head_weights


def _split_tail(x, y, fraction):
    cut = _training_rows(num_rows(x), fraction)
    head = lambda a: a[:cut]  # noqa: E731
    tail = lambda a: keras_array(a[cut:])  # noqa: E731 — the validation rows go to Keras' own fit
    return ((tf.nest.map_structure(head, x), tf.nest.map_structure(head, y)),
            (tf.nest.map_structure(tail, x), tf.nest.map_structure(tail, y)))


def _split_source_tail(source, fraction, batch: int):
    """validation_split for a random-access source, as Keras splits arrays: the last
    ``fraction`` of the examples (by index, before any sampling) validate, the rest train.
    The training source is the first ``cut`` examples — N = cut for the sampler and the
    accountant, so a validation index is never sampled — and the validation data are the
    tail read in order, ``batch`` examples at a time (the source's own parallel reader)."""
    n = len(source)
    cut = _training_rows(n, fraction)
    training = source.first(cut)

    def read(indices):
        x, y, _ = source.graph_read(indices, tf.ones(tf.shape(indices), tf.float32))
        return x, y

    tail = tf.data.Dataset.range(cut, n).batch(batch).map(read, num_parallel_calls=tf.data.AUTOTUNE)
    return training, tail.prefetch(1)
