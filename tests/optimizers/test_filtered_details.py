"""Three details of the filtered optimizers, checked against hand computations.

1. The look-ahead direction d_t = θ_t − θ_{t−1} uses θ_{t−1} from BEFORE Keras' decoupled
   weight decay (not (1 − ηλ)θ_{t−1}).
2. DiSK's noise-bias correction subtracts what its EMA leaves of σ_w² (A_t → κ/(2 − κ)),
   not the full σ_w².
3. The correction uses the exact time-varying A_t of a filter started at zero, for FIBER
   and DiSK: A_t equals the variance of the filter run on pure noise and tends to A.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.harness import drawing_noise, loop_per_example_gradients, sparse_ce
from tf_dp.filters import (
    attenuation_factor,
    ema_attenuation_factor,
    ema_filter,
    ema_noise_variance_step,
    innovation_filter,
    innovation_noise_covariance_step,
)


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(6, activation="tanh")(inputs)
    return tf_dp.DPModel(inputs, keras.layers.Dense(3)(hidden))


def _batches(steps):
    rng = np.random.default_rng(3)
    return [(rng.normal(size=(8, 5)).astype("float32"), rng.integers(0, 3, 8).astype("int32")) for _ in range(steps)]


# -- 1. the look-ahead direction ------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda: tf_dp.FIBER(0.05, weight_decay=0.5, noise_multiplier=0.0),
    lambda: tf_dp.DiSK(0.05, base="sgd", weight_decay=0.5, noise_multiplier=0.0),
])
def test_previous_weights_are_recorded_before_weight_decay(make):
    """After a step, θ_{t−1} held by the optimizer is exactly the iterate before the step;
    with ηλ = 0.025 the decayed (1 − ηλ)θ it used to hold differs by 2.5 %."""
    model = _model()
    model.compile(optimizer=make(), loss=sparse_ce)
    for x, y in _batches(2):
        before = [w.copy() for w in model.get_weights()]
        model.train_on_batch(x, y, batch_size=len(y))
        remembered = [p.numpy() for p in model.optimizer._previous_weights]
        for held, theta in zip(remembered, before):
            np.testing.assert_array_equal(held, theta)


def test_disk_two_point_steps_with_weight_decay_match_hand_computation():
    """σ = 0, no clipping, DiSK-SGD with decoupled weight decay λ:
    θ_1 = (1 − ηλ)θ_0 − η g̃_1; step 2 evaluates at θ_1 + γ(θ_1 − θ_0)."""
    kappa, gamma, lr, decay = 0.6, 0.5, 0.1, 0.5
    c = (1 - kappa) / (kappa * gamma)
    model = _model()
    model.compile(optimizer=tf_dp.DiSK(lr, kappa=kappa, gamma=gamma, base="sgd", weight_decay=decay,
                                       l2_norm_clip=1e9, noise_multiplier=0.0), loss=sparse_ce)
    reference = _model()
    (x1, y1), (x2, y2) = _batches(2)

    def mean_grad(weights, x, y):
        for v, w in zip(reference.trainable_variables, weights):
            v.assign(w)
        per_example = loop_per_example_gradients(reference, x, y)
        return [np.mean([g[v] for g in per_example], axis=0) for v in range(len(weights))]

    def sgd_step(theta, g_tilde):
        return [(1 - lr * decay) * t - lr * g for t, g in zip(theta, g_tilde)]

    theta0 = model.get_weights()
    g_tilde = [kappa * g for g in mean_grad(theta0, x1, y1)]  # d_0 = 0: both points coincide
    theta1 = sgd_step(theta0, g_tilde)
    look_ahead = [t1 + gamma * (t1 - t0) for t0, t1 in zip(theta0, theta1)]
    u = [c * a + (1 - c) * b for a, b in zip(mean_grad(look_ahead, x2, y2), mean_grad(theta1, x2, y2))]
    g_tilde = [(1 - kappa) * gt + kappa * ui for gt, ui in zip(g_tilde, u)]
    theta2 = sgd_step(theta1, g_tilde)
    model.train_on_batch(x1, y1, batch_size=len(y1))
    model.train_on_batch(x2, y2, batch_size=len(y2))
    for got, want in zip(model.get_weights(), theta2):
        # The old direction θ_1 − (1 − ηλ)θ_0 moves the look-ahead by γηλθ_0 ≈ 0.025·θ_0,
        # hence θ_2 by ≳ 1e-4 here; float32 agreement is ~1e-7.
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-7)


# -- 2 and 3. the noise variance the filters leave ------------------------------------------

def _innovation_attenuations(omega, steps):
    covariance, values = np.zeros(3), []
    for _ in range(steps):
        covariance = np.asarray(innovation_noise_covariance_step(covariance, omega), dtype=np.float64)
        values.append(covariance[0])
    return np.array(values)


def _ema_attenuations(kappa, steps):
    variance, values = 0.0, []
    for _ in range(steps):
        variance = ema_noise_variance_step(variance, kappa)
        values.append(variance)
    return np.array(values)


def _empirical_variances(step, steps, chains=40_000, seed=0):
    """Var of the filter output at t = 1..steps, filters started at zero fed N(0, 1)."""
    rng = np.random.default_rng(seed)
    state, variances = None, []
    for _ in range(steps):
        state = step(state, rng.normal(size=chains))
        variances.append(np.var(state[0]))
    return np.array(variances)


def _innovation_step(omega):
    def step(state, noise):
        filtered, residual = (0.0, 0.0) if state is None else state
        return innovation_filter(filtered, residual, noise, omega)
    return step


def _ema_step(kappa):
    def step(state, noise):
        return (ema_filter(0.0 if state is None else state[0], noise, kappa),)
    return step


@pytest.mark.parametrize("kind, gain", [("innovation", 0.2), ("innovation", 0.5), ("innovation", 0.9),
                                        ("ema", 0.3), ("ema", 0.7)])
def test_time_varying_attenuation_matches_the_filter_on_pure_noise(kind, gain):
    if kind == "innovation":
        exact, step, stationary = _innovation_attenuations(gain, 2000), _innovation_step(gain), attenuation_factor(gain)
    else:
        exact, step, stationary = _ema_attenuations(gain, 2000), _ema_step(gain), ema_attenuation_factor(gain)
    empirical = _empirical_variances(step, 10)
    chains = 40_000
    for t in (1, 5, 10):
        # The sample variance of n = 40,000 independent N(0, A_t) has relative sd √(2/n) =
        # 0.7 %: 5 sd = 3.5 %. Using the stationary A instead is off by 58–92 % at t = 1
        # (innovation filter, ω = 0.5 / 0.2).
        assert abs(empirical[t - 1] / exact[t - 1] - 1) < 5 * np.sqrt(2 / chains), t
    assert np.all(np.diff(exact) >= -1e-15) and np.all(exact <= stationary * (1 + 1e-12))  # grows to A
    assert exact[-1] == pytest.approx(stationary, rel=1e-9)


def test_ema_attenuation_has_its_closed_form():
    kappa = 0.7
    t = np.arange(1, 31)
    closed = kappa / (2 - kappa) * (1 - (1 - kappa) ** (2 * t))
    np.testing.assert_allclose(_ema_attenuations(kappa, 30), closed, rtol=1e-12)
    assert ema_attenuation_factor(kappa) == pytest.approx(0.7 / 1.3)


def _run_on_constant_signal(optimizer, steps=6, size=64, batch_size=4.0, signal=0.5):
    """The optimizer on clipped sums L·s, so ĝ_t = s + N(0, σ_w²); returns the iterates
    θ_0..θ_T, the filtered gradients g̃_1..g̃_T and σ_w²."""
    variable = keras.Variable(np.full(size, 0.3, dtype="float32"))
    thetas, filtered = [variable.numpy().copy()], []
    clipped_sum = tf.fill([size], signal * batch_size)
    for t in range(steps):
        with drawing_noise(optimizer):
            optimizer.apply_private_gradients([clipped_sum], [variable], batch_size, dp_step=tf.constant(t, tf.int64))
        filtered.append(optimizer._filtered_gradients[0].numpy().copy())
        thetas.append(variable.numpy().copy())
    noise_variance = (optimizer.noise_multiplier * optimizer.l2_norm_clip / batch_size) ** 2
    return thetas, filtered, noise_variance


def _float32_bias_correction(beta, t):
    return float(np.float32(1) - np.power(np.float32(beta), np.float32(t), dtype=np.float32))


def _corrected_adamw(thetas, filtered, noise_variances, lr, decay, floor, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
    """θ_{t+1} = (1 − ηλ)θ_t − η m̂_t / (√max(v̂_t − n_t, floor) + ε) from the recorded g̃_t.
    Returns the expected θ_{t+1} and the float32 tolerance of each step: v̂ − n loses
    ~1e-6·v̂ in float32, so the step is good to ~1e-6·(2 + v̂/v̄) relative (× 5)."""
    m = v = 0.0
    expected, tolerances = [], []
    for t, (theta, g) in enumerate(zip(thetas[:-1], filtered), start=1):
        g = g.astype(np.float64)
        m = beta_1 * m + (1 - beta_1) * g
        v = beta_2 * v + (1 - beta_2) * g**2
        # Adam's bias corrections as the float32 graph computes them (1 − float32(β)^t: at t = 1
        # that is 1.3e-5 off 1 − β₂, a rounding of Keras' Adam, not of the correction under test).
        m_hat, v_hat = m / _float32_bias_correction(beta_1, t), v / _float32_bias_correction(beta_2, t)
        v_bar = np.maximum(v_hat - noise_variances[t - 1], floor)
        step = lr * m_hat / (np.sqrt(v_bar) + epsilon)
        expected.append((1 - lr * decay) * theta - step)
        tolerances.append(5e-6 * (2 + v_hat / v_bar) * np.abs(step) + 1e-7 * lr)
    return expected, tolerances


@pytest.mark.parametrize("name", ["disk", "fiber"])
def test_correction_subtracts_the_time_varying_variance_the_filter_leaves(name):
    """Each update, replayed in float64 from the recorded g̃_t, subtracts A_t σ_w² (DiSK:
    A_t → κ/(2 − κ) = 0.54 at κ = 0.7; FIBER: A_t → A(ω)). With signal 0.5 and σ_w = 0.5,
    subtracting the full σ_w², or the stationary A from the first step, changes v̄ by tens
    of percent and each step by ≳ 1e-3·η; float32 agrees to ~1e-6 relative."""
    lr, steps, floor = 0.01, 6, 1e-3
    common = dict(noise_multiplier=2.0, l2_norm_clip=1.0, seed=5, variance_floor=floor)
    if name == "disk":
        optimizer = tf_dp.DiSK(lr, kappa=0.7, base="adam", noise_bias_correction=True, **common)
        factors, decay = _ema_attenuations(0.7, steps), 0.0
    else:
        optimizer = tf_dp.FIBER(lr, kappa=0.7, omega=0.3, weight_decay=0.01, **common)
        factors, decay = _innovation_attenuations(0.3, steps), 0.01
    thetas, filtered, noise_variance = _run_on_constant_signal(optimizer, steps)
    assert noise_variance == pytest.approx(0.25)
    assert float(optimizer.filter_attenuation()) == pytest.approx(factors[-1], rel=1e-6)
    assert float(optimizer.noise_variance_on_average(tf.float32)) == pytest.approx(factors[-1] * noise_variance,
                                                                                   rel=1e-6)
    expected, tolerances = _corrected_adamw(thetas, filtered, factors * noise_variance, lr, decay, floor)
    for t, (got, want, tolerance) in enumerate(zip(thetas[1:], expected, tolerances), start=1):
        assert np.all(np.abs(got - want) <= tolerance), f"step {t}: {np.max(np.abs(got - want) / tolerance)}"


# -- ablation options of the study: correction = "stationary" | "full", FIBER's EMA filter

@pytest.mark.parametrize("name", ["disk", "fiber"])
@pytest.mark.parametrize("correction", ["stationary", "full"])
def test_correction_options_subtract_the_stationary_or_the_full_variance(name, correction):
    """Replayed in float64: "stationary" subtracts A·σ_w² from step 1 on (A = κ/(2 − κ) or
    A(ω)), "full" subtracts σ_w² — at t = 1 these differ from A_1·σ_w² by 46–86 % here."""
    lr, steps, floor = 0.01, 6, 1e-3
    common = dict(noise_multiplier=2.0, l2_norm_clip=1.0, seed=5, variance_floor=floor, correction=correction)
    if name == "disk":
        optimizer = tf_dp.DiSK(lr, kappa=0.7, base="adam", noise_bias_correction=True, **common)
        stationary, decay = ema_attenuation_factor(0.7), 0.0
    else:
        optimizer = tf_dp.FIBER(lr, kappa=0.7, omega=0.3, weight_decay=0.01, **common)
        stationary, decay = attenuation_factor(0.3), 0.01
    thetas, filtered, noise_variance = _run_on_constant_signal(optimizer, steps)
    factor = stationary if correction == "stationary" else 1.0
    assert float(optimizer.noise_variance_on_average(tf.float32)) == pytest.approx(factor * noise_variance, rel=1e-6)
    expected, tolerances = _corrected_adamw(thetas, filtered, np.full(steps, factor * noise_variance), lr, decay, floor)
    for t, (got, want, tolerance) in enumerate(zip(thetas[1:], expected, tolerances), start=1):
        assert np.all(np.abs(got - want) <= tolerance), f"step {t}: {np.max(np.abs(got - want) / tolerance)}"
    if name == "fiber":
        assert tf_dp.FIBER.from_config(optimizer.get_config()).correction == correction


def test_fiber_ema_filter_is_the_ema_with_gain_omega_and_its_attenuation():
    """filter="ema": with σ = 0 the filtered constant signal s is s·(1 − (1 − ω)^t) (the EMA
    started at zero; the innovation filter gives a different sequence), and with σ > 0 each
    update subtracts the EMA's A_t·σ_w², A_t = (1 − ω)² A_{t−1} + ω² → ω/(2 − ω)."""
    omega, steps, lr, floor = 0.4, 6, 0.01, 1e-3
    silent = tf_dp.FIBER(lr, kappa=0.7, omega=omega, filter="ema", noise_multiplier=0.0, seed=5)
    _, filtered, _ = _run_on_constant_signal(silent, steps)
    want = 0.5 * (1 - (1 - omega) ** np.arange(1, steps + 1))
    np.testing.assert_allclose([f[0] for f in filtered], want, rtol=1e-6)
    noisy = tf_dp.FIBER(lr, kappa=0.7, omega=omega, filter="ema", weight_decay=0.0, noise_multiplier=2.0, seed=5,
                        variance_floor=floor)
    thetas, filtered, noise_variance = _run_on_constant_signal(noisy, steps)
    factors = _ema_attenuations(omega, steps)
    assert noisy.attenuation == pytest.approx(omega / (2 - omega))
    expected, tolerances = _corrected_adamw(thetas, filtered, factors * noise_variance, lr, 0.0, floor)
    for t, (got, want_t, tolerance) in enumerate(zip(thetas[1:], expected, tolerances), start=1):
        assert np.all(np.abs(got - want_t) <= tolerance), f"step {t}: {np.max(np.abs(got - want_t) / tolerance)}"
    with pytest.raises(ValueError, match="filter"):
        tf_dp.FIBER(lr, filter="kalman")
    with pytest.raises(ValueError, match="correction"):
        tf_dp.DiSK(lr, correction="half")


def test_disk_untuned_learning_rate_is_the_studys_for_adam_bases_and_keras_sgd_default_otherwise():
    # docs/fiber_study.md, "Untuned defaults": lr = 1e-3 left DiSK-AdamW 15-33 points below lr = 5e-3 at every ε.
    from tf_dp.optimizers.disk import DEFAULT_LEARNING_RATES

    for base, want in [("adamw", 5e-3), ("adam", 5e-3), ("sgd", keras.optimizers.SGD().get_config()["learning_rate"])]:
        optimizer = tf_dp.DiSK(base=base, l2_norm_clip=1.0, noise_multiplier=1.0)
        assert float(optimizer.learning_rate) == pytest.approx(want) == DEFAULT_LEARNING_RATES[base]
        assert float(type(optimizer).from_config(optimizer.get_config()).learning_rate) == pytest.approx(want)
    assert float(tf_dp.DiSK(0.02, l2_norm_clip=1.0, noise_multiplier=1.0).learning_rate) == pytest.approx(0.02)
