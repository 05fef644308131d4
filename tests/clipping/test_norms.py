"""tf_dp.clipping.per_example_gradient_norms: the debug norms are the norms DP training clips.

ℓ_i is the training loss (tf_dp.models.losses: reduced per example, weighted by the example's
sample or class weight). References, independent of tf_dp's engine: a Python loop over single
examples evaluating the Keras loss WITH the example's own weight (Keras' reduction on a batch
of one), and the update of a real DPSGD train step (σ = 0) clipped at the median norm, which
depends on the norms the step clipped against."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp.clipping import per_example_gradient_norms

P, T, V, FEATURES, CLASSES = 6, 5, 11, 4, 3
ENGINES = ["ghost", "vectorized"]
SPARSE_CE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def dense_model():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
    return tf_dp.DPModel(inputs, keras.layers.Dense(CLASSES, name="head")(hidden))


def sequence_model():
    keras.utils.set_random_seed(2)
    inputs = keras.Input((T,), dtype="int32")
    hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(keras.layers.Embedding(V, 6, name="embed")(inputs))
    return tf_dp.DPModel(inputs, keras.layers.Dense(V, name="head")(hidden))


def dense_batch(rng):
    w = rng.uniform(0.2, 3.0, P).astype("float32")
    w[0] = 0.0  # an example that weighs nothing: its gradient is 0
    return rng.normal(size=(P, FEATURES)).astype("float32"), rng.integers(0, CLASSES, P).astype("int32"), w


def sequence_batch(rng):
    x, y = rng.integers(1, V, (P, T)).astype("int32"), rng.integers(0, V, (P, T)).astype("int32")
    w = (rng.uniform(size=(P, T)) < 0.7).astype("float32") * rng.uniform(0.5, 2.0, (P, T)).astype("float32")
    w[1, :] = 1.0
    return x, y, w


def loop_gradients(model, loss, x, y, w):
    """g_i = ∇ loss(y_i, f(x_i), sample_weight=w_i) on a batch of one, per variable (float64)."""
    gradients = []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            value = loss(y[i:i + 1], model(x[i:i + 1], training=True), sample_weight=None if w is None else w[i:i + 1])
        gradients.append([np.zeros(v.shape) if g is None else np.asarray(tf.convert_to_tensor(g), np.float64)
                          for v, g in zip(model.trainable_variables, tape.gradient(value, model.trainable_variables))])
    return gradients


def loop_norms(model, gradients, layer=None):
    """‖g_i‖ over all variables, or over those of ``layer`` only."""
    owned = None if layer is None else {id(v) for v in model.get_layer(layer).trainable_variables}
    return np.array([np.sqrt(sum(np.sum(g ** 2) for v, g in zip(model.trainable_variables, grads)
                                 if owned is None or id(v) in owned)) for grads in gradients])


def class_weights(y, class_weight):
    return np.array([class_weight.get(int(label), 1.0) for label in y], "float32")


CASES = {  # name → (model, batch, weights passed to the debug norms and to train_on_batch)
    "sample_weight": lambda rng: (dense_model(), dense_batch(rng), "sample_weight"),
    "per_token_sample_weight": lambda rng: (sequence_model(), sequence_batch(rng), "sample_weight"),
    "class_weight": lambda rng: (dense_model(), dense_batch(rng), "class_weight"),
}
CLASS_WEIGHT = {0: 0.25, 2: 4.0}  # class 1 not listed: weight 1, as in Keras


def case(name):
    model, (x, y, w), kind = CASES[name](np.random.default_rng(7))
    if kind == "class_weight":
        return model, x, y, class_weights(y, CLASS_WEIGHT), {"class_weight": CLASS_WEIGHT}
    return model, x, y, w, {"sample_weight": w}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_weighted_debug_norms_match_a_per_example_loop(name, engine):
    model, x, y, w, weights = case(name)
    gradients = loop_gradients(model, SPARSE_CE, x, y, w)
    total, per_layer = per_example_gradient_norms(model, SPARSE_CE, x, y, engine=engine, **weights)
    np.testing.assert_allclose(total.numpy(), loop_norms(model, gradients), rtol=1e-5, atol=1e-7)
    assert set(per_layer) == {layer.name for layer in model.layers if layer.trainable_variables}
    for layer, norms in per_layer.items():
        np.testing.assert_allclose(norms.numpy(), loop_norms(model, gradients, layer), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_debug_norms_are_the_norms_the_train_step_clips(name, engine):
    """σ = 0, C = the median debug norm: a DPSGD step moves θ by −lr Σ_i c_i g_i / P with
    c_i = min(1, C/‖g_i‖) from the norms it clipped against; computed here from the debug norms
    and the loop's g_i, it matches the step's update."""
    model, x, y, w, weights = case(name)
    gradients = loop_gradients(model, SPARSE_CE, x, y, w)
    total, _ = per_example_gradient_norms(model, SPARSE_CE, x, y, engine=engine, **weights)
    norms = total.numpy().astype(np.float64)
    clip = float(np.median(norms[norms > 0]))
    factors = np.where(norms > 0, np.minimum(1.0, clip / np.where(norms > 0, norms, 1.0)), 1.0)
    want = [sum(c * grads[k] for c, grads in zip(factors, gradients)) for k in range(len(gradients[0]))]
    model.compile(optimizer=tf_dp.DPSGD(1.0, l2_norm_clip=clip, noise_multiplier=0.0, seed=0), loss=SPARSE_CE,
                  clipping_engine=engine)
    before = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    model.train_on_batch(x, y, batch_size=P, **weights)
    got = [(b - v.numpy()) * P for b, v in zip(before, model.trainable_variables)]
    flat = lambda arrays: np.concatenate([np.ravel(a) for a in arrays])  # noqa: E731
    assert np.linalg.norm(flat(got) - flat(want)) <= 1e-4 * np.linalg.norm(flat(want))


def test_sample_weight_and_class_weight_together_are_refused():
    model, x, y, w, _ = case("sample_weight")
    with pytest.raises(ValueError, match="either `sample_weight` or `class_weight`"):
        per_example_gradient_norms(model, SPARSE_CE, x, y, sample_weight=w, class_weight=CLASS_WEIGHT)


@pytest.mark.parametrize("engine", ENGINES)
def test_loss_function_gets_keras_rank_alignment_as_in_training(engine):
    """A loss function such as keras.losses.binary_crossentropy with labels [B] and outputs
    [B, 1]: training wraps it as Keras' compile does (aligning the ranks, one value per row);
    called bare, [B] against [B, 1] broadcasts to [B, B] and mixes rows."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((FEATURES,))
    model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(keras.layers.Dense(5)(inputs)))
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(P, FEATURES)).astype("float32"), rng.integers(0, 2, P).astype("float32")
    wrapped = keras.losses.BinaryCrossentropy()
    gradients = loop_gradients(model, wrapped, x, y, None)
    total, _ = per_example_gradient_norms(model, keras.losses.binary_crossentropy, x, y, engine=engine)
    np.testing.assert_allclose(total.numpy(), loop_norms(model, gradients), rtol=1e-5)


