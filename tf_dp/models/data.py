"""Input handling for DP fit: arrays in, Poisson-sampled masked chunks out."""

from __future__ import annotations

from typing import Optional

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
                    chunk_multiple: int = 1) -> tf.data.Dataset:
    """Endless dataset of Poisson batches {x, y, mask: [chunks, P, ...], expected_batch_size:
    [chunks] (L repeated, so that tf.distribute can split every component by chunk)}
    plus any per-example ``extras`` arrays (e.g. RaCO-DP's group ids), gathered alike. The
    chunk count is padded (with empty chunks) to a multiple of ``chunk_multiple``, the number
    of tf.distribute replicas, which split the chunk axis."""
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

    def batches():
        for indices, mask in sampler:
            yield {
                "x": tf.nest.map_structure(lambda a: a[indices], x), "y": y[indices],
                "mask": mask, "expected_batch_size": np.full(len(mask), expected),
                **{name: array[indices] for name, array in extras.items()},
            }

    return tf.data.Dataset.from_generator(batches, output_signature=signature).prefetch(2)
