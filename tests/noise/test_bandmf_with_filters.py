"""BandMF noise with the optimizers whose noise-bias correction needs the noise variance
(docs/algorithms.md §10.5): DP-AdamBC / DPAdamW(noise_bias_correction=True) subtract the
MARGINAL variance σ_w²·F_n, measured here on released noise; DiSK / FIBER with the correction
hand on the variance their filter leaves of the correlated noise (§10.6), measured on g̃_t."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.harness import drawing_noise
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


def _record_handed_variance(optimizer) -> tf.Variable:
    """A variable that receives the noise variance handed to the inner optimizer at each step
    (stays −1 if the inner optimizer takes none)."""
    handed = tf.Variable(-1.0, dtype=tf.float32)
    inner = optimizer.inner_optimizer
    if getattr(inner, "uses_noise_variance", False):
        original = inner.noise_variance_of_step

        def recording(noise_variance):
            handed.assign(tf.cast(noise_variance, tf.float32))
            return original(noise_variance)

        inner.noise_variance_of_step = recording
    return handed


def _run_zero_gradient_steps(optimizer, variables, steps):
    """``steps`` compiled DP steps on zero clipped sums; returns (ĝ_t flattened [T, n], the noise
    variance handed to the inner optimizer at each step [T] (None if it takes none))."""
    handed = _record_handed_variance(optimizer)

    @tf.function
    def step(dp_step):
        zeros = [tf.zeros_like(v) for v in variables]
        optimizer.apply_private_gradients(zeros, variables, tf.constant(BATCH), dp_step=dp_step)

    released, variances = [], []
    for t in range(steps):
        before = [v.numpy().copy() for v in variables]
        with drawing_noise(optimizer):
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
        with drawing_noise(optimizer):
            optimizer.apply_private_gradients([tf.zeros((10,))], variables, tf.constant(BATCH),
                                              dp_step=tf.constant(t, tf.int64))
    factors = optimizer.privatizer.variance_factors
    assert float(optimizer.noise_variance_on_average(tf.float32)) == pytest.approx(SIGMA_W2 * factors[0], rel=1e-5)
    with drawing_noise(optimizer):
        optimizer.apply_private_gradients([tf.zeros((10,))], variables, tf.constant(BATCH),
                                          dp_step=tf.constant(8, tf.int64))
    assert float(optimizer.noise_variance_on_average(tf.float32)) == pytest.approx(SIGMA_W2 * factors[1], rel=1e-5)


FILTERED_WITH_CORRECTION = {
    "disk_adamw": lambda noise: tf_dp.DiSK(noise_multiplier=SIGMA, l2_norm_clip=CLIP, noise=noise,
                                           noise_bias_correction=True, seed=11),
    "disk_adam": lambda noise: tf_dp.DiSK(base="adam", noise_multiplier=SIGMA, l2_norm_clip=CLIP, noise=noise,
                                          noise_bias_correction=True, seed=11),
    "disk_stationary": lambda noise: tf_dp.optimizers.DiSKAdamW(
        noise_multiplier=SIGMA, l2_norm_clip=CLIP, noise=noise, noise_bias_correction=True, correction="stationary",
        seed=11),
    "fiber": lambda noise: tf_dp.FIBER(noise_multiplier=SIGMA, l2_norm_clip=CLIP, noise=noise, seed=11),
    "fiber_full": lambda noise: tf_dp.FIBER(noise_multiplier=SIGMA, l2_norm_clip=CLIP, noise=noise, correction="full",
                                            seed=11),
    "fiber_stationary": lambda noise: tf_dp.FIBER(noise_multiplier=SIGMA, l2_norm_clip=CLIP, noise=noise,
                                                  correction="stationary", seed=11),
    "fiber_ema": lambda noise: tf_dp.FIBER(noise_multiplier=SIGMA, l2_norm_clip=CLIP, noise=noise, filter="ema",
                                           seed=11),
}


def _filter_matrix(optimizer, segments):
    """H C⁻¹ as dense numpy matrices, independently of the optimizer's recursion: H[t, s] is
    the filter's response in g̃_t to a unit input at step s (run on impulses), C the banded
    Toeplitz matrix of each segment (block-diagonal: a fresh buffer per segment)."""
    steps = sum(segments)
    transition, drive = (np.atleast_2d(np.asarray(m, float)) for m in optimizer.gradient_filter.state_space())
    response = np.zeros((steps, steps))
    for source in range(steps):
        state = np.zeros(drive.shape[1])
        for t in range(steps):
            state = transition @ state + drive[0] * (t == source)
            response[t, source] = state[0]
    inverse = np.zeros((steps, steps))
    start = 0
    for length in segments:
        matrix = sum(c * np.eye(length, k=-j) for j, c in enumerate(optimizer.privatizer.coefficients))
        inverse[start:start + length, start:start + length] = np.linalg.inv(matrix)
        start += length
    return response @ inverse


def _filtered_noise_run(optimizer, counters, size=24000):
    """Compiled DP steps on zero clipped sums at the given noise counters; returns the
    measured per-coordinate variance of g̃_t and the variance handed to the inner optimizer."""
    variables = [keras.Variable(np.zeros((size,), np.float32))]
    handed = _record_handed_variance(optimizer)

    @tf.function
    def step(dp_step):
        optimizer.apply_private_gradients([tf.zeros((size,))], variables, tf.constant(BATCH), dp_step=dp_step)

    measured, variances = [], []
    for counter in counters:
        with drawing_noise(optimizer):
            step(tf.constant(counter, tf.int64))
        filtered = optimizer._filtered_gradients[0].numpy().astype(np.float64)
        measured.append(np.mean(filtered * filtered))
        variances.append(float(handed.numpy()))
        reported = float(optimizer.noise_variance_on_average(tf.float32))
        assert reported == pytest.approx(variances[-1], rel=1e-5)
    return np.asarray(measured), np.asarray(variances)


@pytest.mark.parametrize("name", ["disk_adamw", "disk_adam", "fiber", "fiber_ema"])
def test_filters_hand_on_the_variance_they_leave_of_bandmf_noise(name):
    """Zero gradients, T = 8 steps of BandMF(4) noise through the filter (docs/algorithms.md §10.6).

    The handed-on variance equals σ_w²‖(H C⁻¹)[t, :]‖² computed from dense matrices (rtol 1e-5),
    and the measured variance of g̃_t, a mean of n = 24 000 i.i.d. squares of N(0, v_t)
    (relative standard error √(2/n) = 0.9 %), is within 5 standard errors of it at every step.
    What the white-noise recursion would hand on (A_t·σ_w²·F_n) agrees at the first step (one
    draw, nothing to correlate) and is > 10 standard errors off from the second on: rejected.
    """
    optimizer = FILTERED_WITH_CORRECTION[name](BandMF(4))
    steps = 8
    measured, handed = _filtered_noise_run(optimizer, range(steps))
    dense = _filter_matrix(optimizer, [steps])
    expected = SIGMA_W2 * np.sum(dense * dense, axis=1)
    np.testing.assert_allclose(handed, expected, rtol=1e-5)
    standard_error = expected * np.sqrt(2.0 / 24000)
    assert np.all(np.abs(measured - expected) < 5 * standard_error), (measured, expected)
    white = _white_attenuations(optimizer, steps) * SIGMA_W2 * _toeplitz_inverse_row_norms(
        optimizer.privatizer.coefficients, steps)
    assert np.all(np.abs(measured - white)[1:] > 10 * standard_error[1:]), (measured, white)


def _white_attenuations(optimizer, steps):
    """A_t of the filter fed white noise (its state-space covariance from zero), t < steps."""
    transition, drive = (np.atleast_2d(np.asarray(m, float)) for m in optimizer.gradient_filter.state_space())
    covariance, out = np.zeros((drive.shape[1],) * 2), []
    for _ in range(steps):
        covariance = transition @ covariance @ transition.T + drive.T @ drive
        out.append(covariance[0, 0])
    return np.asarray(out)


def test_a_new_bandmf_segment_restarts_the_noise_but_not_the_filter():
    """Counters 0, 1, 2 then 7, 8, 9 (a jumped counter: a fresh buffer). The filter keeps its
    state, the noise restarts: the handed-on variance is the dense H·blockdiag(C⁻¹, C⁻¹)'s."""
    optimizer = FILTERED_WITH_CORRECTION["fiber"](BandMF(4))
    measured, handed = _filtered_noise_run(optimizer, [0, 1, 2, 7, 8, 9])
    dense = _filter_matrix(optimizer, [3, 3])
    expected = SIGMA_W2 * np.sum(dense * dense, axis=1)
    np.testing.assert_allclose(handed, expected, rtol=1e-5)
    assert np.all(np.abs(measured - expected) < 5 * expected * np.sqrt(2.0 / 24000))
    unbroken = _filter_matrix(optimizer, [6])  # one segment would hand on something else
    assert abs(np.sum(unbroken[3] ** 2) - np.sum(dense[3] ** 2)) > 0.02 * np.sum(dense[3] ** 2)


