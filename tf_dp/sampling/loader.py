"""The Poisson loader: sampled indices → the rows of those examples only, as masked chunks.

    index stream (Python, cheap)      step t → PoissonSampler.batch(t) = (indices, mask) [chunks, P]
      → read (tf.data map, parallel)   only the masked-in indices are read from the source
      → augment (tf.data map, parallel) optional per-example augmentation, K views (docs/algorithms.md §8)
      → {x, y, mask, expected_batch_size, **extras}, x shaped [chunks, P, (K,) ...]

Batch t is a function of (seed, t) alone and the stream restarts at ``first_step()`` (the
model's count of steps taken) whenever an iterator is created, so a restarted, prefetching
or remote pipeline serves the batch of step t at step t. Padding rows (mask 0) are never
read: they are zeros. Under tf.distribute every input pipeline draws the same global
batch and reads only the chunks of its own replicas.

A sampled record that fails to read or parse (``ExampleSource.graph_read_tolerant``) is a
zero-weight example: its slot keeps the padding value and gets mask 0 (a user-level unit with
one unreadable example contributes nothing), and the count of such records per step goes to the
source's ``UnreadableLog`` in host memory, for fit to report the total after training — never an
exception at the step that sampled the record, which would tell when it was sampled.

Reads run in a tf.data ``map`` with ``num_parallel_calls=AUTOTUNE`` (steps in flight
overlap the train step); a Python source's records are transformed on a small thread pool
inside one read (``RecordSource.workers``). Chosen by measurement (benchmarks/data_loading.py):
one read per step amortizes the Python call over the batch — per-example Python calls cost
~50 µs each, more than an MNIST-sized row.
"""

from __future__ import annotations

import inspect
import os
from typing import Callable, Optional

import numpy as np
import tensorflow as tf

from tf_dp.sampling.poisson import PoissonSampler
from tf_dp.sampling.seed_guard import generation_seed
from tf_dp.sampling.sources import ExampleSource

AUGMENT_SALT = 0x5EED_A061


