"""Issue 33 items 3-7: keras.io patterns that users write, against plain Keras' behaviour.

A siamese network whose Lambda calls a plain function (``tf_dp.fix`` copies it as plain Keras
runs it), a dict-output functional model (``make_private`` keeps the dict), a FeatureSpace with
``num_oov_indices=0`` (refused before any step, naming the feature: padding rows would be
rejected by its lookup), a switch-transformer-like model that hard-codes its batch size (refused
naming it, in fit and train_on_batch), and Keras' four dataset utilities on tiny on-disk data
(each trains as what it is, with ε from dp_accounting directly, or is named in the warning)."""

import os

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp

SIGMA, DELTA = 1.0, 1e-5


def _dp_sgd(sigma=SIGMA):
    return tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=sigma)


# ---------------------------------------------------------------- item 4: a Lambda of a plain function
def euclidean_distance(vectors):
    """keras.io siamese network's distance: a module-level function, not registered with Keras."""
    x, y = vectors
    return keras.ops.sqrt(keras.ops.maximum(keras.ops.sum(keras.ops.square(x - y), axis=1, keepdims=True),
                                            keras.backend.epsilon()))


def _siamese(normalization):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    embedding = keras.Model(inputs, keras.layers.Dense(3)(normalization()(inputs)))
    left, right = keras.Input((4,)), keras.Input((4,))

    def scaled(vectors):  # a local function too
        return 2.0 * euclidean_distance(vectors)

    distance = keras.layers.Lambda(scaled, output_shape=(1,))([embedding(left), embedding(right)])
    return keras.Model([left, right], keras.layers.Dense(1, activation="sigmoid")(distance))


def _pairs():
    rng = np.random.default_rng(0)
    return [rng.normal(size=(8, 4)).astype("float32") for _ in range(2)], (np.arange(8) % 2).astype("float32")


def test_fix_copies_a_lambda_of_a_plain_function_as_plain_keras_runs_it():
    model = _siamese(keras.layers.LayerNormalization)  # no BatchNormalization: the copy computes the same
    pairs, _ = _pairs()
    fixed = tf_dp.fix(model)
    np.testing.assert_allclose(np.asarray(fixed(pairs)), np.asarray(model(pairs)), rtol=1e-6)


def test_fix_replaces_batch_norm_in_a_siamese_with_a_plain_function_lambda_and_it_trains():
    pairs, labels = _pairs()
    fixed = tf_dp.fix(_siamese(keras.layers.BatchNormalization))
    lambdas = [layer for layer in fixed.layers if isinstance(layer, keras.layers.Lambda)]
    assert lambdas and lambdas[0].function.__name__ == "scaled"
    net = tf_dp.make_private(fixed)
    net.compile(optimizer=_dp_sgd(), loss="binary_crossentropy")
    net.fit(pairs, labels, batch_size=4, epochs=1, verbose=0)
    assert int(net.privacy_ledger.steps.numpy()) > 0


# ---------------------------------------------------------------- item 5: dict outputs stay a dict
def _dict_model():
    keras.utils.set_random_seed(0)
    title, body = keras.Input((3,), name="title"), keras.Input((2,), name="body")
    hidden = keras.layers.Concatenate()([title, body])
    return keras.Model({"title": title, "body": body},
                       {"priority": keras.layers.Dense(1, name="priority")(hidden),
                        "department": keras.layers.Dense(4, name="department")(hidden)})


def test_make_private_of_a_dict_output_model_returns_dicts_like_the_model():
    model = _dict_model()
    x = {"title": np.ones((5, 3), "float32"), "body": np.full((5, 2), 0.5, "float32")}
    net = tf_dp.make_private(model)
    for ours, theirs in ((net(x), model(x)), (net.predict(x, verbose=0), model.predict(x, verbose=0))):
        assert isinstance(ours, dict) and set(ours) == set(theirs) == {"priority", "department"}
        for name in theirs:
            np.testing.assert_allclose(np.asarray(ours[name]), np.asarray(theirs[name]), rtol=1e-6)
    net.compile(optimizer=_dp_sgd(), loss={"priority": "mse", "department": "sparse_categorical_crossentropy"})
    net.fit(x, {"priority": np.ones((5, 1), "float32"), "department": np.zeros(5, "int32")}, batch_size=2,
            epochs=1, verbose=0)
    assert isinstance(net.predict(x, verbose=0)["priority"], np.ndarray)


