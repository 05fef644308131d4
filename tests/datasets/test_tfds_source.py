"""TFDS end to end offline: MNIST from the registry package written to
ArrayRecord in a temporary data_dir, read back with tfds.data_source, Poisson-sampled by
fit — the same seed gives the same batches and the same weights as the arrays path."""

import keras
import numpy as np
import pytest

pytest.importorskip("tensorflow_datasets", reason="tensorflow-datasets is not installed (pip install tf-dp[datasets])")
pytest.importorskip("array_record", reason="array-record is not installed (pip install tf-dp[datasets])")

import tf_dp  # noqa: E402
from tf_dp.data import load_mnist  # noqa: E402
from tf_dp.data import tfds as dp_tfds  # noqa: E402

LIMIT = 1200


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    try:
        load_mnist()
    except (ImportError, FileNotFoundError) as error:
        pytest.skip(f"MNIST package missing: {error}")
    data_dir = tmp_path_factory.mktemp("tfds")
    dp_tfds.write_mnist(data_dir, limit=LIMIT)
    return data_dir


def mlp():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((784,))
    m = tf_dp.DPModel(inputs, keras.layers.Dense(10)(keras.layers.Dense(16, activation="relu")(inputs)))
    m.compile(optimizer=tf_dp.DPSGD(0.5, l2_norm_clip=1.0, noise_multiplier=1.1, seed=7),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return m


def test_the_data_source_holds_the_arrays_in_order(written):
    source = dp_tfds.mnist_source(written)
    data = load_mnist(flatten=True)
    assert len(source) == LIMIT
    for i in (0, 1, 599, LIMIT - 1):
        x, y = dp_tfds.mnist_flat_example(source[i])
        np.testing.assert_array_equal(x, data.x_train[i])  # bit for bit: pixel / 255 in float32
        assert y == data.y_train[i]


def test_fit_through_tfds_equals_fit_on_arrays_with_the_same_seed(written):
    data = load_mnist(flatten=True)
    x, y = data.x_train[:LIMIT], data.y_train[:LIMIT]
    arrays, tfds_path = mlp(), mlp()
    arrays.fit(x, y, batch_size=64, epochs=1, steps_per_epoch=4, sampling_seed=11, verbose=0)
    tfds_path.fit(dp_tfds.mnist_source(written), transform=dp_tfds.mnist_flat_example, batch_size=64, epochs=1,
                  steps_per_epoch=4, sampling_seed=11, verbose=0)
    for a, b in zip(arrays.get_weights(), tfds_path.get_weights()):
        np.testing.assert_array_equal(a, b)  # same batches, same noise, same steps
    assert arrays.get_epsilon() == tfds_path.get_epsilon()
    parsed_in_graph = mlp()
    parsed_in_graph.fit(dp_tfds.mnist_examples(written, flatten=True), batch_size=64, epochs=1, steps_per_epoch=4,
                        sampling_seed=11, verbose=0)
    for a, b in zip(arrays.get_weights(), parsed_in_graph.get_weights()):
        np.testing.assert_array_equal(a, b)
    test = (data.x_test[:500], data.y_test[:500])
    assert arrays.evaluate(*test, verbose=0) == tfds_path.evaluate(*test, verbose=0)
