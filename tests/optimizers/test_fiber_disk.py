"""FIBER and DiSK: the filter's noise attenuation, reductions to their bases, two-point
steps by hand, resume bit for bit, and argument errors."""

import keras
import numpy as np
import pytest

import tf_dp
from tests.harness import loop_per_example_gradients, sparse_ce
from tf_dp.filters import attenuation_factor, innovation_filter


@pytest.mark.parametrize("omega", [0.1, 0.3, 0.6, 1.0])
def test_innovation_filter_attenuates_white_noise_by_a_of_omega(omega):
    steps, chains, burn_in = 4000, 64, 500
    rng = np.random.default_rng(0)
    noise = rng.normal(size=(steps, chains))
    filtered = np.zeros(chains)
    residual = np.zeros(chains)
    outputs = []
    for t in range(steps):
        filtered, residual = innovation_filter(filtered, residual, noise[t], omega)
        outputs.append(filtered)
    variance = np.var(np.array(outputs[burn_in:]))
    # n = 3500·64 correlated samples; the AR(2) correlation time is ≲ 2/ω steps, so the
    # effective sample size is ≳ n·ω/2 and the variance estimate's relative sd ≲ sqrt(2/(n·ω/2)).
    # 5 of those sds:
    tolerance = 5 * np.sqrt(4 / ((steps - burn_in) * chains * omega))
    assert abs(variance / attenuation_factor(omega) - 1) < tolerance


@pytest.mark.parametrize("omega", [0.05, 0.2, 0.5, 0.9, 1.0])
def test_attenuation_formula_matches_ar2_stationary_variance(omega):
    # g_t = a1 g_{t-1} + a2 g_{t-2} + ω w_t with a1 = 2(1−ω), a2 = −(1−ω). Stationary
    # variance of AR(2) with innovation variance ω²: (1−a2) ω² / ((1+a2)((1−a2)² − a1²)).
    a1, a2 = 2 * (1 - omega), -(1 - omega)
    direct = (1 - a2) * omega**2 / ((1 + a2) * ((1 - a2) ** 2 - a1**2))
    assert attenuation_factor(omega) == pytest.approx(direct, rel=1e-12)
    assert attenuation_factor(1.0) == 1.0