# ---------------------------------------------------------------- item 6: FeatureSpace, num_oov_indices=0
class FeatureSpaceClassifier(tf_dp.DPModel):
    """A dict-input model with a keras.utils.FeatureSpace inside."""

    def __init__(self, feature_space):
        super().__init__()
        self.feature_space, self.head = feature_space, keras.layers.Dense(1)

    def call(self, inputs):
        return self.head(self.feature_space(inputs))


COLUMNS = {"thal": np.array(["fixed", "normal", "reversible", "normal"] * 2),
           "age": np.linspace(0.1, 0.8, 8).astype("float32")}


def _feature_space(oov):
    space = keras.utils.FeatureSpace
    feature_space = space(features={"thal": space.string_categorical(num_oov_indices=oov),
                                    "age": space.float_normalized()}, output_mode="concat")
    feature_space.adapt(tf.data.Dataset.from_tensor_slices(  # public rows
        {"thal": np.array(["fixed", "normal", "reversible"]), "age": np.array([0.2, 0.4, 0.6], "float32")}))
    return feature_space


def test_a_feature_space_with_no_oov_index_is_refused_before_any_step_naming_the_feature():
    labels = (np.arange(8) % 2).astype("float32")[:, None]
    plain_space = _feature_space(0)  # plain Keras trains it (its batches have no padding rows)
    plain = keras.Sequential([keras.layers.Dense(1)])
    plain.compile(optimizer="sgd", loss="mse")
    plain.fit(plain_space(COLUMNS), labels, batch_size=4, epochs=1, verbose=0)
    net = FeatureSpaceClassifier(_feature_space(0))
    net.compile(optimizer=_dp_sgd(), loss="mse")
    with pytest.raises(ValueError, match=r"(?s)feature 'thal' of FeatureSpace.*num_oov_indices=0.*"
                                         r"Fix: num_oov_indices=1"):
        net.fit(COLUMNS, labels, batch_size=3, epochs=1, verbose=0)
    assert int(net.privacy_ledger.steps.numpy()) == 0
    net = FeatureSpaceClassifier(_feature_space(1))  # the fix trains
    net.compile(optimizer=_dp_sgd(), loss="mse")
    net.fit(COLUMNS, labels, batch_size=3, epochs=1, verbose=0)
    assert int(net.privacy_ledger.steps.numpy()) > 0


# ---------------------------------------------------------------- item 7: a hard-coded batch size
BATCH, TOKENS, EMBED = 10, 3, 2


