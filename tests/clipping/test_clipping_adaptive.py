"""Adaptive clipping (docs/algorithms.md §12): the quantile update, its count noise and σ_Δ."""

import math

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dp.clipping import AdaptiveClip, clipped_gradient_sum
from tf_dp.clipping.adaptive import COUNT_STREAM
from tf_dp.noise.gaussian import draw_seed, gaussian_stream
from tf_dp.noise.laplace import LAPLACE_STREAM

KEY = tf.constant(123456789, tf.int64)


def linear_model(features):
    """Dense(1) with zero init and loss ℓ_i = f(x_i): g_i = x_i, so ‖g_i‖ = ‖x_i‖ at every step."""
    inputs = keras.Input((features,))
    layer = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")
    return keras.Model(inputs, layer(inputs))


def identity_loss(y_true, y_pred):
    return y_pred[:, 0]


def examples_with_norms(norms, features=3):
    directions = np.random.randn(len(norms), features)
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    return (directions * np.asarray(norms)[:, None]).astype("float32")


@pytest.mark.parametrize("quantile", [0.5, 0.8])
def test_bound_converges_to_the_target_quantile_of_the_norms(quantile):
    """σ_b = 0: C_t settles at the γ-quantile of known per-example norms 1, 2, ..., 40
    (read by the engine off a real model)."""
    norms = np.arange(1, 41, dtype=np.float64)
    x = examples_with_norms(norms)
    model = linear_model(3)
    adaptive = AdaptiveClip(initial=0.1, target_quantile=quantile, learning_rate=0.2, count_stddev=0.0)
    mask = tf.ones(len(norms))
    squared = clipped_gradient_sum(model, identity_loss, x, np.zeros(len(norms)), mask, 1.0).squared_norms
    np.testing.assert_allclose(np.sqrt(squared.numpy()), norms, rtol=1e-5)
    step = tf.function(lambda clip, t: adaptive.next_bound(clip, squared, mask, len(norms), KEY, t))
    clip = tf.constant(adaptive.initial, tf.float32)
    history = []
    for t in range(300):
        clip = step(clip, tf.constant(t, tf.int64))
        history.append(float(clip))
    late = np.array(history[-50:])
    target = np.quantile(norms, quantile)
    assert np.all(np.abs(late - target) <= 2.0), (target, late.min(), late.max())
    fraction_below = np.mean(norms[None, :] <= late[:, None], axis=1)
    assert np.all(np.abs(fraction_below - quantile) <= 2.0 / len(norms))


def noisy_fractions(adaptive, squared, mask, batch, steps, key=KEY):
    """b̃_t recovered from C_{t+1}/C_t = exp(−η(b̃_t − γ)) over ``steps`` DP steps."""
    clip = tf.constant(10.0, tf.float64)

    @tf.function
    def fraction(t):
        updated = adaptive.next_bound(clip, squared, mask, batch, key, t)
        return adaptive.target_quantile - tf.math.log(updated / clip) / adaptive.learning_rate

    return np.array([float(fraction(tf.constant(t, tf.int64))) for t in range(steps)])


def test_count_noise_std_is_count_stddev_over_l():
    """Default σ_b = L/20: the noisy fraction's std over 3000 steps is σ_b/L = 0.05 around the
    true fraction of unclipped examples (plus padding excluded from the count)."""
    batch = 64
    squared = tf.constant(np.r_[np.full(40, 1.0), np.full(24, 400.0)], tf.float32)  # 40 below C = 10
    mask = tf.constant(np.r_[np.ones(60), np.zeros(4)], tf.float32)  # padding: 4 rows above C, not counted
    adaptive = AdaptiveClip(initial=10.0)
    fractions = noisy_fractions(adaptive, squared, mask, batch, 3000)
    true_fraction = (40 - 0.5 * 60) / batch + 0.5
    assert abs(fractions.mean() - true_fraction) < 4 * 0.05 / math.sqrt(3000)
    assert fractions.std() == pytest.approx(adaptive.count_stddev_for(batch) / batch, rel=0.06)
    assert adaptive.count_stddev_for(batch) == batch / 20
    explicit = noisy_fractions(AdaptiveClip(initial=10.0, count_stddev=8.0), squared, mask, batch, 3000)
    assert explicit.std() == pytest.approx(8.0 / batch, rel=0.06)


def test_count_noise_is_keyed_and_on_its_own_stream():
    adaptive = AdaptiveClip(initial=1.0, count_stddev=1.0)
    draw = lambda key, t: float(adaptive.count_noise(tf.constant(key, tf.int64), tf.constant(t, tf.int64)))  # noqa
    assert draw(7, 3) == draw(7, 3)
    assert len({draw(7, 3), draw(7, 4), draw(8, 3)}) == 3
    assert COUNT_STREAM < 0 and COUNT_STREAM != LAPLACE_STREAM
    seed = draw_seed(KEY, 5, COUNT_STREAM).numpy().tolist()
    others = [draw_seed(KEY, 5, LAPLACE_STREAM).numpy().tolist()] + [
        draw_seed(KEY, 5, gaussian_stream(j, r, replicas)).numpy().tolist()
        for j in range(8) for replicas in (1, 2, 4) for r in range(replicas)]
    assert seed not in others


