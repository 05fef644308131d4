"""Input handling for DP fit: arrays, datasets or random-access sources in, Poisson-sampled masked chunks out."""

from __future__ import annotations

import secrets
from typing import Callable, Optional

import numpy as np
import tensorflow as tf

from tf_dp.sampling.dataset_graph import (ALLOWED_ON_BATCHES, ALLOWED_PER_EXAMPLE, dataset_ends_in_batch,
                                         keras_utility_note, refused_operations)
from tf_dp.sampling.loader import augmented_spec, poisson_loader
from tf_dp.sampling.sources import ArraySource, ExampleSource, num_rows  # noqa: F401 (num_rows: fit's)

POISSON_KEYS = ("x", "y", "mask", "expected_batch_size")


def is_poisson_batch(data) -> bool:
    return isinstance(data, dict) and set(POISSON_KEYS) <= set(data)


def is_batched_dataset(dataset: tf.data.Dataset, model) -> bool:
    """True if the dataset's elements are batches of examples, False if each element is one
    example; raises ValueError when neither is established by a fact.

    The privacy unit is never guessed from a shape alone. Facts, in order:
      1. the model's input rank r (functional ``model.inputs``, or the shape a subclassed
         model was built with): elements of rank r are batches, of rank r − 1 examples;
      2. the dataset's own graph: batched if every path from its output meets a batching
         transformation (batch, padded_batch, map_and_batch, rebatch, ...) before any unbatch.
    Otherwise (an unbuilt subclassed model and a dataset not ending in a batch) it refuses:
    reading a batch as one example would account N = number of batches."""
    element_rank = len(_first_leaf(_x_spec(dataset.element_spec)).shape)
    model_rank = model_input_rank(model)
    if model_rank is not None:
        return _batched_by_rank(element_rank, model_rank, model)
    if dataset_ends_in_batch(dataset):
        return True
    shape = _first_leaf(_x_spec(dataset.element_spec)).shape
    raise ValueError(
        f"tf_dp cannot tell whether this dataset's elements (x of shape {shape}) "
        f"are single examples or batches: {getattr(model, 'name', 'the model')} is not built, so its input shape is "
        "unknown, and the dataset does not end in .batch(). Guessing would risk counting each batch as one example "
        "(N = number of batches, far too small an epsilon). Build the model first: call it once on a batch "
        "(model(x[:1])) or model.build((None, *example_shape)); or pass arrays x, y with batch_size=... (Poisson "
        "sampling), or a dataset ending in .batch(...) (fixed batches, accounted without amplification)."
    )


def refuse_duplicating_batches(dataset: tf.data.Dataset) -> None:
    """Raises ValueError unless the batched ``dataset`` passes the door's allow-list
    (tf_dp.sampling.dataset_graph, docs/algorithms.md §1.4): before its last batch op only
    operations that keep one element per example, after it only operations on whole batches
    (prefetch, cache, repeat, shuffle, take, ...). A repeat, window, flat_map, interleave,
    concatenate, zip, unbatch, rebatch, scan, ... anywhere, and a map or filter applied to
    whole batches (MixUp after batch(), a map concatenating two views of a batch), are refused
    naming the operation: they can put one example into a batch twice or mix examples across
    rows, while each step is accounted at sensitivity C. The rest is the caller's promise:
    each row of the data is a different example."""
    refused = refused_operations(dataset, batched=True)
    if refused:
        raise ValueError(
            f"fit() refuses this batched dataset: {'; '.join(refused)}. A batched pipeline may use, before its last "
            f".batch(), only operations that keep one element per example ({ALLOWED_PER_EXAMPLE}), and after it only "
            f"operations on whole batches ({ALLOWED_ON_BATCHES}); anything else can put one example into a batch "
            "twice or mix examples across rows, and each copy or mixed row is clipped separately (one example "
            "moves the noisy sum by more than C, while each step is accounted at sensitivity C). Fix: do the work "
            "per example before .batch() (augmentation in a per-example map, or inside the model), repeat whole "
            "batches (ds.batch(L).repeat()), or pass arrays / the UNBATCHED dataset with batch_size=... for Poisson "
            "sampling (fit's `epochs` repeats the data)." + keras_utility_note(dataset, batched=True))


def _x_spec(spec):
    return spec[0] if isinstance(spec, tuple) else spec


def _first_leaf(structure):
    return tf.nest.flatten(structure)[0]


