"""Per-layer clipping (docs/algorithms.md §13): engine sums vs a per-example loop, and the bounds."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.harness import loop_per_example_gradients, sparse_ce
from tf_dp.clipping import AdaptiveClip, FlatClip, PerLayer, clipped_gradient_sum, resolve_clipping

BATCH = 6
ENGINES = ("ghost", "vectorized")


def dense_model(activation="tanh"):
    inputs = keras.Input((7,))
    hidden = keras.layers.Dense(5, activation=activation, name="first")(inputs)
    hidden = keras.layers.Dense(4, activation="relu", name="second")(hidden)
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(hidden)), np.random.randn(BATCH, 7).astype("float32")


def mixed_model():
    """Ghost rules (Embedding, Conv1D, LayerNorm, Dense) and a per-example fallback (PReLU)."""
    inputs = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Embedding(9, 8, name="embed")(inputs)
    hidden = keras.layers.Conv1D(4, 3, name="conv")(hidden)
    hidden = keras.layers.PReLU(name="prelu")(hidden)
    hidden = keras.layers.LayerNormalization(name="norm")(hidden)
    hidden = keras.layers.Dense(5, activation="relu", name="dense")(keras.layers.Flatten()(hidden))
    ids = np.random.randint(0, 9, (BATCH, 6)).astype("int32")
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(hidden)), ids


def squared_output(y_true, y_pred):
    """ℓ_i = ‖f(x_i)‖²: no saturation, so every layer's gradient grows with ‖x_i‖."""
    return tf.reduce_sum(tf.square(y_pred), axis=-1)


def layer_slices(model):
    """Index ranges of model.trainable_variables per layer owning them (the reference's groups)."""
    index = {id(v): i for i, v in enumerate(model.trainable_variables)}
    return [(layer.name, [index[id(v)] for v in layer.trainable_weights])
            for layer in model.layers if layer.trainable_weights]


def loop_per_layer_sum(per_example, groups, bounds, mask):
    """Σ_i mask_i Σ_k min(1, C_k/‖g_i^k‖) g_i^k in float64, from the loop's gradients."""
    total = [np.zeros_like(g, np.float64) for g in per_example[0]]
    for i, grads in enumerate(per_example):
        for (_, indices), bound in zip(groups, bounds):
            norm = math.sqrt(sum(float(np.sum(grads[j].astype(np.float64) ** 2)) for j in indices))
            factor = min(1.0, bound / norm) if norm > 0 else 1.0
            for j in indices:
                total[j] += mask[i] * factor * grads[j].astype(np.float64)
    return total


def group_norms(sums, groups):
    return np.array([math.sqrt(sum(float(np.sum(np.square(np.asarray(sums[j], np.float64)))) for j in indices))
                     for _, indices in groups])


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("build", [dense_model, mixed_model], ids=lambda f: f.__name__)
@pytest.mark.parametrize("named", [False, True], ids=["equal_split", "named"])
def test_per_layer_sum_matches_loop(build, engine, named):
    model, x = build()
    y = np.random.randint(0, 3, BATCH).astype("int32")
    mask = np.array([1, 1, 0, 1, 1, 1], np.float32)
    groups = layer_slices(model)
    clip = 0.3
    if named:
        bounds = [0.05 * (k + 1) for k in range(len(groups))]
        policy = PerLayer({name: bound for (name, _), bound in zip(groups, bounds)})
        clip = math.sqrt(sum(b * b for b in bounds))
    else:
        bounds = [clip / math.sqrt(len(groups))] * len(groups)
        policy = PerLayer()
    per_example = loop_per_example_gradients(model, x, y)
    expected = loop_per_layer_sum(per_example, groups, bounds, mask)
    result = clipped_gradient_sum(model, sparse_ce, tf.constant(x), tf.constant(y), tf.constant(mask), clip,
                                  engine=engine, clipping=policy)
    for got, want in zip(result.clipped_sums, expected):
        np.testing.assert_allclose(got.numpy(), want, rtol=2e-4, atol=1e-6)
    # Clipping must have bitten, or the test would not tell per-layer from no clipping.
    assert any(group_norms(grads, groups).max() > min(bounds) for grads in per_example)
    # squared_norms stay the flat norm (of the real examples; the ghost engine sees padding as 0).
    flat = np.array([sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads) for grads in per_example])
    real = mask > 0
    np.testing.assert_allclose(result.squared_norms.numpy()[real], flat[real], rtol=1e-4)


