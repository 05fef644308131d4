"""Users' own Keras code made private with one line works as in plain Keras, or is refused
before training with the fix: Sequential models, string losses with labels [B] against
outputs [B, 1], outputs without a loss, .h5 files, numpy labels in clipped_gradient_sum.

References are independent of tf_dp: plain Keras' own loss (``compute_loss`` of a plain
compiled model, example by example) and per-example gradients by a Python loop."""

import inspect
import json

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.harness import loop_per_example_gradients, sparse_ce
from tf_dp.clipping import clipped_gradient_sum
from tf_dp.models.losses import per_example_loss

FEATURES, BATCH, LR, CLIP = 4, 6, 0.5, 0.3


def _data(seed=0, labels="binary"):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(BATCH, FEATURES)).astype("float32")
    y = (rng.uniform(size=BATCH) > 0.5).astype("float32") if labels == "binary" else rng.integers(0, 3, BATCH)
    return x, y


def _no_noise():
    return tf_dp.DPSGD(LR, l2_norm_clip=CLIP, noise_multiplier=0.0)


def _loop_gradients(model, x, y, loss):
    """Per-example gradients by a Python loop over single examples (zeros where a variable gets none)."""
    grads = []
    for i in range(len(y)):
        with tf.GradientTape() as tape:
            value = loss(y[i:i + 1], model(x[i:i + 1], training=True))[0]
        grads.append([np.zeros(v.shape, "float32") if g is None else g.numpy()
                      for g, v in zip(tape.gradient(value, model.trainable_variables), model.trainable_variables)])
    return grads


def _clipped_step(model, x, y, loss, batch_size=BATCH):
    """θ − lr · Σ_i clip_C(g_i) / L from per-example gradients by a loop (σ = 0)."""
    grads = _loop_gradients(model, x, y, loss)
    norms = [np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in example)) for example in grads]
    total = [sum(min(1.0, CLIP / n) * example[j] for example, n in zip(grads, norms))
             for j in range(len(model.trainable_variables))]
    return [v.numpy() - LR * t / batch_size for v, t in zip(model.trainable_variables, total)]


def _assert_weights(model, expected):
    for variable, value in zip(model.trainable_variables, expected):
        np.testing.assert_allclose(variable.numpy(), value, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ Sequential
def _sequential(with_input: bool):
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)]
    return keras.Sequential(([keras.Input((FEATURES,))] if with_input else []) + layers)


@pytest.mark.parametrize("with_input", [True, False], ids=["keras.Input", "unbuilt"])
def test_make_private_of_a_sequential_trains_its_own_weights_like_a_per_example_loop(with_input):
    plain = _sequential(with_input)
    private = tf_dp.make_private(plain)
    assert isinstance(private, tf_dp.DPSequential) and private.built == with_input
    x, y = _data(labels="classes")
    private.compile(optimizer=_no_noise(), loss=sparse_ce)
    if not with_input:
        plain(x[:1])  # plain Keras builds on the first call; the private model shares the layers
    expected = _clipped_step(plain, x, y, sparse_ce)
    private.train_on_batch(x, y, batch_size=BATCH)
    assert [id(v) for v in private.trainable_variables] == [id(v) for v in plain.trainable_variables]
    _assert_weights(plain, expected)
    np.testing.assert_array_equal(private.predict(x, verbose=0), plain.predict(x, verbose=0))
    again = tf_dp.make_private(plain)  # the ledger belongs to the weights: it continues
    assert int(again.privacy_ledger.steps.numpy()) == 1


def test_make_private_refuses_a_sequential_subclass_whose_call_it_cannot_carry():
    class Doubling(keras.Sequential):
        def call(self, inputs, training=None, mask=None):
            return 2.0 * super().call(inputs, training=training, mask=mask)

    model = Doubling([keras.Input((FEATURES,)), keras.layers.Dense(2)])
    with pytest.raises(TypeError, match="call.*Doubling.*subclass tf_dp.DPSequential"):
        tf_dp.make_private(model)


# ------------------------------------------------ string losses, labels [B] vs outputs [B, 1]
def _string_losses():
    from keras.src.losses import ALL_OBJECTS_DICT

    names = sorted(name for name, obj in ALL_OBJECTS_DICT.items() if not inspect.isclass(obj) and name != "ctc")
    return names + ["crossentropy", "ce"]


BATCH_MIXING = {"circle", "dice", "tversky"}  # reduce over or pair up the batch: refused by tf_dp


