"""BandMF noise with the optimizers whose noise-bias correction needs the noise variance
(docs/algorithms.md §10.5): DP-AdamBC / DPAdamW(noise_bias_correction=True) subtract the
MARGINAL variance σ_w²·F_n, measured here on released noise; DiSK / FIBER with the correction
(a filter's A_t assumes white noise) are refused."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp.noise import BandMF
from tf_dp.noise.bandmf import marginal_variance_factors, normalized_coefficients

SIGMA, CLIP, BATCH = 1.2, 1.5, 4.0
SIGMA_W2 = (SIGMA * CLIP / BATCH) ** 2


def _toeplitz_inverse_row_norms(coefficients, steps):
    """Σ_j (C⁻¹[t, j])² for t < steps from numpy's inverse of the banded Toeplitz C."""
    matrix = sum(c * np.eye(steps, k=-j) for j, c in enumerate(coefficients))
    inverse = np.linalg.inv(matrix)
    return np.sum(inverse * inverse, axis=1)


@pytest.mark.parametrize("bands, coefficients", [(2, "sqrt"), (4, "sqrt"), (16, "sqrt"), (3, [1.0, 0.3, -0.2])])
def test_marginal_variance_factors_are_the_row_norms_of_c_inverse(bands, coefficients):
    normalized = normalized_coefficients(bands, coefficients)
    factors = marginal_variance_factors(normalized)
    steps = 300
    expected = _toeplitz_inverse_row_norms(normalized, steps)
    padded = np.concatenate([factors, np.full(max(steps - len(factors), 0), factors[-1])])[:steps]
    np.testing.assert_allclose(padded, expected, rtol=1e-8)
    assert bands == 1 or factors[0] > 1.0 + 1e-3  # not white: the comparison below can fail


def test_one_band_is_white():
    assert BandMF(1).white_noise and float(BandMF(1).noise_variance_factor()) == 1.0
    np.testing.assert_array_equal(marginal_variance_factors(normalized_coefficients(1)), [1.0, 1.0])


def _optimizer(kind, seed):
    noise = BandMF(4)
    if kind == "sgd":  # ĝ_t = −Δθ: the released noise, measured
        return tf_dp.DPOptimizer(keras.optimizers.SGD(1.0), l2_norm_clip=CLIP, noise_multiplier=SIGMA, seed=seed,
                                 noise=noise)
    cls = tf_dp.DPAdam if kind == "adam" else tf_dp.DPAdamW
    return cls(1e-3, l2_norm_clip=CLIP, noise_multiplier=SIGMA, seed=seed, noise=noise, noise_bias_correction=True)


def _run_zero_gradient_steps(optimizer, variables, steps):
    """``steps`` compiled DP steps on zero clipped sums; returns (ĝ_t flattened [T, n], the noise
    variance handed to the inner optimizer at each step [T] (None if it takes none))."""
    handed = tf.Variable(-1.0, dtype=tf.float32)
    inner = optimizer.inner_optimizer
    if getattr(inner, "uses_noise_variance", False):
        original = inner.noise_variance_of_step

        def recording(noise_variance):
            handed.assign(tf.cast(noise_variance, tf.float32))
            return original(noise_variance)

        inner.noise_variance_of_step = recording

    @tf.function
    def step(dp_step):
        zeros = [tf.zeros_like(v) for v in variables]
        optimizer.apply_private_gradients(zeros, variables, tf.constant(BATCH), dp_step=dp_step)

    released, variances = [], []
    for t in range(steps):
        before = [v.numpy().copy() for v in variables]
        step(tf.constant(t, tf.int64))
        released.append(np.concatenate([(b - v.numpy()).ravel() for b, v in zip(before, variables)]))
        variances.append(float(handed.numpy()))
        assert float(optimizer.noise_variance_on_average(tf.float32)) == pytest.approx(
            SIGMA_W2 * optimizer.privatizer.variance_factors[min(t, len(optimizer.privatizer.variance_factors) - 1)],
            rel=1e-5)
    return np.stack(released).astype(np.float64), np.asarray(variances)