@pytest.mark.parametrize("engine", ENGINES)
def test_every_group_of_every_example_is_within_its_bound(engine):
    """One example at a time (one-hot mask): group k of its clipped vector ≤ C_k, the whole ≤ C,
    with one example's inputs scaled by 1e4 (a huge gradient in every layer: no tanh)."""
    model, x = dense_model(activation=None)
    x[2] *= 1e4
    y = np.zeros(BATCH, "float32")
    groups = layer_slices(model)
    bounds = [0.02, 0.5, 0.1]
    policy = PerLayer(dict(zip([name for name, _ in groups], bounds)))
    total = policy.sensitivity(0.0)
    assert total == pytest.approx(math.sqrt(sum(b * b for b in bounds)))
    unclipped = loop_per_example_gradients(model, x, y, loss=squared_output)
    for i in range(BATCH):
        mask = np.eye(BATCH, dtype=np.float32)[i]
        result = clipped_gradient_sum(model, squared_output, x, y, mask, total, engine=engine, clipping=policy)
        norms = group_norms(result.clipped_sums, groups)
        assert np.all(norms <= np.array(bounds) * (1 + 1e-6)), (i, norms)
        assert math.sqrt(np.sum(norms ** 2)) <= total * (1 + 1e-6)
        if i == 2:  # the huge example: every group clipped to (just under) its bound
            assert group_norms(unclipped[2], groups).min() > max(bounds)
            np.testing.assert_allclose(norms, bounds, rtol=1e-5)


def test_equal_split_bounds_each_layer_by_c_over_sqrt_k():
    model, x = dense_model(activation=None)
    x *= 1e3
    y = np.zeros(BATCH, "float32")
    groups = layer_slices(model)
    clip = 0.6
    for i in range(BATCH):
        result = clipped_gradient_sum(model, squared_output, x, y, np.eye(BATCH, dtype=np.float32)[i], clip,
                                      clipping=PerLayer())
        norms = group_norms(result.clipped_sums, groups)
        assert np.all(norms <= clip / math.sqrt(len(groups)) * (1 + 1e-6))
    assert PerLayer().sensitivity(clip) == clip


def test_one_layer_per_layer_equals_flat():
    inputs = keras.Input((5,))
    model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    x, y = np.random.randn(BATCH, 5).astype("float32"), np.random.randint(0, 3, BATCH)
    flat = clipped_gradient_sum(model, sparse_ce, x, y, tf.ones(BATCH), 0.1, clipping=FlatClip())
    per_layer = clipped_gradient_sum(model, sparse_ce, x, y, tf.ones(BATCH), 0.1, clipping=PerLayer())
    for a, b in zip(flat.clipped_sums, per_layer.clipped_sums):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_unknown_layer_name_is_refused_with_the_layer_names():
    model, x = dense_model()
    policy = PerLayer({"first": 0.1, "second": 0.1, "head": 0.1, "nope": 0.1})
    with pytest.raises(ValueError, match=r"nope.*not trainable layers.*'first'.*'second'.*'head'"):
        clipped_gradient_sum(model, sparse_ce, x, np.zeros(BATCH, "int32"), tf.ones(BATCH), math.sqrt(0.04),
                             clipping=policy)


def test_layer_without_threshold_is_refused():
    model, x = dense_model()
    with pytest.raises(ValueError, match=r"no C_k for layers \['head'\]"):
        clipped_gradient_sum(model, sparse_ce, x, np.zeros(BATCH, "int32"), tf.ones(BATCH), math.sqrt(0.02),
                             clipping=PerLayer({"first": 0.1, "second": 0.1}))


def test_l2_norm_clip_must_match_the_thresholds():
    model, x = dense_model()
    policy = PerLayer({"first": 0.3, "second": 0.4, "head": 1.2})  # sqrt(0.09 + 0.16 + 1.44) = 1.3
    policy.check_clip_norm(1.3)
    with pytest.raises(ValueError, match=r"l2_norm_clip=1\.3"):
        policy.check_clip_norm(1.0)
    with pytest.raises(ValueError, match=r"l2_norm_clip=1\.3"):
        clipped_gradient_sum(model, sparse_ce, x, np.zeros(BATCH, "int32"), tf.ones(BATCH), 1.0, clipping=policy)
    # A clip held in a variable (the optimizer's) is checked when the step runs.
    clip = tf.Variable(1.0)
    step = tf.function(lambda: clipped_gradient_sum(model, sparse_ce, x, np.zeros(BATCH, "int32"), tf.ones(BATCH),
                                                    clip.read_value(), clipping=policy).clipped_sums)
    with pytest.raises(tf.errors.InvalidArgumentError, match="sqrt"):
        step()
    clip.assign(1.3)
    step()
    with pytest.raises(ValueError, match="adaptive"):
        policy.check_clip_norm(AdaptiveClip(1.3))
    PerLayer().check_clip_norm(AdaptiveClip(1.3))


def test_invalid_thresholds_are_refused():
    with pytest.raises(ValueError, match=r"thresholds\['a'\]"):
        PerLayer({"a": -1.0})
    with pytest.raises(TypeError, match="thresholds"):
        PerLayer({})


def test_config_round_trip():
    policy = PerLayer({"first": 0.5, "head": 0.25})
    restored = resolve_clipping(keras.saving.serialize_keras_object(policy))
    assert isinstance(restored, PerLayer) and restored.thresholds == policy.thresholds
    assert isinstance(resolve_clipping("per_layer"), PerLayer)