def _keras_per_example(name, y, y_pred):
    """Plain Keras' loss of each example: a plain model compiled with ``name``, one example at a time."""
    inputs = keras.Input((1,))
    plain = keras.Model(inputs, inputs)
    plain.compile(loss=name)
    return np.array([float(plain.compute_loss(y=y[i:i + 1], y_pred=y_pred[i:i + 1])) for i in range(len(y))])


@pytest.mark.parametrize("as_function", [False, True], ids=["string", "keras.losses.get"])
@pytest.mark.parametrize("name", _string_losses())
def test_every_string_loss_gives_keras_per_example_values_for_rank_one_labels(name, as_function):
    rng = np.random.default_rng(1)
    y = tf.constant((np.arange(BATCH) % 2).astype("float32"))  # [B]
    y_pred = tf.constant(rng.uniform(0.05, 0.95, size=(BATCH, 1)).astype("float32"))  # [B, 1]
    try:
        expected = _keras_per_example(name, y, y_pred)
    except (ValueError, TypeError, tf.errors.InvalidArgumentError):
        pytest.skip(f"plain Keras refuses {name!r} for labels [B] and outputs [B, 1]")
    if as_function and name in ("crossentropy", "ce"):
        pytest.skip("chosen by shapes: a compile string only")
    loss = keras.losses.get(name) if as_function else name  # the function object Keras resolves it to
    if name in BATCH_MIXING:
        with pytest.raises(ValueError, match="`loss`"):
            per_example_loss(loss)(y, y_pred)
        return
    np.testing.assert_allclose(per_example_loss(loss)(y, y_pred).numpy(), expected, rtol=1e-5, atol=1e-7)


def test_binary_crossentropy_string_with_rank_one_labels_trains_like_a_per_example_loop():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(1, activation="sigmoid")(inputs))
    model.compile(optimizer=_no_noise(), loss="binary_crossentropy")
    x, y = _data()

    def keras_bce(y_true, y_pred):  # plain Keras' own wrapper: aligns [1] with [1, 1]
        return keras.losses.BinaryCrossentropy(reduction=None)(y_true, y_pred)

    expected = _clipped_step(model, x, y, keras_bce)
    model.train_on_batch(x, y, batch_size=BATCH)
    _assert_weights(model, expected)


# ------------------------------------------------------- outputs without a loss
def _two_outputs(dp: bool):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(5, activation="tanh", name="hidden")(inputs)
    outputs = [keras.layers.Dense(1, name="value")(hidden), keras.layers.Dense(2, name="aux")(hidden)]
    return (tf_dp.DPModel if dp else keras.Model)(inputs, outputs)


def _first_output_mse(y_true, outputs):
    return keras.losses.MeanSquaredError(reduction=None)(y_true, outputs[0])


TARGETS = {"y": lambda y: y, "[y, None]": lambda y: [y, None], "(y, None)": lambda y: (y, None)}


@pytest.mark.parametrize("form", list(TARGETS))
def test_an_output_without_a_loss_takes_no_targets_as_in_keras(form):
    x, y = _data()
    y = y[:, None]
    plain = _two_outputs(dp=False)
    plain.compile(optimizer="sgd", loss=["mse", None])
    private = _two_outputs(dp=True)
    private.set_weights(plain.get_weights())
    private.compile(optimizer=_no_noise(), loss=["mse", None])
    keras_loss = float(plain.compute_loss(y=TARGETS[form](y), y_pred=plain(x)))
    targets = tf_dp.models.losses.without_unused_targets(private._dp_loss, TARGETS[form](y))
    np.testing.assert_allclose(np.mean(private._dp_loss(targets, private(x))), keras_loss, rtol=1e-6)
    expected = _clipped_step(private, x, y, _first_output_mse)
    private.train_on_batch(x, TARGETS[form](y), batch_size=BATCH)
    _assert_weights(private, expected)  # the aux head, which has no loss, gets no gradient


