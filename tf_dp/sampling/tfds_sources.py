"""The in-graph path of a ``tfds.data_source``: its records parsed a batch at a time.

``fit(tfds.data_source(...))`` Poisson-samples the source and parses + decodes only the
sampled records in the graph with the dataset's own features spec (``parsed_source``).
Part of the input pipeline, so it lives with the samplers; the ArrayRecord writers and the
packaged data sets are in ``tf_dp.data.tfds``. Needs ``tensorflow-datasets`` only when such
a source is passed.
"""

from __future__ import annotations

import numpy as np


class GraphPathUnavailable(ValueError):
    """The records of this data source cannot be parsed in the graph as asked (fit then
    decodes them per record in Python, as TFDS' own ``__getitem__`` does)."""


def is_data_source(source) -> bool:
    """Whether ``source`` is a ``tfds.data_source(...)`` over ArrayRecord files (records are
    serialized ``tf.train.Example``s described by the builder's features spec)."""
    kind = type(source)
    return (kind.__name__ == "ArrayRecordDataSource" and kind.__module__.startswith("tensorflow_datasets")
            and hasattr(source, "dataset_info") and hasattr(source, "data_source"))


def parsed_source(source, keys=None, transform=None, check_rows: int = 2):
    """A ``tfds.data_source(...)`` of ANY TFDS dataset as a source whose records are parsed
    in the graph: per step one Python call fetches the sampled records' bytes (the
    ArrayRecord reader under the data source), then ``tf.io.parse_example`` with the
    builder's features spec and TFDS' own TensorFlow decoders (``decode_batch_example``:
    PNG/JPEG images decoded in parallel ``map_fn`` iterations) run inside the loader's
    parallel ``tf.data`` map — no Python per record.

    * ``keys``: (x key(s), y key) of the decoded features; default the builder's
      ``supervised_keys`` (e.g. ``("image", "label")``). x is the decoded tensor as TFDS
      gives it (uint8 images: put ``keras.layers.Rescaling`` in the model).
    * ``transform(features) -> (x, y)``: instead of ``keys``, a function of ONE example's
      decoded features (a dict of tensors) written with TensorFlow ops; it runs vectorized
      over the batch (``tf.vectorized_map``). It is checked on the first ``check_rows``
      examples against ``transform`` applied to TFDS' own Python decoding (``source[i]``):
      a transform that does not trace as TensorFlow ops (numpy calls), or gives other
      values traced than in Python (beyond float rounding, 1e-5 relative), raises
      ``GraphPathUnavailable``.

    Features of variable length (sequences, ragged) are parsed example by example
    (``map_fn``), the rest as one batch. Example i is ``source[i]``: the same indices, so
    the same sampling_seed gives the same batches as the per-record path."""
    import tensorflow as tf
    from tensorflow_datasets.core import example_parser
    from tensorflow_datasets.core import utils as tfds_utils

    from tf_dp.sampling.sources import SerializedSource

    if not is_data_source(source):
        raise TypeError(f"parsed_source needs a tfds.data_source(...) over ArrayRecord, got {type(source).__name__}.")
    method = getattr(source, "deserialize_method", None)
    if getattr(source, "decoders", None) is not None or (
            method is not None and method.name != "DESERIALIZE_AND_DECODE"):
        raise GraphPathUnavailable("this data source has custom decoders or a deserialize_method other than "
                                   "DESERIALIZE_AND_DECODE; its records are read through its own __getitem__.")
    info = source.dataset_info
    features = info.features
    if transform is None:
        keys = tuple(keys) if keys is not None else info.supervised_keys
        if keys is None or len(keys) != 2:
            raise GraphPathUnavailable(
                f"{info.name} has no supervised_keys: pass keys=(x_key, y_key) or transform=fn(features) -> (x, y) "
                f"(features: {sorted(features.keys())}).")
        names = sorted(set(tf.nest.flatten(keys)))
        unknown = [n for n in names if n not in features.keys()]
        if unknown:
            raise ValueError(f"keys {unknown} are not features of {info.name}: {sorted(features.keys())}.")
    else:
        if not callable(transform):
            raise TypeError(f"`transform` must be callable, got {transform!r}.")
        names = sorted(features.keys())
    serialized_info = {name: features.get_serialized_info()[name] for name in names}
    flat_info = tfds_utils.flatten_nest_dict(serialized_info)
    flat_specs = tfds_utils.flatten_nest_dict(example_parser.ExampleParser(serialized_info).flat_feature_specs)
    batchable = all(isinstance(spec, tf.io.FixedLenFeature) for spec in flat_specs.values())
    single = example_parser.ExampleParser(features.get_serialized_info())

    def select(decoded):
        if transform is not None:
            return transform(decoded)
        return tf.nest.map_structure(lambda key: decoded[key], keys[0]), decoded[keys[1]]

    def parse(serialized):
        if not batchable:  # variable-length features: one example at a time (shapes differ per example)
            one = lambda record: select(features.decode_example(single.parse_example(record)))  # noqa: E731
            spec = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype),
                                         tf.function(one, autograph=False).get_concrete_function(
                                             tf.TensorSpec([], tf.string)).structured_outputs)
            return tuple(tf.map_fn(one, serialized, fn_output_signature=spec, parallel_iterations=16))
        flat = tf.io.parse_example(serialized, flat_specs)
        flat = {k: tf.cast(v, flat_info[k].tf_dtype) if v.dtype != flat_info[k].tf_dtype else v
                for k, v in flat.items()}
        nested = tfds_utils.pack_as_nest_dict(flat, serialized_info)
        decoded = {name: features[name].decode_batch_example(nested[name]) for name in names}
        if transform is None:
            return select(decoded)
        return tuple(tf.vectorized_map(transform, decoded, fallback_to_while_loop=True))

    try:
        examples = SerializedSource(source.data_source, parse)
    except Exception as error:  # noqa: BLE001 — tracing a Python transform (numpy calls) fails in many ways
        if transform is None:
            raise
        raise GraphPathUnavailable(f"`transform` does not trace as TensorFlow ops ({type(error).__name__}: "
                                   f"{str(error).splitlines()[0] if str(error) else ''})") from error
    if transform is not None:
        _check_against_python(examples, source, transform, check_rows)
    return examples