@pytest.mark.parametrize("name", ["disk_stationary", "fiber_stationary", "fiber_full"])
def test_stationary_and_full_corrections_under_bandmf(name):
    """"stationary": A'_∞·σ_w²·F_n with A'_∞ the limit of ‖(H C⁻¹)[t]‖²/‖C⁻¹[t]‖² (dense, t = 400);
    "full": the marginal σ_w²·F_n of the unfiltered ĝ_t."""
    optimizer = FILTERED_WITH_CORRECTION[name](BandMF(4))
    _, handed = _filtered_noise_run(optimizer, range(5), size=100)
    marginal = SIGMA_W2 * _toeplitz_inverse_row_norms(optimizer.privatizer.coefficients, 5)
    if name == "fiber_full":
        np.testing.assert_allclose(handed, marginal, rtol=1e-5)
        return
    steps = 400
    dense = _filter_matrix(optimizer, [steps])
    limit = np.sum(dense[-1] ** 2) / _toeplitz_inverse_row_norms(optimizer.privatizer.coefficients, steps)[-1]
    np.testing.assert_allclose(handed, limit * marginal, rtol=1e-5)


def test_a_correlated_privatizer_without_a_recursion_is_refused_with_the_correction():
    class Opaque(BandMF):
        def noise_recursion(self):
            return None

    with pytest.raises(ValueError, match=r"noise_recursion.*noise_bias_correction=False"):
        tf_dp.FIBER(noise_multiplier=1.0, noise=Opaque(3))
    assert tf_dp.FIBER(noise_multiplier=1.0, noise=Opaque(3), noise_bias_correction=False).privatizer.num_bands == 3


