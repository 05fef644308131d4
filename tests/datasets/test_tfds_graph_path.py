"""Any TFDS dataset on the fast path: `fit(tfds.data_source(...))` parses the
sampled records in the graph with the builder's own features spec (tf_dp.data.tfds.parsed_source).
Checked against TFDS' own Python decoding of the same records (source[i]) and against fit
on arrays built from those records with the same sampling seed."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

tfds = pytest.importorskip("tensorflow_datasets", reason="tensorflow-datasets is not installed (tf-dp[datasets])")
pytest.importorskip("array_record", reason="array-record is not installed (tf-dp[datasets])")

import tf_dp  # noqa: E402
from tf_dp.data import tfds as dp_tfds  # noqa: E402
from tf_dp.sampling import PoissonSampler  # noqa: E402
from tf_dp.sampling.sources import RecordSource, SerializedSource  # noqa: E402


def example_source(x, transform=None):  # what fit reads x through
    return dp_tfds.source_for_fit(x, transform) or RecordSource(x, transform)

N, CLASSES, HEAD = 300, 5, 67  # HEAD: rows the row-independence guard and the build read


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A non-MNIST TFDS dataset: PNG images 8x8x3, a class label, a float vector, a
    variable-length int feature and a text id — written by TFDS' own builder machinery."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (N, 8, 8, 3), dtype=np.uint8)
    labels = rng.integers(0, CLASSES, N)
    vectors = rng.normal(size=(N, 4)).astype(np.float32)
    features = tfds.features.FeaturesDict({
        "image": tfds.features.Image(shape=(8, 8, 3)),
        "label": tfds.features.ClassLabel(num_classes=CLASSES),
        "vector": tfds.features.Tensor(shape=(4,), dtype=np.float32),
        "tokens": tfds.features.Tensor(shape=(None,), dtype=np.int64),
        "id": tfds.features.Text(),
    })

    def examples():
        for i in range(N):
            yield i, {"image": images[i], "label": int(labels[i]), "vector": vectors[i],
                      "tokens": np.arange(i % 3 + 1, dtype=np.int64), "id": f"ex{i}"}

    from tensorflow_datasets.core import dataset_info
    from tensorflow_datasets.core.dataset_builders.adhoc_builder import AdhocBuilder

    class ImagesBuilder(AdhocBuilder, skip_registration=True):  # TFDS' ad hoc builder, with supervised keys
        def _info(self):
            return dataset_info.DatasetInfo(builder=self, features=self._feature_spec, disable_shuffling=True,
                                            supervised_keys=("image", "label"))

    data_dir = tmp_path_factory.mktemp("tfds_general")
    ImagesBuilder(name="tf_dp_test_images", version="1.0.0", features=features, split_datasets={"train": examples()},
            data_dir=str(data_dir), disable_shuffling=True).download_and_prepare(file_format="array_record")
    return data_dir


def source(data_dir):
    return tfds.data_source("tf_dp_test_images:1.0.0", split="train", data_dir=str(data_dir))


def python_arrays(src, key="image"):
    """x, y as TFDS' own per-record Python decoding gives them (the independent reference)."""
    records = [src[i] for i in range(len(src))]
    return np.stack([r[key] for r in records]), np.array([r["label"] for r in records])


