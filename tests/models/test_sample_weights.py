"""sample_weight (per example and per token) and class_weight are part of the example:
ℓ_i = the weighted loss of example i computed from its row alone, clipped to C.

Reference: a Python loop over single examples evaluating the Keras loss object WITH the
example's own weights (Keras' reduction on a batch of one), clipping each gradient."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp.clipping import clipped_gradient_sum
from tf_dp.models.losses import WeightedTargets, per_example_loss

P, T, V, FEATURES, CLASSES = 6, 5, 11, 4, 3


def dense_model():
    inputs = keras.Input((FEATURES,))
    return tf_dp.DPModel(inputs, keras.layers.Dense(CLASSES)(keras.layers.Dense(8, activation="tanh")(inputs)))


def sequence_model():
    inputs = keras.Input((T,), dtype="int32")
    hidden = keras.layers.Dense(8, activation="tanh")(keras.layers.Embedding(V, 6)(inputs))
    return tf_dp.DPModel(inputs, keras.layers.Dense(V)(hidden))


def dense_batch(rng):
    return (rng.normal(size=(P, FEATURES)).astype("float32"), rng.integers(0, CLASSES, P).astype("int32"),
            rng.uniform(0.0, 3.0, P).astype("float32"))


def sequence_batch(rng):
    x = rng.integers(1, V, (P, T)).astype("int32")
    y = rng.integers(0, V, (P, T)).astype("int32")
    w = (rng.uniform(size=(P, T)) < 0.7).astype("float32") * rng.uniform(0.5, 2.0, (P, T)).astype("float32")
    w[0] = 0.0  # an example with no real tokens
    w[1, :] = 1.0
    return x, y, w


def loop_reference(model, loss, x, y, w, clip):
    """(norms, Σ_i c_i g_i) with g_i = ∇ loss(y_i, f(x_i), sample_weight=w_i) on a batch of one."""
    norms, total = [], [np.zeros(v.shape, np.float64) for v in model.trainable_variables]
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            value = loss(y[i:i + 1], model(x[i:i + 1], training=True),
                         sample_weight=None if w is None else w[i:i + 1])
        grads = [np.asarray(tf.convert_to_tensor(g), np.float64)
                 for g in tape.gradient(value, model.trainable_variables)]
        norm = np.sqrt(sum(np.sum(g ** 2) for g in grads))
        norms.append(norm)
        factor = min(1.0, clip / norm) if norm > 0 else 1.0
        total = [t + factor * g for t, g in zip(total, grads)]
    return np.array(norms), total


def relative_error(got, want):
    got = np.concatenate([np.ravel(g) for g in got]) if isinstance(got, list) else np.ravel(got)
    want = np.concatenate([np.ravel(g) for g in want]) if isinstance(want, list) else np.ravel(want)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def engine_result(model, loss, x, y, w, clip, engine):
    packed = WeightedTargets(tf.constant(y), tf.constant(w))
    return clipped_gradient_sum(model, per_example_loss(loss), tf.constant(x), packed, tf.ones([len(x)]), clip,
                                engine=engine)


@pytest.mark.parametrize("engine", ["ghost", "vectorized"])
@pytest.mark.parametrize("kind", ["per_example", "per_token", "per_token_by_weight_total"])
def test_weighted_norms_and_clipped_sums_match_a_loop(engine, kind):
    rng = np.random.default_rng(0)
    if kind == "per_example":
        model, (x, y, w) = dense_model(), dense_batch(rng)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:
        model, (x, y, w) = sequence_model(), sequence_batch(rng)
        reduction = "mean_with_sample_weight" if kind.endswith("total") else "sum_over_batch_size"
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
    norms, _ = loop_reference(model, loss, x, y, w, 1e9)
    clip = float(np.median(norms[norms > 0]))  # about half the examples are clipped
    norms, want = loop_reference(model, loss, x, y, w, clip)
    result = engine_result(model, loss, x, y, w, clip, engine)
    assert relative_error(np.sqrt(result.squared_norms.numpy()), norms) <= 1e-4
    assert relative_error([s.numpy() for s in result.clipped_sums], want) <= 1e-4
    if kind != "per_example":
        assert norms[0] == 0.0  # weight 0 on every token: no gradient at all


def test_per_token_denominator_is_the_examples_own():
    """ℓ_i does not change when another example's weights change (by-weight-total included)."""
    rng = np.random.default_rng(1)
    _, y, w = sequence_batch(rng)
    logits = tf.constant(rng.normal(size=(P, T, V)).astype("float32"))
    for reduction in ("sum_over_batch_size", "mean_with_sample_weight"):
        loss = per_example_loss(keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction))
        base = loss(WeightedTargets(tf.constant(y), tf.constant(w)), logits).numpy()
        changed_w = w.copy()
        changed_w[3] = 5.0
        changed = loss(WeightedTargets(tf.constant(y), tf.constant(changed_w)), logits).numpy()
        assert np.array_equal(np.delete(base, 3), np.delete(changed, 3))
        assert base[3] != changed[3]


