"""Input handling for DP fit: arrays in, Poisson-sampled masked chunks out."""

from __future__ import annotations

import os
from typing import Callable, Optional

import numpy as np
import tensorflow as tf

from tf_dp.sampling import PoissonSampler

POISSON_KEYS = ("x", "y", "mask", "expected_batch_size")


def is_poisson_batch(data) -> bool:
    return isinstance(data, dict) and set(POISSON_KEYS) <= set(data)


def num_rows(x) -> int:
    return int(np.shape(tf.nest.flatten(x)[0])[0])


def _to_numpy(value, name: str):
    if isinstance(value, (tf.RaggedTensor, tf.SparseTensor)):
        raise TypeError(
            f"`{name}` is a {type(value).__name__}; DP training needs dense, fixed-shape examples "
            "(pad sequences, e.g. keras.utils.pad_sequences)."
        )
    array = np.asarray(value)
    if array.dtype == object:
        raise TypeError(f"`{name}` has ragged/object rows; pad them to one shape first.")
    return array


def as_arrays(x, y):
    """(x, y) as numpy structures from arrays or an UNBATCHED tf.data.Dataset of (x, y)."""
    if isinstance(x, tf.data.Dataset):
        if y is not None:
            raise ValueError("Pass `y` inside the dataset, not as a separate argument.")
        examples = list(x.as_numpy_iterator())
        if not examples or not isinstance(examples[0], tuple) or len(examples[0]) != 2:
            raise ValueError("A dataset given to DP fit must yield (x, y) pairs of single examples.")
        x = tf.nest.map_structure(lambda *rows: np.stack(rows), *[e[0] for e in examples])
        y = np.stack([e[1] for e in examples])
        return x, y
    if x is None or y is None:
        raise ValueError("DP fit needs both `x` and `y`.")
    x = tf.nest.map_structure(lambda v: _to_numpy(v, "x"), x)
    y = _to_numpy(y, "y")
    sizes = {num_rows(x), len(y)} | {len(a) for a in tf.nest.flatten(x)}
    if len(sizes) != 1:
        raise ValueError(f"`x` and `y` must have the same number of rows, got sizes {sorted(sizes)}.")
    return x, y


def is_batched_dataset(dataset: tf.data.Dataset, model) -> bool:
    """True if elements carry a batch axis: same rank as the model's inputs (when known),
    else an unknown leading dimension."""
    spec = dataset.element_spec
    x_spec = spec[0] if isinstance(spec, tuple) else spec
    first = tf.nest.flatten(x_spec)[0]
    inputs = getattr(model, "inputs", None)
    if inputs:
        return len(first.shape) == len(tf.nest.flatten(inputs)[0].shape)
    return len(first.shape) > 0 and first.shape[0] is None


def poisson_dataset(x, y, num_examples: int, batch_size: int, physical_batch_size: Optional[int],
                    seed: Optional[int], extras: Optional[dict] = None, secure: bool = False,
                    chunk_multiple: int = 1, replica_slots: Optional[range] = None,
                    first_step: Optional[Callable[[], int]] = None) -> tf.data.Dataset:
    """Endless dataset of Poisson batches {x, y, mask: [chunks, P, ...], expected_batch_size:
    [chunks] (L repeated)} plus any per-example ``extras`` arrays (e.g. RaCO-DP's group ids),
    gathered alike.

    Under tf.distribute the chunk count is padded (with empty chunks) to a multiple of
    ``chunk_multiple`` = R replicas, and ``replica_slots`` selects which of the R equal
    chunk slices this input pipeline yields: one element per slot per batch, in order.

    ``first_step()`` is read each time an iterator starts (DPModel passes its count of
    steps taken): the stream then serves the batch of step t at step t however often Keras
    re-creates or prefetches iterators, identically on every worker."""
    extras = dict(extras or {})
    sampler = PoissonSampler(num_examples, batch_size, physical_batch_size, seed, secure=secure,
                             chunk_multiple=chunk_multiple)
    physical = sampler.physical_batch_size
    expected = np.float32(batch_size)

    def spec(array):
        return tf.TensorSpec([None, physical, *array.shape[1:]], tf.as_dtype(array.dtype))

    signature = {
        "x": tf.nest.map_structure(spec, x), "y": spec(y),
        "mask": tf.TensorSpec([None, physical], tf.float32), "expected_batch_size": tf.TensorSpec([None], tf.float32),
        **{name: spec(array) for name, array in extras.items()},
    }

    def element(indices, mask):
        return {
            "x": tf.nest.map_structure(lambda a: a[indices], x), "y": y[indices],
            "mask": mask, "expected_batch_size": np.full(len(mask), expected),
            **{name: array[indices] for name, array in extras.items()},
        }

    def batches():
        for indices, mask in sampler.stream(None if first_step is None else first_step()):
            if replica_slots is None:
                yield element(indices, mask)
                continue
            width = len(mask) // chunk_multiple
            for slot in replica_slots:
                part = slice(slot * width, (slot + 1) * width)
                yield element(indices[part], mask[part])

    return tf.data.Dataset.from_generator(batches, output_signature=signature).prefetch(2)


def distributed_poisson_dataset(strategy: tf.distribute.Strategy, x, y, num_examples: int, batch_size: int,
                                physical_batch_size: Optional[int], seed: Optional[int],
                                extras: Optional[dict] = None, secure: bool = False,
                                first_step: Optional[Callable[[], int]] = None):
    """One global Poisson batch per step, split by chunks across ALL replicas of ``strategy``
    (every worker of a multi-worker strategy draws the same batch from the shared ``seed``
    and keeps only its replicas' slices): no example is read twice, none is dropped."""
    replicas = strategy.num_replicas_in_sync

    def pipeline(context: tf.distribute.InputContext) -> tf.data.Dataset:
        local = replicas // context.num_input_pipelines
        first = context.input_pipeline_id * local
        return poisson_dataset(x, y, num_examples, batch_size, physical_batch_size, seed, extras, secure,
                               chunk_multiple=replicas, replica_slots=range(first, first + local),
                               first_step=first_step)

    return strategy.distribute_datasets_from_function(pipeline)


def agreed_sampling_seed(strategy: tf.distribute.Strategy, seed: Optional[int]) -> int:
    """The batch-selection seed every worker uses: ``seed``, or the sum of one OS draw per
    replica (an all-reduce, so all workers hold the same value)."""
    if seed is not None:
        return int(seed)
    draw = int.from_bytes(os.urandom(4), "little") >> 1
    per_replica = strategy.run(lambda: tf.constant(draw, tf.int64))
    return int(strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None))