def cnn(shape=(8, 8, 3)):
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape)
    h = keras.layers.Rescaling(1 / 255)(inputs) if len(shape) == 3 else inputs
    h = keras.layers.Dense(6, activation="tanh")(keras.layers.Flatten()(h))
    m = tf_dp.DPModel(inputs, keras.layers.Dense(CLASSES)(h))
    m.compile(optimizer=tf_dp.DPSGD(0.3, l2_norm_clip=1.0, noise_multiplier=0.8, seed=5),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m


class CountingReader:
    """Stands in for the ArrayRecord reader under a tfds data source; records what is read."""

    def __init__(self, reader, corrupt=None):
        self.reader, self.reads, self.corrupt = reader, [], corrupt

    def __len__(self):
        return len(self.reader)

    def __getitem__(self, i):
        self.reads.append(int(i))
        if i == self.corrupt:
            return b"\x0a\x05not a proto"
        return self.reader[i]

    def __getitems__(self, indices):
        return [self[i] for i in indices]


def test_parsed_source_gives_what_tfds_python_decoding_gives(written):
    src = source(written)
    parsed = dp_tfds.parsed_source(src)  # supervised keys (image, label)
    assert isinstance(parsed, SerializedSource) and len(parsed) == N
    assert parsed.spec[0].shape == (8, 8, 3) and parsed.spec[0].dtype == tf.uint8
    x_ref, y_ref = python_arrays(src)
    rows = np.array([0, 3, 101, N - 1])
    x, y = parsed.read_examples(rows)
    np.testing.assert_array_equal(x, x_ref[rows])  # PNG decoded bit for bit
    np.testing.assert_array_equal(y, y_ref[rows])
    vectors = dp_tfds.parsed_source(src, keys=("vector", "label")).read_examples(rows)[0]
    np.testing.assert_array_equal(vectors, python_arrays(src, "vector")[0][rows])
    # a transform on the decoded features; variable-length `tokens` present: parsed example by example
    count = lambda f: (tf.cast(tf.size(f["tokens"]), tf.float32) + f["vector"], f["label"])  # noqa: E731
    counted = dp_tfds.parsed_source(src, transform=count).read_examples(rows)[0]
    want = np.stack([src[int(i)]["vector"] + len(src[int(i)]["tokens"]) for i in rows])
    np.testing.assert_allclose(counted, want, rtol=1e-6)


def test_fit_on_a_tfds_data_source_takes_the_graph_path_and_equals_arrays(written):
    src = source(written)
    src.data_source = CountingReader(src.data_source)
    assert isinstance(example_source(src), SerializedSource)  # picked by fit on its own
    x_ref, y_ref = python_arrays(source(written))
    arrays, tfds_path = cnn(), cnn()
    arrays.fit(x_ref, y_ref, batch_size=40, epochs=1, steps_per_epoch=2, sampling_seed=4, verbose=0)
    src.data_source.reads.clear()
    tfds_path.fit(src, batch_size=40, epochs=1, steps_per_epoch=2, sampling_seed=4, verbose=0)
    for a, b in zip(arrays.get_weights(), tfds_path.get_weights()):
        np.testing.assert_array_equal(a, b)  # same batches, same decoded images, same step
    sampler = PoissonSampler(N, 40, None, 4)
    sampled = {int(i) for t in range(12) for i in sampler.batch(t)[0][sampler.batch(t)[1] == 1]}  # + prefetch
    assert set(src.data_source.reads) <= sampled | set(range(HEAD))  # only sampled records are read


def test_a_tensorflow_transform_runs_in_the_graph_a_numpy_one_falls_back_with_a_warning(written):
    src = source(written)
    as_float = lambda f: (tf.cast(f["image"], tf.float32), tf.cast(f["label"], tf.int32))  # noqa: E731
    assert isinstance(example_source(src, transform=as_float), SerializedSource)
    numpy_transform = lambda r: (r["image"].astype(np.float32), np.int32(r["label"]))  # noqa: E731
    with pytest.warns(UserWarning, match="decoded record by record in Python"):
        fallback = example_source(src, transform=numpy_transform)
    assert isinstance(fallback, RecordSource)
    # Python randomness traced into a constant differs from per-call draws: not taken as the graph path
    rng = np.random.default_rng(1)
    noisy = lambda f: (tf.cast(f["image"], tf.float32) + float(rng.normal()), f["label"])  # noqa: E731
    with pytest.warns(UserWarning, match="other values"):
        assert isinstance(example_source(src, transform=noisy), RecordSource)
    graph, python = cnn(), cnn()
    graph.fit(src, transform=as_float, batch_size=40, epochs=1, steps_per_epoch=2, sampling_seed=9, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        python.fit(src, transform=numpy_transform, batch_size=40, epochs=1, steps_per_epoch=2, sampling_seed=9,
                   verbose=0)
    for a, b in zip(graph.get_weights(), python.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_a_record_the_graph_parse_fails_on_is_named_with_its_index_and_spec(written):
    src = source(written)
    rows = [int(i) for i in PoissonSampler(N, 150, None, 0).batch(0)[0][0] if i >= HEAD]
    src.data_source = CountingReader(src.data_source, corrupt=rows[0])
    # Sampled during training: a zero-weight example, named after training (issue 31 item 6), not an exception
    with pytest.warns(UserWarning, match=rf"example {rows[0]}: .*uint8\[8, 8, 3\]"):
        trained = cnn()
        trained.fit(src, batch_size=150, epochs=1, steps_per_epoch=2, sampling_seed=0, verbose=0)
    assert trained.unreadable_examples >= 1 and int(trained.privacy_ledger.steps.numpy()) == 2


def test_without_supervised_keys_the_error_names_the_fix(tmp_path):
    features = tfds.features.FeaturesDict({"a": tfds.features.Tensor(shape=(2,), dtype=np.float32)})
    dp_tfds.write_dataset(tmp_path, "tf_dp_test_nokeys", features,
                          {"train": ((i, {"a": np.full(2, i, np.float32)}) for i in range(4))})
    src = tfds.data_source("tf_dp_test_nokeys:1.0.0", split="train", data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="no supervised_keys: pass keys="):
        example_source(src)