class Router(keras.layers.Layer):
    """keras.io switch transformer's habit: tokens reshaped with the batch size written in."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4)

    def call(self, x):
        tokens = keras.ops.reshape(x, (BATCH * TOKENS, EMBED))
        return keras.ops.reshape(self.dense(tokens), (BATCH, TOKENS * 4))


def _switch_like():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((TOKENS, EMBED))
    return keras.Model(inputs, keras.layers.Dense(1)(Router()(inputs)))


def test_a_model_with_a_hard_coded_batch_size_is_refused_naming_it():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, TOKENS, EMBED)).astype("float32"), rng.normal(size=(40, 1)).astype("float32")
    plain = _switch_like()  # plain Keras trains it on batches of exactly 10
    plain.compile(optimizer="sgd", loss="mse")
    plain.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    for run in (lambda net: net.fit(x, y, batch_size=16, epochs=1, verbose=0),
                lambda net: net.train_on_batch(x[:BATCH], y[:BATCH])):
        net = tf_dp.make_private(_switch_like())
        net.compile(optimizer=_dp_sgd(), loss="mse")
        with pytest.raises(ValueError, match=r"(?s)runs only on batches of exactly 10 examples.*Fix:.*-1"):
            run(net)
        assert int(net.privacy_ledger.steps.numpy()) == 0


# ---------------------------------------------------------------- item 3: Keras' dataset utilities
def _files(root):
    """Two classes of three tiny images, texts and WAV clips each."""
    for name in ("cat", "dog"):
        for kind in ("image", "text", "audio"):
            os.makedirs(os.path.join(root, kind, name))
        for i in range(3):
            keras.utils.save_img(os.path.join(root, "image", name, f"{i}.png"),
                                 np.full((4, 4, 3), 40 * i + (name == "dog") * 100, "uint8"))
            with open(os.path.join(root, "text", name, f"{i}.txt"), "w") as handle:
                handle.write(f"{name} says {i}")
            tf.io.write_file(os.path.join(root, "audio", name, f"{i}.wav"),
                             tf.audio.encode_wav(tf.fill((16, 1), 0.1 * i), 8000))


def _flat_model(shape, classes=2):
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape)
    return tf_dp.DPModel(inputs, keras.layers.Dense(classes)(keras.layers.Flatten()(inputs)))


def _text_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((), dtype="string")
    words = keras.layers.TextVectorization(output_mode="multi_hot", vocabulary=["cat", "dog", "says"])(inputs)
    return tf_dp.DPModel(inputs, keras.layers.Dense(2)(words))


def _utilities(root, batch_size):
    """{utility: (dataset, model, number of examples)} built as keras.io builds them."""
    series = np.arange(20, dtype="float32")[:, None]
    utils = keras.utils
    return {
        "timeseries_dataset_from_array": (utils.timeseries_dataset_from_array(
            series, (np.arange(20) % 2).astype("int32"), sequence_length=4, batch_size=batch_size, shuffle=True,
            seed=1), _flat_model((4, 1)), 17),
        "image_dataset_from_directory": (utils.image_dataset_from_directory(
            os.path.join(root, "image"), image_size=(4, 4), batch_size=batch_size, seed=1, verbose=False),
            _flat_model((4, 4, 3)), 6),
        "text_dataset_from_directory": (utils.text_dataset_from_directory(
            os.path.join(root, "text"), batch_size=batch_size, seed=1, verbose=False), _text_model(), 6),
        "audio_dataset_from_directory": (utils.audio_dataset_from_directory(
            os.path.join(root, "audio"), batch_size=batch_size, output_sequence_length=16, seed=1, verbose=False),
            _flat_model((16, 1)), 6),
    }


def _epsilon(event, steps):
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(event, steps)
    return accountant.get_epsilon(DELTA)


@pytest.mark.parametrize("utility", ["timeseries_dataset_from_array", "image_dataset_from_directory",
                                     "text_dataset_from_directory", "audio_dataset_from_directory"])
def test_keras_dataset_utilities_train_as_what_they_are(utility, tmp_path):
    _files(str(tmp_path))
    batch = 2
    dataset, net, count = _utilities(str(tmp_path), batch)[utility]
    net.compile(optimizer=_dp_sgd(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.warns(UserWarning, match=rf"BATCHED(?s:.*)keras\.utils\.{utility}'s: call it with batch_size=None"):
        net.fit(dataset, epochs=1, verbose=0)  # batches as they are: full Gaussian steps, no amplification
    steps = int(net.privacy_ledger.steps.numpy())
    assert steps == -(-count // batch)
    assert net.privacy_ledger.epsilon(DELTA) == pytest.approx(_epsilon(dp_accounting.GaussianDpEvent(SIGMA), steps),
                                                              rel=1e-3)
    dataset, net, count = _utilities(str(tmp_path), None)[utility]  # examples: Poisson-sampled, amplified
    net.compile(optimizer=_dp_sgd(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    net.fit(dataset, batch_size=batch, epochs=1, verbose=0)
    steps = int(net.privacy_ledger.steps.numpy())
    assert steps == -(-count // batch)
    event = dp_accounting.PoissonSampledDpEvent(batch / count, dp_accounting.GaussianDpEvent(SIGMA))
    assert net.privacy_ledger.epsilon(DELTA) == pytest.approx(_epsilon(event, steps), rel=1e-3)


def test_overlapping_windows_warn_that_the_privacy_unit_is_a_window():
    series = np.arange(20, dtype="float32")[:, None]
    dataset = keras.utils.timeseries_dataset_from_array(series, (np.arange(20) % 2).astype("int32"),
                                                        sequence_length=4, batch_size=None)
    net = _flat_model((4, 1))
    net.compile(optimizer=_dp_sgd(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.warns(UserWarning, match=r"timeseries_dataset_from_array's(?s:.*)privacy unit is one window"):
        net.fit(dataset, batch_size=4, epochs=1, verbose=0)


def test_a_refused_utility_pipeline_is_named_with_what_to_pass_instead(tmp_path):
    _files(str(tmp_path))
    dataset = keras.utils.image_dataset_from_directory(os.path.join(str(tmp_path), "image"), image_size=(4, 4),
                                                       batch_size=2, seed=1, verbose=False)
    net = _flat_model((4, 4, 3))
    net.compile(optimizer=_dp_sgd(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match=r"(?s)map\(\).*whole batches.*image_dataset_from_directory's: call it with "
                                         r"batch_size=None"):
        net.fit(dataset.map(lambda x, y: (tf.reverse(x, [0]), y)), epochs=1, verbose=0)  # a map over whole batches
    assert int(net.privacy_ledger.steps.numpy()) == 0