@pytest.mark.parametrize("form", ["y", "(y, None)"])
def test_an_output_without_a_loss_in_batched_datasets_and_poisson_fit(form):
    x, y = _data()
    y = y[:, None]
    private = _two_outputs(dp=True)
    private.compile(optimizer=_no_noise(), loss=["mse", None])
    expected = _clipped_step(private, x, y, _first_output_mse)
    dataset = tf.data.Dataset.from_tensor_slices((x, TARGETS[form](y))).batch(BATCH, drop_remainder=True)
    with pytest.warns(UserWarning, match="BATCHED"):
        private.fit(dataset, epochs=1, verbose=0)
    _assert_weights(private, expected)

    poisson = _two_outputs(dp=True)
    poisson.compile(optimizer=_no_noise(), loss=["mse", None])
    expected = _clipped_step(poisson, x, y, _first_output_mse)
    # L = N: q = 1, so the one Poisson batch holds every example (as the loop does)
    poisson.fit(x, TARGETS[form](y), batch_size=BATCH, epochs=1, verbose=0, sampling_seed=0)
    _assert_weights(poisson, expected)


def test_none_targets_for_an_output_that_has_a_loss_are_refused():
    x, y = _data()
    private = _two_outputs(dp=True)
    private.compile(optimizer=_no_noise(), loss=["mse", "mse"])
    with pytest.raises(ValueError, match=r"`y\[1\]` is None, but output 'aux' has a loss"):
        private.train_on_batch(x, [y[:, None], None], batch_size=BATCH)


# ---------------------------------------------------------------- .h5 files
def _trained_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=2), loss="mse")
    return model


def test_saving_a_dp_model_to_h5_is_refused_with_the_keras_fix(tmp_path):
    model = _trained_model()
    x, y = _data()
    model.train_on_batch(x, y, batch_size=BATCH)
    for save in (model.save, lambda path: keras.saving.save_model(model, path)):
        with pytest.raises(ValueError, match=r"\.h5 format cannot carry the privacy ledger.*\.keras"):
            save(str(tmp_path / "best_model.h5"))
    best = tmp_path / "best_model.h5"
    assert not best.exists() or "model_config" not in h5py.File(best).attrs


def test_an_h5_checkpoint_is_refused_before_training_and_a_keras_one_carries_the_ledger(tmp_path):
    model = _trained_model()
    x, y = _data()
    before = model.get_weights()
    with pytest.raises(ValueError, match=r"ModelCheckpoint\('.*best_model.h5'\).*\.keras"):
        model.fit(x, y, batch_size=3, epochs=1, verbose=0,
                  callbacks=[keras.callbacks.ModelCheckpoint(str(tmp_path / "best_model.h5"))])
    assert int(model.privacy_ledger.steps.numpy()) == 0  # refused before any step
    for weight, value in zip(model.get_weights(), before):
        np.testing.assert_array_equal(weight, value)
    path = str(tmp_path / "best_model.keras")
    model.fit(x, y, batch_size=3, epochs=1, verbose=0, callbacks=[keras.callbacks.ModelCheckpoint(path)])
    loaded = keras.models.load_model(path)
    assert int(loaded.privacy_ledger.steps.numpy()) == int(model.privacy_ledger.steps.numpy()) == 2
    assert loaded.get_epsilon() == pytest.approx(model.get_epsilon())


def test_loading_an_h5_file_of_a_dp_model_is_refused_with_the_keras_fix(tmp_path):
    """A DP model in .h5 (as older tf_dp wrote them): its weights come without their ledger."""
    inputs = keras.Input((FEATURES,))
    plain = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    path = str(tmp_path / "old.h5")
    plain.save(path)
    with h5py.File(path, "r+") as f:
        config = json.loads(f.attrs["model_config"])
        config["class_name"] = "DPFunctional"
        f.attrs["model_config"] = json.dumps(config).encode("utf8")
    with pytest.raises(ValueError, match=r"without its privacy ledger.*\.keras"):
        keras.models.load_model(path)


# -------------------------------------------- clipped_gradient_sum with numpy labels
@pytest.mark.parametrize("engine", ["ghost", "vectorized"])
@pytest.mark.parametrize("dtype", ["int64", "float32"])
def test_clipped_gradient_sum_takes_numpy_labels(dtype, engine):
    model = _sequential(with_input=True)
    x, y = _data(labels="classes")
    y = y.astype(dtype)
    result = clipped_gradient_sum(model, per_example_loss(keras.losses.SparseCategoricalCrossentropy(from_logits=True)),
                                  x, y, np.ones(BATCH, "float32"), CLIP, engine=engine)
    grads = loop_per_example_gradients(model, x, y.astype("int64"))
    norms = [np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in example)) for example in grads]
    for j, clipped in enumerate(result.clipped_sums):
        expected = sum(min(1.0, CLIP / n) * example[j] for example, n in zip(grads, norms))
        np.testing.assert_allclose(clipped.numpy(), expected, rtol=1e-5, atol=1e-6)
