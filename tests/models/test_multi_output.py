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


def _fit_one_step(model, x, y, clip, batch_size, seed, loss, loss_weights=None, **extra):
    """−L × the update of one Poisson fit step with σ = 0 and SGD(1): the clipped sum."""
    model.compile(optimizer=tf_dp.DPSGD(1.0, l2_norm_clip=clip, noise_multiplier=0.0, seed=0), loss=loss,
                  loss_weights=loss_weights, delta=1e-3)
    before = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    model.fit(x, y, batch_size=batch_size, steps_per_epoch=1, epochs=1, sampling_seed=seed, verbose=0, **extra)
    return [-(v.numpy().astype(np.float64) - b) * batch_size for v, b in zip(model.trainable_variables, before)]


@pytest.mark.parametrize("spec", ["list", "dict"])
def test_poisson_fit_with_several_targets_is_the_clipped_loop_sum_over_the_sampled_examples(spec):
    """fit(x, [targets] or {name: targets}, per-output sample weights, batch_size=L) on arrays:
    the step's clipped sum is the loop's over exactly the examples Poisson sampling drew for
    that seed (the PoissonSampler's batch 0) — the same examples a single-output model's fit
    trains on with the same seed."""
    from tf_dp.sampling.poisson import PoissonSampler

    rng = np.random.default_rng(3)
    n, L, seed = 40, 10, 5
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    labels, values = rng.integers(0, CLASSES, n).astype("int32"), rng.normal(size=(n, T, 2)).astype("float32")
    weights = [rng.uniform(0.0, 2.0, n).astype("float32"), rng.uniform(0.0, 2.0, n).astype("float32")]
    loss, loss_weights = SPECS[spec]
    lambdas = [0.3, 2.0]
    indices, mask = PoissonSampler(n, L, None, seed).batch(0)
    rows = np.sort(indices[mask > 0])
    assert 0 < len(rows) < n

    keras.utils.set_random_seed(0)
    model = two_output_model()

    def reference(y, outputs, _=None, i=None):
        return sum(lam * l(t, o, sample_weight=w[i:i + 1])
                   for lam, l, t, o, w in zip(lambdas, LOSSES, y, outputs, weights))

    def loop(clip):
        norms, total = [], [np.zeros(v.shape, np.float64) for v in model.trainable_variables]
        for i in rows:
            with tf.GradientTape() as tape:
                value = reference([labels[i:i + 1], values[i:i + 1]], model(x[i:i + 1], training=True), i=i)
            grads = [np.asarray(g, np.float64) for g in tape.gradient(value, model.trainable_variables)]
            norm = np.sqrt(sum(np.sum(g ** 2) for g in grads))
            norms.append(norm)
            total = [t + min(1.0, clip / norm) * g for t, g in zip(total, grads)]
        return np.array(norms), total

    clip = float(np.median(loop(1e9)[0]))
    _, want = loop(clip)
    if spec == "list":
        y, sample_weight = [labels, values], weights
    else:
        y, sample_weight = {"label": labels, "value": values}, {"label": weights[0], "value": weights[1]}
    got = _fit_one_step(model, x, y, clip, L, seed, loss, loss_weights, sample_weight=sample_weight)
    assert relative_error(got, want) <= 1e-4

    # The same seed draws the same examples for a single-output model.
    keras.utils.set_random_seed(1)
    single = tf_dp.DPModel(*(lambda i: (i, keras.layers.Dense(CLASSES)(i)))(keras.Input((FEATURES,))))
    single_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    total = [np.zeros(v.shape, np.float64) for v in single.trainable_variables]
    for i in rows:
        with tf.GradientTape() as tape:
            value = single_loss(labels[i:i + 1], single(x[i:i + 1]))
        total = [t + np.asarray(g, np.float64) for t, g in zip(total, tape.gradient(value, single.trainable_variables))]
    assert relative_error(_fit_one_step(single, x, labels, 1e9, L, seed, single_loss), total) <= 1e-4
