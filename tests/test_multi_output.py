"""Models with several outputs, a list/dict of losses and ``loss_weights``:
ℓ_i = Σ_o λ_o ℓ_o,i, each output's loss reduced per example — against a per-example loop
over Keras' own loss objects, in both clipping engines and through the DP train step."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp.clipping import clipped_gradient_sum
from tf_dp.models.losses import WeightedTargets, per_example_loss

P, FEATURES, CLASSES, T = 6, 4, 3, 5


def two_output_model():
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    label = keras.layers.Dense(CLASSES, name="label")(hidden)
    sequence = keras.layers.Reshape((T, 2))(keras.layers.Dense(T * 2)(hidden))
    value = keras.layers.Dense(2, name="value")(keras.layers.Dense(4, activation="tanh")(sequence))
    return tf_dp.DPModel(inputs, [label, value])


def batch(rng):
    x = rng.normal(size=(P, FEATURES)).astype("float32")
    return x, [rng.integers(0, CLASSES, P).astype("int32"), rng.normal(size=(P, T, 2)).astype("float32")]


LOSSES = [keras.losses.SparseCategoricalCrossentropy(from_logits=True), keras.losses.MeanSquaredError()]
SPECS = {
    "list": (LOSSES, [0.3, 2.0]),
    "dict": ({"label": LOSSES[0], "value": LOSSES[1]}, {"label": 0.3, "value": 2.0}),
    "dict_without_weights": ({"label": LOSSES[0], "value": LOSSES[1]}, None),
}


def reference_loss(loss, loss_weights):
    losses = LOSSES
    weights = [1.0, 1.0] if loss_weights is None else (
        [loss_weights["label"], loss_weights["value"]] if isinstance(loss_weights, dict) else loss_weights)

    def total(y, outputs, sample_weight=None):
        return sum(w * l(t, o, sample_weight=sample_weight) for w, l, t, o in zip(weights, losses, y, outputs))

    return total


def loop_reference(model, loss, x, y, clip, sample_weight=None):
    norms, total = [], [np.zeros(v.shape, np.float64) for v in model.trainable_variables]
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            value = loss([t[i:i + 1] for t in y], model(x[i:i + 1], training=True),
                         None if sample_weight is None else sample_weight[i:i + 1])
        grads = [np.asarray(g, np.float64) for g in tape.gradient(value, model.trainable_variables)]
        norm = np.sqrt(sum(np.sum(g ** 2) for g in grads))
        norms.append(norm)
        total = [t + min(1.0, clip / norm) * g for t, g in zip(total, grads)]
    return np.array(norms), total


def relative_error(got, want):
    got = np.concatenate([np.ravel(g) for g in got]) if isinstance(got, list) else np.ravel(got)
    want = np.concatenate([np.ravel(g) for g in want]) if isinstance(want, list) else np.ravel(want)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


@pytest.mark.parametrize("engine", ["ghost", "vectorized"])
@pytest.mark.parametrize("spec", sorted(SPECS))
def test_norms_and_clipped_sums_match_a_loop(engine, spec):
    rng = np.random.default_rng(0)
    model, (x, y) = two_output_model(), batch(rng)
    loss, loss_weights = SPECS[spec]
    reference = reference_loss(loss, loss_weights)
    norms, _ = loop_reference(model, reference, x, y, 1e9)
    clip = float(np.median(norms))
    norms, want = loop_reference(model, reference, x, y, clip)
    ours = per_example_loss(loss, loss_weights, model.output_names)
    result = clipped_gradient_sum(model, ours, tf.constant(x), [tf.constant(t) for t in y], tf.ones([P]), clip,
                                  engine=engine)
    assert relative_error(np.sqrt(result.squared_norms.numpy()), norms) <= 1e-4
    assert relative_error([s.numpy() for s in result.clipped_sums], want) <= 1e-4


def test_one_sample_weight_applies_to_every_output():
    rng = np.random.default_rng(1)
    model, (x, y) = two_output_model(), batch(rng)
    w = rng.uniform(0.0, 2.0, P).astype("float32")
    loss, loss_weights = SPECS["list"]
    reference = reference_loss(loss, loss_weights)
    norms, want = loop_reference(model, reference, x, y, 0.5, sample_weight=w)
    ours = per_example_loss(loss, loss_weights, model.output_names)
    packed = WeightedTargets([tf.constant(t) for t in y], tf.constant(w))
    result = clipped_gradient_sum(model, ours, tf.constant(x), packed, tf.ones([P]), 0.5)
    assert relative_error(np.sqrt(result.squared_norms.numpy()), norms) <= 1e-4
    assert relative_error([s.numpy() for s in result.clipped_sums], want) <= 1e-4


@pytest.mark.parametrize("spec", ["list", "dict"])
def test_train_on_batch_is_the_clipped_loop_sum(spec):
    rng = np.random.default_rng(2)
    model, (x, y) = two_output_model(), batch(rng)
    loss, loss_weights = SPECS[spec]
    norms, _ = loop_reference(model, reference_loss(loss, loss_weights), x, y, 1e9)
    clip = float(np.median(norms))
    _, want = loop_reference(model, reference_loss(loss, loss_weights), x, y, clip)
    model.compile(optimizer=tf_dp.DPSGD(1.0, l2_norm_clip=clip, noise_multiplier=0.0, seed=0), loss=loss,
                  loss_weights=loss_weights, metrics=[["accuracy"], ["mae"]])
    before = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    logs = model.train_on_batch(x, y, batch_size=P, return_dict=True)
    delta = [v.numpy().astype(np.float64) - b for v, b in zip(model.trainable_variables, before)]
    assert relative_error([-d * P for d in delta], want) <= 1e-4
    assert "label_accuracy" in logs and "value_mae" in logs


def test_a_loss_key_naming_no_output_is_refused():
    model = two_output_model()
    with pytest.raises(ValueError, match="name no output"):
        per_example_loss({"label": LOSSES[0], "typo": LOSSES[1]}, None, model.output_names)(
            [tf.zeros([2], tf.int32), tf.zeros([2, T, 2])], model(np.zeros((2, FEATURES), "float32")))