def _batched_by_rank(element_rank: int, model_rank: int, model) -> bool:
    if element_rank in (model_rank, model_rank - 1):
        return element_rank == model_rank
    raise ValueError(
        f"The dataset's x elements have rank {element_rank}, but {model.name} takes inputs of rank {model_rank} "
        f"(with the batch axis): elements must be single examples (rank {model_rank - 1}) or batches "
        f"(rank {model_rank})."
    )


def model_input_rank(model) -> Optional[int]:
    """Rank (batch axis included) of the model's first input, if known: from a functional
    model's ``inputs``, else from the shape it was built with; None for an unbuilt model."""
    try:
        inputs = getattr(model, "inputs", None)
    except (AttributeError, ValueError):
        inputs = None
    if inputs:
        return len(_first_leaf(inputs).shape)
    shapes = getattr(model, "_build_shapes_dict", None)
    if not shapes:
        return None
    shape = _first_shape(next(iter(shapes.values())))
    return None if shape is None else len(shape)


def refuse_batched_records(source: ExampleSource, model, augment: Optional[Callable] = None) -> None:
    """Raises ValueError unless the records of a random-access ``source`` are single examples
    of ``model``'s input (``augment``ed first, when given), as read from the model's input
    shape; a source of batches (e.g. ``grain.MapDataset.source(s).batch(32)``) would be
    accounted with N = the number of batches, a far too small ε. Arrays (rows are examples
    by definition) pass; an unbuilt model, whose input shape is unknown, is refused."""
    if isinstance(source, ArraySource):
        return
    x_spec = source.spec[0] if augment is None else augmented_spec(augment, source.spec[0])
    records = [tuple(leaf.shape.as_list()) for leaf in tf.nest.flatten(x_spec)]
    examples = model_example_shapes(model)
    name = getattr(model, "name", "the model")
    if examples is None:
        raise ValueError(
            f"tf_dp cannot tell whether this source's records (x of shape {list(records[0])}) are single examples or "
            f"batches: {name} is not built, so its input shape is unknown. Reading a batch as one example would "
            "account N = number of batches (far too small an ε). Build the model first (model.build((None, "
            "*example_shape)), or call it once on one example), or give it a keras.Input.")
    verdicts = {_record_unit(record, examples) for record in records}
    if verdicts == {"example"}:
        return
    if "batch" in verdicts and "example" not in verdicts:
        raise ValueError(
            f"The source's records are BATCHES (x of shape {list(records[0])}), but {name} takes examples of shape "
            f"{list(examples[0])}: each record would count as one example (N = number of batches, far too small an "
            "ε). Pass a source whose record i is example i (e.g. a grain MapDataset without .batch()); fit samples "
            "the batches itself.")
    raise ValueError(
        f"The source's records (x of shape {[list(r) for r in records]}) match neither single examples nor batches "
        f"of {name}'s inputs (examples of shape {[list(e) for e in examples]}).")


def _record_unit(record: tuple, examples: list) -> str:
    """'example' if ``record`` is one example of some input shape, 'batch' if a batch of one, else 'neither'."""
    if any(_compatible(record, e) for e in examples):
        return "example"
    if record and any(_compatible(record[1:], e) for e in examples):
        return "batch"
    if any(_keras_adjusts(record, e) for e in examples):  # a trailing axis of 1 Keras adds or squeezes
        return "example"
    return "neither"


def _compatible(shape: tuple, reference: tuple) -> bool:
    return len(shape) == len(reference) and all(a is None or b is None or a == b for a, b in zip(shape, reference))


def _keras_adjusts(shape: tuple, reference: tuple) -> bool:
    return (_compatible((*shape, 1), reference) or
            (len(shape) > 0 and shape[-1] == 1 and _compatible(shape[:-1], reference)))


def model_example_shapes(model) -> Optional[list]:
    """The shapes of one example (batch axis dropped) of each of the model's inputs, if
    known: a functional model's ``inputs``, else the first shape it was built with."""
    try:
        inputs = getattr(model, "inputs", None)
    except (AttributeError, ValueError):
        inputs = None
    if inputs:
        return [tuple(tensor.shape)[1:] for tensor in tf.nest.flatten(inputs)]
    shapes = getattr(model, "_build_shapes_dict", None)
    shape = _first_shape(next(iter(shapes.values()))) if shapes else None
    return None if shape is None else [tuple(shape)[1:]]


def _first_shape(shapes):
    """The first shape tuple in a (possibly nested) structure of shapes."""
    if isinstance(shapes, dict):
        return _first_shape(shapes[sorted(shapes)[0]]) if shapes else None
    if isinstance(shapes, tf.TensorShape):
        return tuple(shapes.as_list()) if shapes.rank is not None else None
    if isinstance(shapes, (list, tuple)):
        if all(d is None or isinstance(d, (int, np.integer)) for d in shapes):
            return tuple(shapes)
        return _first_shape(shapes[0]) if shapes else None
    return None


