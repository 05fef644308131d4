"""Ordinary Keras inputs in DP fit: string inputs (TextVectorization, StringLookup, dict
columns of strings, ints and floats) and a LIST of inputs for a multi-input model.

References are independent of tf_dp: per-example gradients by a Python loop over single
examples, clipped and summed by hand (σ = 0; batch_size = N makes q = 1, so the one
Poisson batch holds every example), and the source arrays themselves for the loader."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp.sampling.loader import poisson_loader
from tf_dp.sampling.sources import ArraySource, RecordSource, dataset_source

LR, CLIP = 0.5, 0.3
# Public text: the vocabulary is adapted on these sentences, never on the private examples
# (adapting on the training set would be data-dependent preprocessing outside the guarantee).
PUBLIC_TEXT = ["the cat sat on the mat", "a dog ran in the park", "the bird sang", "a fish swam fast"]
TEXTS = np.array(["the cat sat", "a dog ran fast", "the bird sat on a mat", "fish", "a cat in the park",
                  "the dog sang", "bird swam", "on the mat the cat sat"])
LABELS = np.array([0, 1, 0, 1, 1, 0, 1, 0], "float32")[:, None]


def bce(y_true, y_pred):
    return keras.losses.binary_crossentropy(y_true, y_pred, from_logits=True)


def mse(y_true, y_pred):
    return keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)


def _no_noise():
    return tf_dp.DPSGD(LR, l2_norm_clip=CLIP, noise_multiplier=0.0)


def _row(x, i):
    return tf.nest.map_structure(lambda a: tf.convert_to_tensor(np.asarray(a)[i:i + 1]), x)


def _clipped_step(model, x, y, loss):
    """θ − lr · Σ_i clip_C(g_i) / N, per-example gradients g_i by a loop over single examples."""
    variables = model.trainable_variables
    total = [np.zeros(v.shape, np.float64) for v in variables]
    for i in range(len(y)):
        with tf.GradientTape() as tape:
            value = loss(y[i:i + 1], model(_row(x, i), training=True))[0]
        grads = [np.zeros(v.shape) if g is None else tf.convert_to_tensor(g).numpy().astype(np.float64)
                 for g, v in zip(tape.gradient(value, variables), variables)]
        scale = min(1.0, CLIP / np.sqrt(sum(float(np.sum(g ** 2)) for g in grads)))
        total = [t + scale * g for t, g in zip(total, grads)]
    return [v.numpy() - LR * t / len(y) for v, t in zip(variables, total)]


def _assert_weights(model, expected):
    for variable, value in zip(model.trainable_variables, expected):
        np.testing.assert_allclose(variable.numpy(), value, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------- text
def _text_classifier(mixing: bool = False):
    """keras.io-style: TextVectorization inside the model → Embedding → pooling → Dense."""
    keras.utils.set_random_seed(0)
    vectorize = keras.layers.TextVectorization(max_tokens=24, output_sequence_length=6)
    vectorize.adapt(PUBLIC_TEXT)
    inputs = keras.Input((), dtype="string")
    hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(24, 4)(vectorize(inputs)))
    if mixing:  # subtracts the batch mean: every row depends on every other row
        hidden = keras.layers.Lambda(lambda h: h - keras.ops.mean(h, axis=0, keepdims=True))(hidden)
    model = tf_dp.DPModel(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=_no_noise(), loss=bce)
    return model


TEXT_FORMS = {
    "numpy str": lambda: TEXTS,
    "numpy object of str": lambda: TEXTS.astype(object),
    "list of str": lambda: list(TEXTS),
    "tf.string tensor": lambda: tf.constant(TEXTS),
}


@pytest.mark.parametrize("form", list(TEXT_FORMS))
def test_text_classifier_fits_strings_like_a_per_example_loop(form):
    model = _text_classifier()
    expected = _clipped_step(model, TEXTS, LABELS, bce)
    model.fit(TEXT_FORMS[form](), LABELS, batch_size=len(TEXTS), epochs=1, verbose=0, sampling_seed=0)
    _assert_weights(model, expected)


def test_text_classifier_fits_an_unbatched_string_dataset_like_a_per_example_loop():
    model = _text_classifier()
    expected = _clipped_step(model, TEXTS, LABELS, bce)
    # a map keeps the dataset from being read as plain arrays: read by random access in the graph
    dataset = tf.data.Dataset.from_tensor_slices((TEXTS, LABELS)).map(lambda text, label: (text, label))
    model.fit(dataset, batch_size=len(TEXTS), epochs=1, verbose=0, sampling_seed=0)
    _assert_weights(model, expected)


def test_text_classifier_validation_split_on_strings_trains_on_the_head_only():
    model = _text_classifier()
    expected = _clipped_step(model, TEXTS[:6], LABELS[:6], bce)  # Keras cuts the last 25 % off
    history = model.fit(TEXTS, LABELS, batch_size=6, epochs=1, verbose=0, sampling_seed=0, validation_split=0.25)
    _assert_weights(model, expected)
    assert "val_loss" in history.history


def test_a_string_model_that_mixes_rows_is_refused_by_the_guard():
    """The guard changes one row to ANOTHER string (a real example), never a float perturbation."""
    model = _text_classifier(mixing=True)
    with pytest.raises(ValueError, match="mixes examples: changing example"):
        model.fit(TEXTS.astype(object), LABELS, batch_size=4, epochs=1, verbose=0)


def test_string_padding_rows_are_empty_and_never_a_real_example():
    source = ArraySource(TEXTS.astype(object), LABELS)
    x, _, _ = source.read(np.array([5, 2, 7, 0]), np.array([1, 0, 1, 0]))
    assert list(x) == [TEXTS[5].encode(), b"", TEXTS[7].encode(), b""]
    loader = poisson_loader(source, batch_size=2, physical_batch_size=4, seed=3)
    real_texts = {t.encode() for t in TEXTS}
    padding_seen = 0
    for element in loader.take(6).as_numpy_iterator():
        texts, mask = element["x"].reshape(-1), element["mask"].reshape(-1)
        assert all(t in real_texts for t in texts[mask > 0])
        assert all(t == b"" for t in texts[mask == 0])
        padding_seen += int(np.sum(mask == 0))
    assert padding_seen > 0
    graph_source = dataset_source(tf.data.Dataset.from_tensor_slices((TEXTS, LABELS)).map(lambda t, y: (t, y)))
    x, _, _ = graph_source.graph_read(tf.constant([5, 2, 7], tf.int64), tf.constant([1.0, 0.0, 1.0]))
    assert list(x.numpy()) == [TEXTS[5].encode(), b"", TEXTS[7].encode()]
    records = RecordSource([(str(t), label) for t, label in zip(TEXTS, LABELS)])  # records of Python str
    x, _, _ = records.read(np.array([5, 2, 7]), np.array([1, 0, 1]))
    assert list(x) == [TEXTS[5].encode(), b"", TEXTS[7].encode()]


def test_train_on_batch_and_a_batched_dataset_of_strings_like_a_per_example_loop():
    model = _text_classifier()
    expected = _clipped_step(model, TEXTS, LABELS, bce)
    model.train_on_batch(TEXTS.astype(object), LABELS, batch_size=len(TEXTS))
    _assert_weights(model, expected)
    expected = _clipped_step(model, TEXTS, LABELS, bce)
    dataset = tf.data.Dataset.from_tensor_slices((TEXTS, LABELS)).batch(len(TEXTS), drop_remainder=True)
    with pytest.warns(UserWarning, match="BATCHED"):
        model.fit(dataset, epochs=1, verbose=0)
    _assert_weights(model, expected)


# ------------------------------------------------------- dict of string/int/float
CITIES = np.array(["paris", "rome", "oslo", "lima", "rome", "kyiv", "oslo", "paris"])
COLUMNS = {"city": CITIES, "rooms": np.array([1, 2, 3, 1, 5, 2, 2, 4]),
           "area": np.linspace(0.1, 0.8, 8).astype("float32")}


def _tabular_model():
    """Dict inputs: StringLookup (public vocabulary) and IntegerLookup one-hots, a float column."""
    keras.utils.set_random_seed(0)
    inputs = {"city": keras.Input((), dtype="string", name="city"),
              "rooms": keras.Input((), dtype="int64", name="rooms"),
              "area": keras.Input((), dtype="float32", name="area")}
    city = keras.layers.StringLookup(vocabulary=["paris", "rome", "oslo"], output_mode="one_hot")(inputs["city"])
    rooms = keras.layers.IntegerLookup(vocabulary=[1, 2, 3], output_mode="one_hot")(inputs["rooms"])
    area = keras.layers.Reshape((1,))(inputs["area"])
    hidden = keras.layers.Dense(4, activation="tanh")(keras.layers.Concatenate()([city, rooms, area]))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=_no_noise(), loss=bce)
    return model


def test_dict_of_string_int_float_columns_fits_like_a_per_example_loop():
    model = _tabular_model()
    expected = _clipped_step(model, COLUMNS, LABELS, bce)
    model.fit(COLUMNS, LABELS, batch_size=8, epochs=1, verbose=0, sampling_seed=0)
    _assert_weights(model, expected)


# ---------------------------------------------------------------- list of inputs
X1 = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")
X2 = np.random.default_rng(1).normal(size=(8, 2)).astype("float32")
TARGETS = np.random.default_rng(2).normal(size=(8, 1)).astype("float32")


def _two_inputs():
    keras.utils.set_random_seed(0)
    first, second = keras.Input((3,)), keras.Input((2,))
    hidden = keras.layers.Dense(4, activation="tanh")(keras.layers.Concatenate()([first, second]))
    model = tf_dp.DPModel([first, second], keras.layers.Dense(1)(hidden))
    model.compile(optimizer=_no_noise(), loss=mse)
    return model


def test_a_list_of_inputs_fits_like_a_per_example_loop():
    model = _two_inputs()
    expected = _clipped_step(model, [X1, X2], TARGETS, mse)
    model.fit([X1, X2], TARGETS, batch_size=8, epochs=1, verbose=0, sampling_seed=0)
    _assert_weights(model, expected)


def test_a_list_of_inputs_with_validation_and_sample_weights():
    model = _two_inputs()
    weights = np.linspace(0.5, 2.0, 8).astype("float32")
    weighted = lambda y, p: mse(y, p) * weights_now  # noqa: E731
    weights_now = None
    reference = []  # loop over the first 6 rows with each row's weight in its loss
    variables = model.trainable_variables
    total = [np.zeros(v.shape, np.float64) for v in variables]
    for i in range(6):
        weights_now = weights[i]
        with tf.GradientTape() as tape:
            value = weighted(TARGETS[i:i + 1], model(_row([X1, X2], i), training=True))[0]
        grads = [g.numpy().astype(np.float64) for g in tape.gradient(value, variables)]
        scale = min(1.0, CLIP / np.sqrt(sum(float(np.sum(g ** 2)) for g in grads)))
        total = [t + scale * g for t, g in zip(total, grads)]
    reference = [v.numpy() - LR * t / 6 for v, t in zip(variables, total)]
    history = model.fit([X1, X2], TARGETS, batch_size=6, epochs=1, verbose=0, sampling_seed=0,
                        validation_split=0.25, sample_weight=weights)
    _assert_weights(model, reference)
    assert "val_loss" in history.history
    model.fit([X1, X2], TARGETS, batch_size=4, epochs=1, verbose=0, validation_data=([X1, X2], TARGETS))


def test_train_on_batch_with_a_list_of_inputs_like_a_per_example_loop():
    model = _two_inputs()
    expected = _clipped_step(model, [X1, X2], TARGETS, mse)
    model.train_on_batch([X1, X2], TARGETS, batch_size=8)
    _assert_weights(model, expected)


def test_lstm_seq2seq_fits_a_list_of_encoder_and_decoder_inputs_like_a_per_example_loop():
    """keras.io character-level seq2seq, small: fit([encoder_input, decoder_input], decoder_target)."""
    keras.utils.set_random_seed(0)
    tokens, steps, units, count = 5, 4, 3, 6
    rng = np.random.default_rng(4)
    one_hot = lambda ids: np.eye(tokens, dtype="float32")[ids]  # noqa: E731
    encoder_data = one_hot(rng.integers(0, tokens, (count, steps)))
    decoder_data = one_hot(rng.integers(0, tokens, (count, steps)))
    decoder_target = one_hot(rng.integers(0, tokens, (count, steps)))
    encoder_inputs = keras.Input((None, tokens))
    _, state_h, state_c = keras.layers.LSTM(units, return_state=True)(encoder_inputs)
    decoder_inputs = keras.Input((None, tokens))
    decoded = keras.layers.LSTM(units, return_sequences=True)(decoder_inputs, initial_state=[state_h, state_c])
    outputs = keras.layers.Dense(tokens)(decoded)
    model = tf_dp.DPModel([encoder_inputs, decoder_inputs], outputs)
    loss = lambda y, p: keras.ops.mean(  # noqa: E731
        keras.losses.categorical_crossentropy(y, p, from_logits=True), axis=-1)
    model.compile(optimizer=_no_noise(), loss=loss)
    expected = _clipped_step(model, [encoder_data, decoder_data], decoder_target, loss)
    model.fit([encoder_data, decoder_data], decoder_target, batch_size=count, epochs=1, verbose=0, sampling_seed=0)
    _assert_weights(model, expected)


class FeatureSpaceClassifier(tf_dp.DPModel):
    """A dict-input model with a keras.utils.FeatureSpace inside (it cannot be called on
    symbolic keras.Input tensors, so the model is subclassed)."""

    def __init__(self, feature_space):
        super().__init__()
        self.feature_space, self.hidden, self.head = feature_space, keras.layers.Dense(4, activation="tanh"), \
            keras.layers.Dense(1)

    def call(self, inputs):
        return self.head(self.hidden(self.feature_space(inputs)))


def test_feature_space_on_dict_columns_fits_like_a_per_example_loop():
    keras.utils.set_random_seed(0)
    space = keras.utils.FeatureSpace
    feature_space = space(features={"city": space.string_categorical(num_oov_indices=1),
                                    "rooms": space.integer_categorical(num_oov_indices=1),
                                    "area": space.float_normalized()}, output_mode="concat")
    public = {"city": np.array(["paris", "rome", "oslo", "rome"]), "rooms": np.array([1, 2, 3, 1]),
              "area": np.array([0.3, 0.4, 0.5, 0.2], "float32")}
    feature_space.adapt(tf.data.Dataset.from_tensor_slices(public))  # public rows: no private vocabulary or mean
    model = FeatureSpaceClassifier(feature_space)
    model.compile(optimizer=_no_noise(), loss=bce)
    model(_row(COLUMNS, 0))  # built before the reference loop reads its weights
    expected = _clipped_step(model, COLUMNS, LABELS, bce)
    model.fit(COLUMNS, LABELS, batch_size=8, epochs=1, verbose=0, sampling_seed=0)
    _assert_weights(model, expected)