@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_bias_corrected_adam_with_bandmf_subtracts_the_measured_marginal_variance(kind):
    """Zero gradients, σ > 0, T = 6 steps of one segment, n = 24 000 coordinates.

    The measured variance of ĝ_t is a mean of n i.i.d. squares of N(0, v_t): relative standard
    error √(2/n) = 0.9 %; each step must be within 5 of them of the variance handed to the
    inner optimizer. The white σ_w² (what was handed before) is ≥ 20 % off from step 0 on
    (F_0 = 1.49 for b = 4): rejected by the same test.
    """
    steps, shapes = 6, [(20000,), (40, 100)]
    measuring = [tf.Variable(tf.zeros(s)) for s in shapes]
    noise, _ = _run_zero_gradient_steps(_optimizer("sgd", seed=7), measuring, steps)
    corrected = [tf.Variable(tf.zeros(s)) for s in shapes]
    _, handed = _run_zero_gradient_steps(_optimizer(kind, seed=7), corrected, steps)
    n = noise.shape[1]
    measured = np.mean(noise * noise, axis=1)
    standard_error = handed * np.sqrt(2.0 / n)
    assert np.all(np.abs(measured - handed) < 5 * standard_error), (measured, handed)
    formula = SIGMA_W2 * _toeplitz_inverse_row_norms(BandMF(4).coefficients, steps)
    np.testing.assert_allclose(handed, formula, rtol=1e-5)
    assert np.all(np.abs(measured - SIGMA_W2) > 20 * standard_error)  # white σ_w² would fail


def test_a_jumped_counter_restarts_the_marginal_variance():
    """A counter that does not continue the buffer starts a new segment: F_0 again."""
    variables = [tf.Variable(tf.zeros((10,)))]
    optimizer = _optimizer("adam", seed=3)
    for t in (0, 1, 2, 7):
        optimizer.apply_private_gradients([tf.zeros((10,))], variables, tf.constant(BATCH),
                                          dp_step=tf.constant(t, tf.int64))
    factors = optimizer.privatizer.variance_factors
    assert float(optimizer.noise_variance_on_average(tf.float32)) == pytest.approx(SIGMA_W2 * factors[0], rel=1e-5)
    optimizer.apply_private_gradients([tf.zeros((10,))], variables, tf.constant(BATCH),
                                      dp_step=tf.constant(8, tf.int64))
    assert float(optimizer.noise_variance_on_average(tf.float32)) == pytest.approx(SIGMA_W2 * factors[1], rel=1e-5)


FILTERED_WITH_CORRECTION = {
    "disk_adamw": lambda noise: tf_dp.DiSK(noise_multiplier=1.0, noise=noise, noise_bias_correction=True),
    "disk_adam": lambda noise: tf_dp.DiSK(base="adam", noise_multiplier=1.0, noise=noise, noise_bias_correction=True),
    "disk_stationary": lambda noise: tf_dp.optimizers.DiSKAdamW(
        noise_multiplier=1.0, noise=noise, noise_bias_correction=True, correction="stationary"),
    "fiber": lambda noise: tf_dp.FIBER(noise_multiplier=1.0, noise=noise),
    "fiber_full": lambda noise: tf_dp.FIBER(noise_multiplier=1.0, noise=noise, correction="full"),
    "fiber_stationary": lambda noise: tf_dp.FIBER(noise_multiplier=1.0, noise=noise, correction="stationary"),
    "fiber_ema": lambda noise: tf_dp.FIBER(noise_multiplier=1.0, noise=noise, filter="ema"),
}


@pytest.mark.parametrize("name", sorted(FILTERED_WITH_CORRECTION))
def test_filters_with_noise_bias_correction_refuse_bandmf(name):
    make = FILTERED_WITH_CORRECTION[name]
    with pytest.raises(ValueError, match=r"noise=BandMF.*correlated.*noise_bias_correction=False"):
        make(BandMF(4))
    with pytest.raises(ValueError, match="correlated"):  # a serialized BandMF too
        make(keras.saving.serialize_keras_object(BandMF(2)))
    assert make(None).privatizer.white_noise  # white Gaussian noise: accepted
    assert make(BandMF(1)).privatizer.num_bands == 1  # b = 1 is DP-SGD's noise: accepted


def test_filters_without_the_correction_accept_bandmf():
    for optimizer in (tf_dp.DiSK(noise_multiplier=1.0, noise=BandMF(4)),
                      tf_dp.DiSK(base="sgd", noise_multiplier=1.0, noise=BandMF(4)),
                      tf_dp.FIBER(noise_multiplier=1.0, noise=BandMF(4), noise_bias_correction=False)):
        assert optimizer.privatizer.num_bands == 4


def test_fit_with_dpadam_bc_and_bandmf_hands_the_marginal_variance():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(120, 5)).astype(np.float32), rng.integers(0, 2, size=120).astype(np.int32)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(2)(inputs))
    optimizer = tf_dp.DPAdam(1e-3, l2_norm_clip=CLIP, noise_multiplier=SIGMA, noise=BandMF(4),
                             noise_bias_correction=True)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=12, steps_per_epoch=3, epochs=1, verbose=0)
    sigma_w2 = (float(np.float32(SIGMA)) * CLIP / 12) ** 2
    factor = optimizer.privatizer.variance_factors[2]  # the third step of the segment
    assert float(optimizer.noise_variance_on_average(tf.float32)) == pytest.approx(sigma_w2 * factor, rel=1e-5)