def poisson_dataset(x, y, num_examples: int, batch_size: int, physical_batch_size: Optional[int],
                    seed: Optional[int], extras: Optional[dict] = None, secure: bool = False,
                    chunk_multiple: int = 1, replica_slots: Optional[range] = None,
                    first_step: Optional[Callable[[], int]] = None, source: Optional[ExampleSource] = None,
                    augment: Optional[Callable] = None, views: int = 1,
                    augment_seed: Optional[int] = None, scheme=None,
                    seed_generation: Optional[Callable[[], int]] = None) -> tf.data.Dataset:
    """Endless dataset of Poisson batches {x, y, mask: [chunks, P, ...], expected_batch_size:
    [chunks] (L repeated)} plus any per-example ``extras`` arrays (e.g. RaCO-DP's group ids),
    gathered alike — from arrays ``x, y`` or from a random-access ``source`` (then x, y are
    ignored), reading only the sampled examples (tf_dp.sampling.loader).

    Under tf.distribute the chunk count is padded (with empty chunks) to a multiple of
    ``chunk_multiple`` = R replicas, and ``replica_slots`` selects which of the R equal
    chunk slices this input pipeline yields: one element per slot per batch, in order.

    ``first_step()`` is read each time an iterator starts (DPModel passes its count of
    steps taken): the stream then serves the batch of step t at step t however often Keras
    re-creates or prefetches iterators, identically on every worker. ``seed_generation()``,
    read at the same time, is the generation of ``seed`` the stream draws from (re-keyed after a
    rollback, tf_dp.sampling.seed_guard; default 0, ``seed`` itself)."""
    if source is None:
        source = ArraySource(x, y)
    if extras:
        source = source.with_extras(extras)
    if len(source) != num_examples:
        raise ValueError(f"num_examples = {num_examples} but the source holds {len(source)} examples.")
    return poisson_loader(source, batch_size, physical_batch_size, seed, secure=secure, chunk_multiple=chunk_multiple,
                          replica_slots=replica_slots, first_step=first_step, augment=augment, views=views,
                          augment_seed=augment_seed, scheme=scheme, seed_generation=seed_generation)


def distributed_poisson_dataset(strategy: tf.distribute.Strategy, x, y, num_examples: int, batch_size: int,
                                physical_batch_size: Optional[int], seed: Optional[int],
                                extras: Optional[dict] = None, secure: bool = False,
                                first_step: Optional[Callable[[], int]] = None,
                                source: Optional[ExampleSource] = None, augment: Optional[Callable] = None,
                                views: int = 1, augment_seed: Optional[int] = None, scheme=None,
                                seed_generation: Optional[Callable[[], int]] = None):
    """One global Poisson batch per step, split by chunks across ALL replicas of ``strategy``
    (every worker of a multi-worker strategy draws the same batch from the shared ``seed``, of
    the same ``seed_generation()``, and reads only its replicas' slices of it from the source):
    no example is read twice, none is dropped, and no worker holds more than its share of the
    batch."""
    replicas = strategy.num_replicas_in_sync

    def pipeline(context: tf.distribute.InputContext) -> tf.data.Dataset:
        local = replicas // context.num_input_pipelines
        first = context.input_pipeline_id * local
        return poisson_dataset(x, y, num_examples, batch_size, physical_batch_size, seed, extras, secure,
                               chunk_multiple=replicas, replica_slots=range(first, first + local),
                               first_step=first_step, source=source, augment=augment, views=views,
                               augment_seed=augment_seed, scheme=scheme, seed_generation=seed_generation)

    return strategy.distribute_datasets_from_function(pipeline)


def agreed_sampling_seed(strategy: tf.distribute.Strategy, seed: Optional[int]) -> int:
    """The batch-selection seed every worker uses: ``seed``, or 63 bits from the OS CSPRNG
    drawn on the host of replica 0 and broadcast (an all-reduce SUM in which every other
    replica contributes 0), so all workers hold the same full-entropy value."""
    if seed is not None:
        return int(seed)
    draw = secrets.randbits(63)

    def replica_share():
        first = tf.equal(tf.distribute.get_replica_context().replica_id_in_sync_group, 0)
        return tf.where(first, tf.constant(draw, tf.int64), tf.constant(0, tf.int64))

    per_replica = strategy.run(replica_share)
    return int(strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None))