@pytest.mark.parametrize("name", sorted(FILTERED_WITH_CORRECTION))
def test_filters_with_noise_bias_correction_accept_bandmf_and_white_noise(name):
    make = FILTERED_WITH_CORRECTION[name]
    assert make(BandMF(4)).privatizer.num_bands == 4
    assert make(keras.saving.serialize_keras_object(BandMF(2))).privatizer.num_bands == 2  # serialized too
    assert make(None).privatizer.white_noise  # white Gaussian noise
    assert make(BandMF(1)).privatizer.num_bands == 1  # b = 1 is DP-SGD's noise


def test_fiber_with_bandmf_fits_saves_and_resumes(tmp_path):
    """FIBER(noise=BandMF(4)) trains, saves its (public) joint noise covariance, and a reload
    continues with it: the filter block is kept, the noise block restarts with the fresh buffer."""
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(96, 5)).astype(np.float32), rng.integers(0, 2, size=96).astype(np.int32)
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer=tf_dp.FIBER(1e-3, l2_norm_clip=CLIP, noise_multiplier=SIGMA, noise=BandMF(4)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=12, steps_per_epoch=3, epochs=1, verbose=0)
    covariance = model.optimizer.part_state(model.optimizer.gradient_filter)["noise_covariance"].numpy()
    assert covariance.shape == ((2 + 3) ** 2,) and covariance[0] > 0
    path = tmp_path / "fiber_bandmf.keras"
    model.save(path)
    with pytest.warns(UserWarning, match="fresh buffer"):
        restored = keras.models.load_model(path)
        restored.fit(x, y, batch_size=12, steps_per_epoch=1, epochs=1, verbose=0)
    after = restored.optimizer.part_state(restored.optimizer.gradient_filter)["noise_covariance"].numpy()
    noise = restored.optimizer.gradient_filter._correlated
    transition, drive = noise.transition, noise.drive
    kept = covariance.reshape(5, 5).copy()
    kept[2:, :] = 0.0
    kept[:, 2:] = 0.0
    np.testing.assert_allclose(after.reshape(5, 5), transition @ kept @ transition.T + np.outer(drive, drive),
                               rtol=1e-5, atol=1e-7)


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