def poisson_loader(source: ExampleSource, batch_size: int, physical_batch_size: Optional[int] = None,
                   seed: Optional[int] = None, secure: bool = False, chunk_multiple: int = 1,
                   replica_slots: Optional[range] = None, first_step: Optional[Callable[[], int]] = None,
                   augment: Optional[Callable] = None, views: int = 1,
                   augment_seed: Optional[int] = None, scheme=None,
                   seed_generation: Optional[Callable[[], int]] = None) -> tf.data.Dataset:
    """Endless dataset of Poisson batches of ``source`` (see the module docstring).

    Under tf.distribute the chunk count is padded (with empty chunks) to a multiple of
    ``chunk_multiple`` = R replicas, and ``replica_slots`` selects which of the R equal
    chunk slices this pipeline yields: one element per slot per batch, in order.

    ``augment(x, seed) -> x'`` (TensorFlow ops on ONE example's x; ``seed`` a [2] int32
    tensor for tf.random.stateless_* ops) is applied ``views`` times per example with
    seeds derived from (augment_seed, t, example index, view): with views > 1 the x leaves
    get a view axis after the batch axis, [chunks, P, K, ...].

    ``scheme`` (a ``tf_dp.sampling.schemes.SamplingScheme``; default: Poisson sampling of the
    source's examples with L = ``batch_size``) builds the sampler that draws each step's indices.
    A user-level sampler (tf_dp.sampling.users, docs/algorithms.md §11) yields indices
    [chunks, P, m]: x, y and every extra then get the user's m examples on axis 2,
    [chunks, P, m, ...] (each example keeps its own label and weight); the mask stays per
    user, [chunks, P].

    ``seed_generation()`` (read with ``first_step()`` when an iterator starts; default 0) is the
    generation of ``seed`` to draw from: generation g > 0 samples with
    ``tf_dp.sampling.seed_guard.generation_seed(seed, g)``, after a rollback of the ledger
    (docs/algorithms.md B.3). Augmentation keeps ``augment_seed``: its views need no secrecy."""
    def new_sampler(sampler_seed, physical_size):
        if scheme is None:
            return PoissonSampler(len(source), batch_size, physical_size, sampler_seed, secure=secure,
                                  chunk_multiple=chunk_multiple)
        return scheme.sampler(physical_size, sampler_seed, secure, chunk_multiple)

    sampler, sampler_at_start = _samplers_by_generation(new_sampler, seed, physical_batch_size, seed_generation)
    physical = sampler.physical_batch_size
    expected = np.float32(batch_size)
    unit = index_unit_shape(sampler)
    if unit and augment is not None:
        raise ValueError("`augment` is not supported with user-level sampling (the view axis holds each user's "
                         "examples): augment inside the model (random layers) instead.")

    def index_stream():
        stream_sampler = sampler_at_start()
        for step, indices, mask in stream_sampler.numbered_stream(None if first_step is None else first_step()):
            if replica_slots is None:
                yield step, 0, indices, mask
            else:
                width = len(mask) // chunk_multiple
                for slot in replica_slots:
                    part = slice(slot * width, (slot + 1) * width)
                    yield step, slot, indices[part], mask[part]

    signature = (tf.TensorSpec([], tf.int64), tf.TensorSpec([], tf.int64),
                 tf.TensorSpec([None, physical, *unit], tf.int64), tf.TensorSpec([None, physical], tf.float32))
    steps = tf.data.Dataset.from_generator(index_stream, output_signature=signature)
    log = source.unreadable_log()

    def read(step, slot, indices, mask):
        example_mask = tf.broadcast_to(tf.reshape(mask, tf.concat([tf.shape(mask), [1] * len(unit)], 0)),
                                       tf.shape(indices))  # a padding user's slots are never read
        x, y, extras, unreadable = source.graph_read_tolerant(tf.reshape(indices, [-1]),
                                                              tf.reshape(example_mask, [-1]))
        chunks = tf.shape(mask)[0]
        fold = lambda t: tf.reshape(t, tf.concat([[chunks, physical, *unit], tf.shape(t)[1:]], axis=0))  # noqa: E731
        mask = zero_weight_unreadable(mask, fold(unreadable), step, slot, log)
        element = {"x": tf.nest.map_structure(fold, x), "y": tf.nest.map_structure(fold, y), "mask": mask,
                   "expected_batch_size": tf.fill([chunks], expected),
                   **{name: fold(value) for name, value in extras.items()}}
        return step, indices, element

    elements = steps.map(read, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    if augment is not None:
        views_of = example_views(augment, source.spec[0], views, augment_seed)
        elements = elements.map(lambda step, indices, element: (step, indices, views_of(step, indices, element)),
                                num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return elements.map(lambda step, indices, element: element).prefetch(2)


def zero_weight_unreadable(mask: tf.Tensor, unreadable: tf.Tensor, step, slot, log) -> tf.Tensor:
    """``mask`` [chunks, P] with 0 for every unit holding an unreadable record (``unreadable``
    [chunks, P, (m)]); when there are any, their count is recorded for (step, slot) in ``log``
    (one host call, only then)."""
    per_unit = tf.reshape(unreadable, tf.concat([tf.shape(mask), [-1]], 0))
    count = tf.reduce_sum(tf.cast(per_unit, tf.int64))
    record = tf.autograph.experimental.do_not_convert(log.record)
    noted = tf.cond(count > 0, lambda: tf.numpy_function(record, [step, slot, count], tf.int64, stateful=True),
                    lambda: count)
    with tf.control_dependencies([noted]):
        return tf.where(tf.reduce_any(per_unit, axis=-1), tf.zeros_like(mask), mask)


def _samplers_by_generation(new_sampler, seed, physical_batch_size, seed_generation):
    """(the sampler of ``seed``, a function returning the sampler of generation
    ``seed_generation()`` of the seed, built once per generation with the same physical size).
    A None seed (OS entropy) keeps its one sampler: only a user seed is re-keyed (§B.3)."""
    samplers = {0: new_sampler(seed, physical_batch_size)}

    def at_start():
        generation = 0 if seed_generation is None or seed is None else int(seed_generation())
        if generation not in samplers:
            samplers[generation] = new_sampler(generation_seed(seed, generation), samplers[0].physical_batch_size)
        return samplers[generation]

    return samplers[0], at_start


def index_unit_shape(sampler) -> tuple:
    """The index axes after [chunks, P]: () for one example per slot, (m,) for a
    user-level sampler's m > 1 examples per sampled user."""
    per_user = getattr(sampler, "examples_per_user", None)
    return () if per_user is None or int(per_user) == 1 else (int(per_user),)


def augment_seed_from(seed: Optional[int]) -> int:
    """The augmentation seed: from the sampling seed when one is given (reproducible runs,
    agreed across workers), else fresh OS entropy. Augmentation randomness needs no secrecy:
    whatever the views, each example contributes one vector clipped to C."""
    if seed is None:
        return int.from_bytes(os.urandom(8), "little") >> 1
    return int(np.random.SeedSequence([int(seed), AUGMENT_SALT]).generate_state(2, np.uint32).view(np.uint64)[0] >> 1)


def _accepts_seed(augment: Callable) -> bool:
    try:
        parameters = inspect.signature(augment).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in parameters)


def example_views(augment: Callable, x_spec, views: int, augment_seed: Optional[int]):
    """element → element with x replaced by ``views`` augmented views of each example.

    ``augment(x, seed)`` gets a stateless seed per (step, example index, view);
    ``augment(x)`` (one argument, e.g. a Keras random layer) draws its own randomness."""
    seeded = _accepts_seed(augment)
    base = augment_seed_from(augment_seed)
    key = tf.constant([base & 0x7FFFFFFF, (base >> 31) & 0x7FFFFFFF], tf.int32)

    out_spec = augmented_spec(augment, x_spec, seeded)
    zeros = lambda: tf.nest.map_structure(lambda s: tf.zeros(s.shape, s.dtype), out_spec)  # noqa: E731

    def one(args):  # padding rows are never augmented (empty bytes need not decode): zeros
        x, seed, real = args
        return tf.cond(real, lambda: augment(x, seed) if seeded else augment(x), zeros)

    def views_of(step, indices, element):
        mask = tf.reshape(element["mask"], [-1])
        chunks, physical = tf.shape(element["mask"])[0], tf.shape(element["mask"])[1]
        flat = tf.nest.map_structure(lambda t: tf.reshape(t, tf.concat([[-1], tf.shape(t)[2:]], 0)), element["x"])
        step_key = tf.random.experimental.stateless_fold_in(key, step)
        rows = tf.reshape(indices, [-1])
        real = tf.cast(mask > 0, tf.bool)
        outputs = []
        for view in range(views):
            seeds = tf.map_fn(
                lambda index: tf.random.experimental.stateless_fold_in(
                    tf.random.experimental.stateless_fold_in(step_key, index), view),
                rows, fn_output_signature=tf.TensorSpec([2], tf.int32))
            outputs.append(tf.map_fn(one, (flat, seeds, real), fn_output_signature=out_spec, parallel_iterations=32))

        def assemble(*per_view):
            value = per_view[0] if views == 1 else tf.stack(per_view, axis=1)
            shape = tf.concat([tf.shape(real), tf.ones([value.shape.rank - 1], tf.int32)], 0)
            value = tf.where(tf.reshape(real, shape), value, tf.zeros_like(value))  # padding rows stay zeros
            return tf.reshape(value, tf.concat([[chunks, physical], tf.shape(value)[1:]], 0))

        return {**element, "x": tf.nest.map_structure(assemble, *outputs)}

    return views_of


def augmented_spec(augment: Callable, x_spec, seeded: Optional[bool] = None):
    """The spec of one augmented example (static shapes required)."""
    if seeded is None:
        seeded = _accepts_seed(augment)
    seed_spec = tf.TensorSpec([2], tf.int32)
    function = tf.function(lambda x, seed: augment(x, seed) if seeded else augment(x), autograph=False)
    outputs = function.get_concrete_function(x_spec, seed_spec).structured_outputs
    spec = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), outputs)
    tf.nest.assert_same_structure(x_spec, spec)
    for leaf in tf.nest.flatten(spec):
        if not leaf.shape.is_fully_defined():
            raise ValueError(f"`augment` must return examples of a static shape, got {leaf.shape}: crop or resize to "
                             "a fixed size.")
    return spec


def augment_examples(augment: Callable, x, seed: int = 0):
    """``augment`` applied eagerly to a few examples (view 0): what the model is built and
    the row-independence guard run on."""
    seeded = _accepts_seed(augment)
    key = tf.constant([seed & 0x7FFFFFFF, 1], tf.int32)
    count = int(np.shape(tf.nest.flatten(x)[0])[0])
    rows = []
    for i in range(count):
        example = tf.nest.map_structure(lambda a: tf.convert_to_tensor(a[i]), x)
        s = tf.random.experimental.stateless_fold_in(key, i)
        rows.append(augment(example, s) if seeded else augment(example))
    return tf.nest.map_structure(lambda *r: np.stack([np.asarray(v) for v in r]), *rows)