def _check_against_python(examples, source, transform, rows: int):
    """The graph path must give what ``transform(source[i])`` gives (values and dtypes)."""
    import tensorflow as tf

    rows = np.arange(min(rows, len(source)))
    try:
        x, y = examples.read_examples(rows)
    except Exception as error:  # noqa: BLE001
        raise GraphPathUnavailable(f"`transform` failed traced as TensorFlow ops ({type(error).__name__})") from error
    for j, i in enumerate(rows):
        px, py = transform(source[int(i)])
        graph = tf.nest.flatten((tf.nest.map_structure(lambda v: v[j], x), y[j]))
        try:
            python = tf.nest.flatten((px, py))
            tf.nest.assert_same_structure((tf.nest.map_structure(lambda v: v[j], x), y[j]), (px, py))
        except (ValueError, TypeError) as error:
            raise GraphPathUnavailable(
                f"`transform` gives another structure traced than in Python ({error})") from error
        for g, p in zip(graph, python):
            p = np.asarray(p)
            # Floats up to rounding (a graph may compute x / 255 as x * (1 / 255)); all else exactly.
            same = (np.allclose(g, p, rtol=1e-5, atol=1e-7) if g.dtype.kind == "f" else np.array_equal(g, p))
            if g.shape != p.shape or p.dtype.kind != g.dtype.kind or not same:
                raise GraphPathUnavailable(
                    f"`transform` traced as TensorFlow ops gives other values than in Python on example {int(i)} "
                    f"(graph {g.dtype}{list(g.shape)}, Python {p.dtype}{list(p.shape)})")


def source_for_fit(x, transform=None):
    """fit's fast path for a ``tfds.data_source``: records parsed in the graph with the
    builder's features spec (``parsed_source``) — with the supervised keys when there is no
    ``transform``, or with ``transform`` traced as TensorFlow ops when it traces and gives
    what it gives in Python. None for anything else, or (with a warning saying why) when
    ``transform`` cannot run in the graph: then fit decodes record by record in Python."""
    import warnings

    if not is_data_source(x):
        return None
    try:
        return parsed_source(x, transform=transform)
    except GraphPathUnavailable as why:
        if transform is None:  # TFDS records are feature dicts: without keys or a transform there is no (x, y)
            raise ValueError(f"tf_dp: {why}") from why
        warnings.warn(
            f"tf_dp: this tfds.data_source is decoded record by record in Python (TFDS' __getitem__, then "
            f"`transform`), not parsed in the graph: {why}. For the fast path write `transform` with "
            "TensorFlow ops on the decoded features dict, or pass tf_dp.data.tfds.parsed_source(source, "
            "keys=...) (see its docs).", stacklevel=4)
        return None
