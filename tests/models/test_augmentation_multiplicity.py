"""Augmentation multiplicity (docs/algorithms.md §8, De et al. 2022): K views per sampled example,
u_i = (1/K) Σ_k ∇ℓ(θ; x_i^(k)) clipped ONCE — in both engines, against a per-example loop;
K = 1 is today's step bit for bit; ε does not depend on K."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp.clipping.engine import ONE_VIEW, AugmentationViews, clipped_gradient_sum
from tf_dp.models.data import poisson_dataset
from tf_dp.models.losses import per_example_loss

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
CLIP = 0.7


def cnn(random_layer=False):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 6, 2))
    h = keras.layers.RandomFlip("horizontal", seed=1)(inputs) if random_layer else inputs
    h = keras.layers.Conv2D(3, 3, activation="tanh")(h)
    h = keras.layers.LayerNormalization()(h)
    h = keras.layers.Flatten()(h)
    m = tf_dp.DPModel(inputs, keras.layers.Dense(4)(h))
    m.compile(optimizer=tf_dp.DPSGD(0.5, l2_norm_clip=CLIP, noise_multiplier=0.0, seed=1), loss=LOSS)
    return m


def views_batch(p=5, k=3, scale=1.0):
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(p, k, 6, 6, 2)) * scale).astype("float32")
    y = rng.integers(0, 4, p).astype("int32")
    return x, y


def loop_reference(model, x, y, mask, k):
    """Σ_i mask_i · clip((1/K) Σ_k ∇ℓ(x_ik)) by a Python loop over examples and views."""
    total = [np.zeros(v.shape, np.float64) for v in model.trainable_variables]
    norms = []
    for i in range(len(y)):
        grads = [np.zeros(v.shape, np.float64) for v in model.trainable_variables]
        for view in range(k):
            with tf.GradientTape() as tape:
                value = LOSS(y[i:i + 1], model(x[i:i + 1, view], training=True))
            for acc, g in zip(grads, tape.gradient(value, model.trainable_variables)):
                acc += np.asarray(g, np.float64) / k
        norm = np.sqrt(sum(np.sum(g ** 2) for g in grads))
        norms.append(norm)
        factor = mask[i] * min(1.0, CLIP / norm)
        for acc, g in zip(total, grads):
            acc += factor * g
    return total, np.array(norms)


@pytest.mark.parametrize("engine", ["ghost", "vectorized"])
def test_k_views_are_averaged_before_clipping_in_both_engines(engine):
    model = cnn()
    x, y = views_batch(scale=3.0)
    mask = np.array([1, 1, 1, 1, 0], np.float32)  # a padding row contributes nothing
    result = clipped_gradient_sum(model, per_example_loss(LOSS), tf.constant(x), tf.constant(y), tf.constant(mask),
                                  tf.constant(CLIP), engine=engine, views=AugmentationViews(3, view_axis=True))
    expected, norms = loop_reference(model, x, y, mask, 3)
    assert np.all(norms > CLIP)  # every example is clipped: averaging after clipping would differ
    np.testing.assert_allclose(np.sqrt(result.squared_norms.numpy())[:4], norms[:4], rtol=1e-3)
    for got, want in zip(result.clipped_sums, expected):
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-3, atol=2e-5)


@pytest.mark.parametrize("engine", ["ghost", "vectorized"])
def test_k_views_of_one_example_contribute_one_vector_of_norm_at_most_c(engine):
    model = cnn()
    x, y = views_batch(p=1, k=4, scale=50.0)
    result = clipped_gradient_sum(model, per_example_loss(LOSS), tf.constant(x), tf.constant(y),
                                  tf.constant([1.0]), tf.constant(CLIP), engine=engine,
                                  views=AugmentationViews(4, view_axis=True))
    flat = np.concatenate([np.asarray(g, np.float64).ravel() for g in result.clipped_sums])
    assert np.linalg.norm(flat) <= CLIP * (1 + 1e-5)
    assert np.linalg.norm(flat) >= CLIP * (1 - 1e-3)  # clipped to C, not K·C, not C/K
    expected, _ = loop_reference(model, x, y, [1.0], 4)
    reference = np.concatenate([g.ravel() for g in expected])
    assert np.dot(flat, reference) / (np.linalg.norm(flat) * np.linalg.norm(reference)) > 0.9999


def test_one_view_is_todays_step_bit_for_bit():
    x, y = views_batch(p=40, k=1)
    x = x[:, 0]
    today, explicit = cnn(), cnn()
    today.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=3, sampling_seed=2, verbose=0)
    explicit.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=3, sampling_seed=2, verbose=0,
                 augmentation_multiplicity=1)
    for a, b in zip(today.get_weights(), explicit.get_weights()):
        np.testing.assert_array_equal(a, b)
    model = cnn()
    args = [tf.constant(v) for v in (x[:8], y[:8], np.ones(8, np.float32), CLIP)]
    plain = clipped_gradient_sum(model, per_example_loss(LOSS), *args)
    again = clipped_gradient_sum(model, per_example_loss(LOSS), *args, views=ONE_VIEW)
    for a, b in zip(plain.clipped_sums, again.clipped_sums):
        np.testing.assert_array_equal(a, b)


def shift(x, seed):
    """A seeded per-example augmentation: random flip and additive noise."""
    flipped = tf.where(tf.random.stateless_uniform([], seed) < 0.5, tf.reverse(x, [1]), x)
    return flipped + tf.random.stateless_normal(tf.shape(x), seed + 1, stddev=0.3)


def test_fit_with_augment_and_k_views_takes_the_step_the_loop_computes_and_keeps_epsilon():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(40, 6, 6, 2)).astype("float32")
    y = rng.integers(0, 4, 40).astype("int32")
    fitted, reference = cnn(), cnn()
    fitted.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=1, sampling_seed=3, verbose=0, augment=shift,
               augmentation_multiplicity=3)
    element = next(iter(poisson_dataset(x, y, 40, 8, None, seed=3, augment=shift, views=3, augment_seed=3)))
    assert element["x"].shape[2] == 3  # [chunks, P, K, ...]
    mask = element["mask"].numpy().reshape(-1)
    views = element["x"].numpy().reshape(-1, 3, 6, 6, 2)
    assert np.all(views[mask == 0] == 0)  # padding rows stay zeros
    assert not np.allclose(views[mask == 1][:, 0], views[mask == 1][:, 1])  # distinct views
    sums, _ = loop_reference(reference, views, element["y"].numpy().reshape(-1), mask, 3)
    for w, got, g in zip(reference.get_weights(), fitted.get_weights(), sums):
        np.testing.assert_allclose(got, w - 0.5 * g / 8, rtol=1e-4, atol=1e-5)
    single = cnn()
    single.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=1, sampling_seed=3, verbose=0, augment=shift)
    assert fitted.get_epsilon() == single.get_epsilon()  # one clipped vector per example: same ε


def test_in_model_random_layers_give_the_views_and_each_example_stays_within_c():
    model = cnn(random_layer=True)
    x, y = views_batch(p=1, k=1, scale=50.0)
    result = clipped_gradient_sum(model, per_example_loss(LOSS), tf.constant(x[:, 0]), tf.constant(y),
                                  tf.constant([1.0]), tf.constant(CLIP), views=AugmentationViews(3, view_axis=False))
    flat = np.concatenate([np.asarray(g, np.float64).ravel() for g in result.clipped_sums])
    assert np.linalg.norm(flat) <= CLIP * (1 + 1e-5)
    rng = np.random.default_rng(2)
    data_x, data_y = rng.normal(size=(30, 6, 6, 2)).astype("float32"), rng.integers(0, 4, 30).astype("int32")
    model.fit(data_x, data_y, batch_size=6, epochs=1, steps_per_epoch=2, augmentation_multiplicity=2, verbose=0)
    assert int(model.privacy_ledger.steps.numpy()) == 2
    with pytest.raises(ValueError, match="random views"):
        cnn().fit(data_x, data_y, batch_size=6, epochs=1, augmentation_multiplicity=2, verbose=0)