def test_unknown_engine_is_refused():
    model, x, y, _, _ = case("sample_weight")
    with pytest.raises(ValueError, match="`engine` must be one of"):
        per_example_gradient_norms(model, SPARSE_CE, x, y, engine="loop")


@pytest.mark.parametrize("engine", ENGINES)
def test_two_output_model_with_one_loss_matches_a_per_example_loop(engine):
    """One loss for a model with two outputs applies to each output (as Keras' compile):
    ℓ_i = Σ_o mse(y_o,i, f_o(x_i)); the norms match a GradientTape loop over single examples."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
    outputs = [keras.layers.Dense(2, name="first")(hidden), keras.layers.Dense(1, name="second")(hidden)]
    model = keras.Model(inputs, outputs)
    rng = np.random.default_rng(4)
    x = rng.normal(size=(P, FEATURES)).astype("float32")
    y = [rng.normal(size=(P, 2)).astype("float32"), rng.normal(size=(P, 1)).astype("float32")]
    mse = keras.losses.MeanSquaredError()
    expected = []
    for i in range(P):
        with tf.GradientTape() as tape:
            first, second = model(x[i:i + 1], training=True)
            value = mse(y[0][i:i + 1], first) + mse(y[1][i:i + 1], second)
        grads = tape.gradient(value, model.trainable_variables)
        expected.append(np.sqrt(sum(np.sum(np.square(g.numpy().astype(np.float64))) for g in grads)))
    total, per_layer = per_example_gradient_norms(model, "mse", x, y, engine=engine)
    np.testing.assert_allclose(total.numpy(), expected, rtol=1e-5)
    assert set(per_layer) == {"hidden", "first", "second"}