def test_centred_count_matches_a_hand_count():
    squared = tf.constant([0.5, 1.0, 1.5, np.inf, np.nan, 0.1], tf.float32)
    mask = tf.constant([1, 1, 1, 1, 1, 0], tf.float32)
    count = AdaptiveClip(1.0).centred_count(1.0, squared, mask)
    assert float(count) == (1 - 0.5) * 2 + (0 - 0.5) * 3  # ≤ C: 0.5, 1.0; above: 1.5, inf, NaN; padding: 0


def test_gradient_noise_multiplier_formula_and_joint_mechanism():
    """σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2), and the pair (gradient: multiplier σ_Δ; count: sensitivity ½,
    std σ_b) composes, by dp_accounting's RDP, to exactly the Gaussian mechanism of σ."""
    sigma, count_stddev = 1.1, 3.2
    adaptive = AdaptiveClip(1.0, count_stddev=count_stddev)
    sigma_delta = adaptive.gradient_noise_multiplier(sigma)
    assert sigma_delta == pytest.approx((sigma ** -2 - (2 * count_stddev) ** -2) ** -0.5, rel=1e-12)
    assert sigma_delta > sigma
    orders = [1.5, 2, 4, 8, 16, 64]
    joint = dp_accounting.rdp.RdpAccountant(orders)
    joint.compose(dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(sigma_delta),
                                                 dp_accounting.GaussianDpEvent(2 * count_stddev)]), 100)
    alone = dp_accounting.rdp.RdpAccountant(orders)
    alone.compose(dp_accounting.GaussianDpEvent(sigma), 100)
    assert joint.get_epsilon(1e-5) == pytest.approx(alone.get_epsilon(1e-5), rel=1e-9)
    # The default σ_b = L/20 needs L; tensors give the same value.
    assert AdaptiveClip(1.0).gradient_noise_multiplier(sigma, expected_batch_size=64) == pytest.approx(
        (sigma ** -2 - (2 * 3.2) ** -2) ** -0.5)
    as_tensor = adaptive.gradient_noise_multiplier(tf.constant(sigma, tf.float32))
    assert as_tensor.dtype == tf.float32 and float(as_tensor) == pytest.approx(sigma_delta, rel=1e-6)
    in_graph = tf.function(lambda s, n: AdaptiveClip(1.0).gradient_noise_multiplier(s, expected_batch_size=n))
    assert float(in_graph(tf.constant(sigma), tf.constant(64.0))) == pytest.approx(
        (sigma ** -2 - (2 * 3.2) ** -2) ** -0.5, rel=1e-6)
    assert adaptive.gradient_noise_multiplier(0.0) == 0.0


def test_too_little_count_noise_is_refused():
    """σ_Δ⁻² = σ⁻² − (2σ_b)⁻² > 0 needs σ_b > σ/2; the message names count_stddev and σ/2."""
    sigma = 3.0  # σ/2 = 1.5 (1/(2σ) = 0.17 would let σ_b = 1 through, and σ_Δ² would be negative)
    with pytest.raises(ValueError, match=r"`count_stddev`.* 1\.5 "):
        AdaptiveClip(1.0, count_stddev=1.0).gradient_noise_multiplier(sigma)
    with pytest.raises(ValueError, match=r"`count_stddev`.* 1\.5 "):
        AdaptiveClip(1.0).gradient_noise_multiplier(sigma, expected_batch_size=30)  # σ_b = 1.5, not above
    with pytest.raises(ValueError, match="count_stddev"):
        AdaptiveClip(1.0).gradient_noise_multiplier(sigma)  # σ_b = L/20 with L unknown
    with pytest.raises(tf.errors.InvalidArgumentError, match="count_stddev"):
        AdaptiveClip(1.0, count_stddev=1.0).gradient_noise_multiplier(tf.constant(sigma))
    assert AdaptiveClip(1.0, count_stddev=1.51).gradient_noise_multiplier(sigma) > 0
    assert float(AdaptiveClip(1.0, count_stddev=1.51).gradient_noise_multiplier(tf.constant(sigma))) > 0


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="initial"):
        AdaptiveClip(0.0)
    with pytest.raises(ValueError, match="target_quantile"):
        AdaptiveClip(1.0, target_quantile=1.0)
    with pytest.raises(ValueError, match="learning_rate"):
        AdaptiveClip(1.0, learning_rate=-0.1)
    with pytest.raises(ValueError, match="count_stddev"):
        AdaptiveClip(1.0, count_stddev=-1.0)


def test_config_round_trip():
    adaptive = AdaptiveClip(0.5, target_quantile=0.7, learning_rate=0.1, count_stddev=2.0)
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(adaptive))
    assert isinstance(restored, AdaptiveClip) and restored.get_config() == adaptive.get_config()