def test_mismatched_weight_shape_is_refused():
    loss = per_example_loss(keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match="does not fit a loss of shape"):
        loss(WeightedTargets(tf.zeros([P, T], tf.int32), tf.ones([P, T + 1])), tf.zeros([P, T, V]))


def _compiled(model, clip, learning_rate=1.0):
    model.compile(optimizer=tf_dp.DPSGD(learning_rate, l2_norm_clip=clip, noise_multiplier=0.0, seed=0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _step_delta(model, step):
    before = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    step()
    return [v.numpy().astype(np.float64) - b for v, b in zip(model.trainable_variables, before)]


@pytest.mark.parametrize("engine", ["ghost", "vectorized"])
def test_train_on_batch_with_per_token_sample_weight_is_the_clipped_loop_sum(engine):
    rng = np.random.default_rng(2)
    model, (x, y, w) = sequence_model(), sequence_batch(rng)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    norms, _ = loop_reference(model, loss, x, y, w, 1e9)
    clip = float(np.median(norms[norms > 0]))
    _, want = loop_reference(model, loss, x, y, w, clip)
    model.compile(optimizer=tf_dp.DPSGD(1.0, l2_norm_clip=clip, noise_multiplier=0.0, seed=0), loss=loss,
                  clipping_engine=engine)
    delta = _step_delta(model, lambda: model.train_on_batch(x, y, sample_weight=w, batch_size=P))
    assert relative_error([-d * P for d in delta], want) <= 1e-4


def test_train_on_batch_class_weight_equals_keras_conversion_to_sample_weights():
    from keras.src.trainers.data_adapters.data_adapter_utils import class_weight_to_sample_weights
    rng = np.random.default_rng(3)
    model, (x, y, _) = dense_model(), dense_batch(rng)
    class_weight = {0: 0.5, 1: 3.0}  # class 2 not listed: weight 1
    w = class_weight_to_sample_weights(y, class_weight)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    norms, _ = loop_reference(model, loss, x, y, w, 1e9)
    clip = float(np.median(norms))
    _, want = loop_reference(model, loss, x, y, w, clip)
    _compiled(model, clip)
    delta = _step_delta(model, lambda: model.train_on_batch(x, y, class_weight=class_weight, batch_size=P))
    assert relative_error([-d * P for d in delta], want) <= 1e-4


@pytest.mark.parametrize("weighting", ["sample_weight", "class_weight", "per_token"])
def test_poisson_fit_carries_weights_with_each_sampled_example(weighting):
    """Same sampling seed, σ = 0, no clipping: weights 2 double every update, weights 0 freeze
    the model; per-token weights [N, T] are gathered with their examples."""
    rng = np.random.default_rng(4)
    n = 64
    if weighting == "per_token":
        x, y = rng.integers(1, V, (n, T)).astype("int32"), rng.integers(0, V, (n, T)).astype("int32")
        make = sequence_model
        weights = {"double": {"sample_weight": np.full((n, T), 2.0, "float32")},
                   "zero": {"sample_weight": np.zeros((n, T), "float32")}}
    else:
        x, y = rng.normal(size=(n, FEATURES)).astype("float32"), rng.integers(0, CLASSES, n).astype("int32")
        make = dense_model
        if weighting == "sample_weight":
            weights = {"double": {"sample_weight": np.full(n, 2.0, "float32")},
                       "zero": {"sample_weight": np.zeros(n, "float32")}}
        else:
            weights = {"double": {"class_weight": {c: 2.0 for c in range(CLASSES)}},
                       "zero": {"class_weight": {c: 0.0 for c in range(CLASSES)}}}
    deltas = {}
    for name, extra in [("plain", {}), *weights.items()]:
        keras.utils.set_random_seed(7)
        model = _compiled(make(), 1e6, learning_rate=0.1)
        deltas[name] = _step_delta(model, lambda: model.fit(x, y, batch_size=16, steps_per_epoch=1, epochs=1,
                                                            sampling_seed=11, verbose=0, **extra))
    plain = np.concatenate([d.ravel() for d in deltas["plain"]])
    assert np.abs(plain).max() > 0
    assert relative_error(deltas["double"], [2 * d for d in deltas["plain"]]) <= 1e-4
    assert max(np.abs(d).max() for d in deltas["zero"]) == 0.0


def test_fit_refuses_weights_of_the_wrong_length_and_both_kinds():
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(32, FEATURES)).astype("float32"), rng.integers(0, CLASSES, 32).astype("int32")
    model = _compiled(dense_model(), 1.0)
    with pytest.raises(ValueError, match="one row per training example"):
        model.fit(x, y, sample_weight=np.ones(31), batch_size=8, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="not both"):
        model.fit(x, y, sample_weight=np.ones(32), class_weight={0: 1.0}, batch_size=8, epochs=1, verbose=0)


def test_batched_dataset_of_x_y_w_equals_train_on_batch_and_validation_split_keeps_weights():
    rng = np.random.default_rng(6)
    x, y, w = dense_batch(rng)
    deltas = []
    for feed in ("dataset", "train_on_batch"):
        keras.utils.set_random_seed(8)
        model = _compiled(dense_model(), 0.5)
        if feed == "dataset":
            dataset = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(P)
            with pytest.warns(UserWarning, match="BATCHED"):
                deltas.append(_step_delta(model, lambda: model.fit(dataset, epochs=1, verbose=0)))
        else:
            deltas.append(_step_delta(model, lambda: model.train_on_batch(x, y, sample_weight=w, batch_size=P)))
    assert relative_error(deltas[0], deltas[1]) <= 1e-6
    n = 40
    x, y = rng.normal(size=(n, FEATURES)).astype("float32"), rng.integers(0, CLASSES, n).astype("int32")
    model = _compiled(dense_model(), 1.0)
    history = model.fit(x, y, sample_weight=np.linspace(0, 1, n).astype("float32"), validation_split=0.25,
                        batch_size=10, epochs=1, verbose=0)
    weighted_tail = model.evaluate(x[30:], y[30:], sample_weight=np.linspace(0, 1, n)[30:], verbose=0)
    assert np.isclose(history.history["val_loss"][0], weighted_tail, rtol=1e-5)


def test_class_weights_weigh_the_loss_but_metrics_count_examples_as_in_keras():
    """Plain Keras' TruePositives/FalseNegatives with class_weight report counts; so must DP fit
    (q = 1: every example in the one batch; lr 0, σ 0: the weights do not move)."""
    x = np.random.default_rng(0).normal(size=(64, 3)).astype("float32")
    y = (x[:, 0] > 0).astype("float32")

    def history(private):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((3,))
        outputs = keras.layers.Dense(1, activation="sigmoid")(inputs)
        model = (tf_dp.DPModel if private else keras.Model)(inputs, outputs)
        optimizer = tf_dp.DPSGD(0.0, l2_norm_clip=1.0, noise_multiplier=0.0) if private else keras.optimizers.SGD(0.0)
        model.compile(optimizer=optimizer, loss=keras.losses.BinaryCrossentropy(),
                      metrics=[keras.metrics.TruePositives(name="tp"), keras.metrics.FalseNegatives(name="fn")])
        extra = {} if private else {"shuffle": False}
        logs = model.fit(x, y, batch_size=64, epochs=1, verbose=0, class_weight={0: 1.0, 1: 10.0}, **extra).history
        return logs["tp"][-1], logs["fn"][-1]

    plain = history(private=False)
    assert sum(plain) == y.sum()  # counts of the positive examples
    assert history(private=True) == plain