def _model(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(6, activation="tanh")(inputs)
    return tf_dp.DPModel(inputs, keras.layers.Dense(3)(hidden))


def _batches(steps=4):
    rng = np.random.default_rng(3)
    return [(rng.normal(size=(8, 5)).astype("float32"), rng.integers(0, 3, 8).astype("int32")) for _ in range(steps)]


def _train(optimizer, steps=4):
    model = _model(0)
    model.compile(optimizer=optimizer, loss=sparse_ce)
    for x, y in _batches(steps):
        model.train_on_batch(x, y, batch_size=len(y))
    return model.get_weights()


def _assert_same(a, b, atol=1e-7):
    for u, v in zip(a, b):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("sigma", [0.0, 1.0])
def test_fiber_reduces_to_dp_adamw_with_and_without_correction(sigma):
    common = dict(learning_rate=0.01, l2_norm_clip=0.5, noise_multiplier=sigma, seed=4, weight_decay=0.01)
    for correction in (True, False):
        fiber = tf_dp.FIBER(kappa=1.0, gamma=0.0, omega=1.0, noise_bias_correction=correction, **common)
        adamw = tf_dp.DPAdamW(noise_bias_correction=correction, **common)
        # With ω = 1 the filter computes g̃ + (ĝ − g̃), equal to ĝ up to one float32 rounding,
        # which Adam's m/√v can magnify to ~1e-6 on noisy steps: a bug (wrong A(ω), lost
        # noise, wrong state) moves weights by ≥ 1e-3 here.
        _assert_same(_train(fiber), _train(adamw), atol=1e-5 if sigma else 1e-7)


def test_fiber_filter_changes_the_trajectory():
    common = dict(learning_rate=0.01, l2_norm_clip=0.5, noise_multiplier=1.0, seed=4)
    a = _train(tf_dp.FIBER(kappa=1.0, omega=0.3, **common))
    b = _train(tf_dp.DPAdamW(noise_bias_correction=True, **common))
    assert not np.allclose(a[0], b[0])


@pytest.mark.parametrize("base, reference", [
    ("adamw", lambda kw: tf_dp.DPAdamW(**kw)),
    ("adam", lambda kw: tf_dp.DPAdam(**kw)),
    ("sgd", lambda kw: tf_dp.DPSGD(**kw)),
])
def test_disk_with_kappa_one_is_its_base(base, reference):
    common = dict(learning_rate=0.05, l2_norm_clip=0.5, noise_multiplier=0.8, seed=2)
    _assert_same(_train(tf_dp.DiSK(kappa=1.0, gamma=0.5, base=base, **common)), _train(reference(common)))


def test_disk_two_point_steps_match_hand_computation():
    """σ = 0, no clipping, DiSK-SGD: step 2 evaluates at θ1 + γ(θ1 − θ0)."""
    kappa, gamma, lr = 0.6, 0.5, 0.1
    c = (1 - kappa) / (kappa * gamma)
    model = _model(0)
    model.compile(optimizer=tf_dp.DiSK(lr, kappa=kappa, gamma=gamma, base="sgd", l2_norm_clip=1e9,
                                       noise_multiplier=0.0),
                  loss=sparse_ce)
    reference = _model(0)
    (x1, y1), (x2, y2) = _batches(2)

    def mean_grad(weights, x, y):
        for v, w in zip(reference.trainable_variables, weights):
            v.assign(w)
        per_example = loop_per_example_gradients(reference, x, y)
        return [np.mean([g[v] for g in per_example], axis=0) for v in range(len(weights))]

    theta0 = model.get_weights()
    g_tilde = [kappa * g for g in mean_grad(theta0, x1, y1)]  # d_0 = 0: both points coincide
    theta1 = [t - lr * g for t, g in zip(theta0, g_tilde)]
    look_ahead = [t1 + gamma * (t1 - t0) for t0, t1 in zip(theta0, theta1)]
    u = [c * a + (1 - c) * b for a, b in zip(mean_grad(look_ahead, x2, y2), mean_grad(theta1, x2, y2))]
    g_tilde = [(1 - kappa) * gt + kappa * ui for gt, ui in zip(g_tilde, u)]
    theta2 = [t - lr * g for t, g in zip(theta1, g_tilde)]
    model.train_on_batch(x1, y1, batch_size=len(y1))
    _assert_same(model.get_weights(), theta1)
    model.train_on_batch(x2, y2, batch_size=len(y2))
    _assert_same(model.get_weights(), theta2)


@pytest.mark.parametrize("make", [
    lambda: tf_dp.FIBER(0.01, omega=0.4, noise_multiplier=1.0, seed=8),
    lambda: tf_dp.DiSK(0.01, base="adamw", noise_multiplier=1.0, seed=8),
])
def test_save_and_resume_continues_bit_for_bit(make, tmp_path):
    batches = _batches(6)
    straight = _model(0)
    straight.compile(optimizer=make(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for x, y in batches:
        straight.train_on_batch(x, y, batch_size=len(y))
    first = _model(0)
    first.compile(optimizer=make(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for x, y in batches[:3]:
        first.train_on_batch(x, y, batch_size=len(y))
    first.save(tmp_path / "mid.keras")
    resumed = keras.models.load_model(tmp_path / "mid.keras")
    # The noise key is never saved; a seeded resume is a lab run's explicit opt-in (it voids DP if repeated).
    resumed.optimizer.set_seed(8, allow_resume=True)
    assert type(resumed.optimizer) is type(first.optimizer)
    for x, y in batches[3:]:
        resumed.train_on_batch(x, y, batch_size=len(y))
    for a, b in zip(resumed.get_weights(), straight.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert resumed.optimizer.get_config() == straight.optimizer.get_config()


@pytest.mark.parametrize("kwargs, match", [
    ({"omega": 0.0}, "omega"), ({"omega": 1.5}, "omega"), ({"kappa": 0.0}, "kappa"), ({"kappa": 1.2}, "kappa"),
    ({"gamma": -0.1}, "gamma"), ({"kappa": 0.5, "gamma": 0.0}, "undefined"),
])
def test_fiber_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tf_dp.FIBER(0.01, noise_multiplier=1.0, **kwargs)


def test_disk_bad_base():
    with pytest.raises(ValueError, match="base"):
        tf_dp.DiSK(0.01, base="rmsprop")


def test_config_round_trip_and_attenuation_exposed():
    fiber = tf_dp.FIBER(0.02, kappa=0.8, gamma=0.3, omega=0.25, noise_multiplier=1.0, seed=1)
    assert tf_dp.FIBER.from_config(fiber.get_config()).get_config() == fiber.get_config()
    assert tf_dp.optimizers.attenuation_factor(0.25) == pytest.approx(1.75 / 3.25)
    disk = tf_dp.DiSK(0.02, base="sgd", momentum=0.5, noise_multiplier=1.0)
    clone = type(disk).from_config(disk.get_config())
    assert clone.get_config() == disk.get_config() and clone.base == "sgd"
