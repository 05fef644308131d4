"""RaCO-DP accounting (docs/algorithms.md §5): reference numbers, soundness, and the contrast with
the (invalid) separate composition that the paper's public code uses. The reference numbers are
PLD's: calls that relied on RaCO's former default accountant "pld" pass it (the default is "rdp"
everywhere now)."""

import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import privacy_loss_distribution as dp_pld
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import integrate, stats

from tf_dp.accounting import accountant as dp_sgd_accountant
from tf_dp.raco import accounting as raco
from tf_dp.raco import calibrate_noise_multiplier, calibrate_steps, compute_epsilon, joint_step_pld

# docs/algorithms.md §5 reference: Adult, batch 4096 (Poisson), σ = 4, Laplace b = 0.5 (scale 2), δ = 1e-4.
ADULT = dict(num_examples=32561, batch_size=4096, noise_multiplier=4.0, histogram_noise=2.0, delta=1e-4)
ADULT_Q = 4096 / 32561
# The reference numbers are printed to 3 decimals (rounding error ≤ 5e-4); the computation is
# deterministic given the grid Δ = 1e-4, so 1e-3 leaves 5e-4 for float/FFT noise. It is ~80×
# smaller than the joint-vs-separate gap (≥ 0.075), so the test separates the two accountings.
REFERENCE_TOLERANCE = 1e-3
JOINT_REFERENCE = {10: 0.732, 20: 1.058, 40: 1.538}
SEPARATE_REFERENCE = {10: 0.657, 20: 0.972, 40: 1.437}


# ---------------------------------------------------------------- reference numbers


@pytest.mark.parametrize("steps, expected", sorted(JOINT_REFERENCE.items()))
def test_joint_step_pld_reproduces_the_reference(steps, expected):
    assert compute_epsilon(steps=steps, accountant="pld", **ADULT) == pytest.approx(expected, abs=REFERENCE_TOLERANCE)


def test_separate_composition_is_the_references_smaller_and_invalid_number():
    """Documented contrast, NOT used by the package: Poisson(q, Gaussian) ∘ Poisson(q, Laplace)
    samples two independent batches, which is not the mechanism that runs."""
    step = dp_event.ComposedDpEvent([
        dp_event.PoissonSampledDpEvent(ADULT_Q, dp_event.GaussianDpEvent(4.0)),
        dp_event.PoissonSampledDpEvent(ADULT_Q, dp_event.LaplaceDpEvent(2.0)),
    ])
    for steps, expected in SEPARATE_REFERENCE.items():
        separate = dp_sgd_accountant.epsilon_of_event(dp_event.SelfComposedDpEvent(step, steps), 1e-4, "pld")
        assert separate == pytest.approx(expected, abs=REFERENCE_TOLERANCE)
        assert separate < compute_epsilon(steps=steps, accountant="pld", **ADULT) - 0.05


def test_epsilon_one_allows_18_steps_not_20():
    assert calibrate_steps(1.0, accountant="pld", **ADULT) == 18
    assert compute_epsilon(steps=18, accountant="pld", **ADULT) <= 1.0 < compute_epsilon(steps=19, accountant="pld",
                                                                                         **ADULT)


# ---------------------------------------------------------------- one step against the truth


def _true_remove_divergence(q, sigma, scale, eps):
    """(δ(ε), P(L > ε)) of ONE step, remove direction, by direct integration over the raw
    outputs (x, y) ∈ ℝ² of the Gaussian (shift 1, std σ) and the Laplace (shift 1, scale):
    upper (1−q)Q + qP, lower Q. For fixed y the set where the upper density beats c·Q,
    c = e^ε − 1 + q, is x > x*, so the x-integral is in normal tails; y is integrated by quad.
    The add direction is 0 here: its loss is ≤ −log(1−q) < ε for all cases used below."""
    c = math.expm1(eps) + q

    def laplace(y):
        return math.exp(-abs(y) / scale) / (2 * scale)

    def threshold(y):
        return sigma**2 * (math.log(c / q) + (abs(y - 1) - abs(y)) / scale) + 0.5

    def divergence(y):
        x = threshold(y)
        return q * laplace(y - 1) * stats.norm.sf((x - 1) / sigma) - c * laplace(y) * stats.norm.sf(x / sigma)

    def tail(y):
        x = threshold(y)
        return q * laplace(y - 1) * stats.norm.sf((x - 1) / sigma) + (1 - q) * laplace(y) * stats.norm.sf(x / sigma)

    def integral(f):
        pieces = [(-np.inf, 0), (0, 1), (1, np.inf)]  # the Laplace kinks
        return sum(integrate.quad(f, a, b, epsabs=1e-14, epsrel=1e-12, limit=200)[0] for a, b in pieces)

    return integral(divergence), integral(tail)


@pytest.mark.parametrize("q, sigma, scale, eps, documented", [
    (0.3, 1.0, 1.0, 1.0, 0.0266),      # docs/algorithms.md §5 Monte-Carlo, shared batch
    (0.1365, 4.0, 2.0, 0.2, 2.8e-4),   # docs/algorithms.md §5, the reference's noise
    (1.0, 1.0, 1.0, 1.0, None),        # no subsampling (symmetric PLD path)
    (0.05, 0.5, 0.3, 2.0, None),       # small noise, wide grid
])
def test_one_step_pld_is_pessimistic_and_tight(q, sigma, scale, eps, documented):
    interval = 1e-4
    truth, tail = _true_remove_divergence(q, sigma, scale, eps)
    pld_delta = joint_step_pld(q, sigma, scale, interval).get_delta_for_epsilon(eps)
    # Rounding each loss UP by ≤ Δ raises (1 − e^{ε−L})_+ by ≤ 1 − e^{−Δ} ≤ Δ, and only where
    # the rounded loss exceeds ε, i.e. L > ε − Δ: 0 ≤ δ_pld − δ ≤ Δ·P(L > ε − Δ) (≈ Δ·P(L > ε)).
    # 1e-11 covers quad's error; the 1.01 the P(L > ε − Δ) vs P(L > ε) difference.
    assert truth - 1e-11 <= pld_delta <= truth + 1.01 * interval * tail + 1e-11
    if documented is not None:  # the documented values are 3-significant-digit Monte-Carlo
        assert truth == pytest.approx(documented, rel=0.02)


def test_monte_carlo_of_the_shared_batch_mechanism():
    """Seeded Monte-Carlo of the raw mechanism (independent of the closed-form CDFs):
    q = 0.3, σ = 1, Laplace scale 1, ε = 1 → shared 0.0266, separate treatment 0.0112."""
    q, sigma, scale, eps, n = 0.3, 1.0, 1.0, 1.0, 2_000_000
    rng = np.random.default_rng(7)
    in_batch = rng.random(n) < q  # sample from the upper (1−q)Q + qP
    x = rng.normal(in_batch.astype(float), sigma)
    y = rng.laplace(in_batch.astype(float), scale)
    base_loss = (2 * x - 1) / (2 * sigma**2) + (np.abs(y) - np.abs(y - 1)) / scale
    loss = np.log1p(q * np.expm1(base_loss))
    values = np.maximum(0.0, 1.0 - np.exp(eps - loss))
    estimate, standard_error = values.mean(), values.std() / math.sqrt(n)  # ≈ 1e-4
    pld_delta = joint_step_pld(q, sigma, scale).get_delta_for_epsilon(eps)
    assert abs(pld_delta - estimate) < 5 * standard_error
    separate = dp_pld.from_gaussian_mechanism(sigma, sampling_prob=q).compose(
        dp_pld.from_laplace_mechanism(scale, sampling_prob=q)).get_delta_for_epsilon(eps)
    assert separate == pytest.approx(0.0112, abs=3e-4)
    assert separate < estimate - 50 * standard_error  # the separate treatment understates


@pytest.mark.parametrize("sigma, scale", [(1.0, 1.0), (4.0, 2.0), (0.2, 5.0), (10.0, 0.1)])
def test_closed_form_cdfs_match_quadrature(sigma, scale):
    base = raco.JointBaseLoss(sigma, scale)
    s, mu, b = base.gaussian_loss_std, base.gaussian_loss_mean, base.laplace_epsilon

    def cdf_by_quadrature(z):  # Z = G + U under Q, G ~ N(−μ, s²), U atoms + density on (−b, b)
        atoms = 0.5 * stats.norm.cdf((z + mu + b) / s) + 0.5 * math.exp(-b) * stats.norm.cdf((z + mu - b) / s)

        def density(u):
            return 0.25 * math.exp(-(u + b) / 2) * stats.norm.cdf((z + mu - u) / s)

        return atoms + integrate.quad(density, -b, b, epsabs=1e-15, epsrel=1e-13, limit=200)[0]

    zs = np.linspace(-mu - b - 6 * s, mu + b + 6 * s, 15)
    expected = np.array([cdf_by_quadrature(z) for z in zs])
    np.testing.assert_allclose(base.cdf_without(zs), expected, rtol=0, atol=1e-12)
    np.testing.assert_allclose(base.sf_without(zs), 1 - expected, rtol=0, atol=1e-12)
    np.testing.assert_allclose(base.cdf_with(zs), 1 - base.sf_with(zs), rtol=0, atol=1e-12)
    # P-law = e^z · Q-law: E_Q[e^Z] = 1 (mass of P); check via the CDFs on a fine grid.
    grid = np.linspace(-mu - b - 9 * s, mu + b + 9 * s, 200_001)
    q_mass = np.diff(base.cdf_without(grid))
    assert float(np.sum(q_mass * np.exp(0.5 * (grid[1:] + grid[:-1])))) == pytest.approx(1.0, abs=1e-3)


def test_joint_pld_tends_to_each_single_mechanism():
    """Huge Laplace scale → subsampled Gaussian; huge σ → subsampled Laplace (dp_accounting)."""
    q, steps, delta = 0.1, 20, 1e-5
    gaussian_only = dp_pld.from_gaussian_mechanism(1.0, sampling_prob=q).self_compose(steps)
    laplace_only = dp_pld.from_laplace_mechanism(1.0, sampling_prob=q).self_compose(steps)
    joint_g = joint_step_pld(q, 1.0, 1e5).self_compose(steps)
    joint_l = joint_step_pld(q, 1e4, 1.0).self_compose(steps)
    assert joint_g.get_epsilon_for_delta(delta) == pytest.approx(gaussian_only.get_epsilon_for_delta(delta), abs=2e-3)
    assert joint_l.get_epsilon_for_delta(delta) == pytest.approx(laplace_only.get_epsilon_for_delta(delta), abs=2e-3)


# ---------------------------------------------------------------- RDP and Gaussian modes


def test_rdp_mode_is_looser_than_pld_on_the_reference():
    for steps in JOINT_REFERENCE:
        rdp = compute_epsilon(steps=steps, accountant="rdp", **ADULT)
        assert rdp >= compute_epsilon(steps=steps, accountant="pld", **ADULT)
        assert math.isfinite(rdp)


def test_laplace_rdp_is_mironovs_proposition_6():
    orders = np.arange(2, 40)
    expected = [rdp_privacy_accountant._laplace_rdp(0.5, a) for a in orders]  # ε = b = 1/scale
    np.testing.assert_allclose(raco.laplace_rdp(orders, 2.0), expected, rtol=1e-12)


@pytest.mark.parametrize("q, sigma", [(0.01, 1.0), (ADULT_Q, 4.0), (0.5, 0.8)])
def test_general_subsampling_bound_is_above_the_exact_gaussian_rdp(q, sigma):
    """Zhu & Wang's bound for ANY base mechanism must dominate the exact subsampled-Gaussian
    RDP (dp_accounting) when the base is a Gaussian; equality at q = 1."""
    orders = np.array(raco.INTEGER_RDP_ORDERS)
    bound = raco.poisson_subsampled_rdp(q, orders, lambda a: raco.gaussian_rdp(a, sigma))
    exact = rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian(q, sigma, orders)
    assert np.all(bound >= exact - 1e-12)
    assert np.all(bound <= raco.gaussian_rdp(orders, sigma) + np.log(3) / (orders - 1))
    np.testing.assert_allclose(raco.poisson_subsampled_rdp(1.0, orders, lambda a: raco.gaussian_rdp(a, sigma)),
                               raco.gaussian_rdp(orders, sigma))


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_gaussian_histogram_is_one_subsampled_gaussian(accountant):
    sigma_eff = raco.effective_noise_multiplier(4.0, 3.0)
    assert sigma_eff == pytest.approx(1 / math.sqrt(4.0**-2 + 3.0**-2))
    expected = dp_sgd_accountant.compute_epsilon(32561, 4096, sigma_eff, steps=30, delta=1e-4, accountant=accountant)
    got = compute_epsilon(32561, 4096, 4.0, 3.0, 30, 1e-4, histogram_mechanism="gaussian", accountant=accountant)
    assert got == pytest.approx(expected, rel=1e-12)
    assert got > dp_sgd_accountant.compute_epsilon(32561, 4096, 4.0, steps=30, delta=1e-4, accountant=accountant)


# ---------------------------------------------------------------- monotonicity and calibration


@pytest.mark.parametrize("mechanism, accountant", [("laplace", "pld"), ("laplace", "rdp"), ("gaussian", "pld")])
def test_epsilon_grows_with_steps_and_falls_with_noise(mechanism, accountant):
    def eps(steps=20, sigma=4.0, histogram=2.0):
        return compute_epsilon(32561, 4096, sigma, histogram, steps, 1e-4, mechanism, accountant)

    base = eps()
    assert eps(steps=10) < base < eps(steps=40)
    assert eps(sigma=6.0) < base < eps(sigma=3.0)
    assert eps(histogram=4.0) < base < eps(histogram=1.0)
    assert math.isinf(eps(sigma=0.0))  # documented: an un-noised gradient is not private


@pytest.mark.parametrize("mechanism, accountant, target", [
    ("laplace", "rdp", 2.0), ("gaussian", "rdp", 1.5), ("laplace", "pld", 3.0),
])
def test_calibrate_steps_round_trips(mechanism, accountant, target):
    settings = dict(histogram_mechanism=mechanism, accountant=accountant, **ADULT)
    steps = calibrate_steps(target, **settings)
    assert compute_epsilon(steps=steps, **settings) <= target < compute_epsilon(steps=steps + 1, **settings)


def test_calibrate_steps_caps_at_max_steps_and_refuses_unreachable_targets():
    assert calibrate_steps(50.0, max_steps=7, accountant="pld", **ADULT) == 7
    with pytest.raises(ValueError, match="unreachable"):
        calibrate_steps(0.01, accountant="pld", **ADULT)


def test_calibrate_noise_multiplier_round_trips():
    settings = dict(num_examples=32561, batch_size=4096, histogram_noise=2.0, steps=18, delta=1e-4, accountant="pld")
    sigma = calibrate_noise_multiplier(1.0, **settings)
    assert sigma <= 4.0  # 18 steps at σ = 4 fit in ε = 1
    assert compute_epsilon(noise_multiplier=sigma, **settings) <= 1.0
    assert compute_epsilon(noise_multiplier=sigma * 0.99, **settings) > 1.0


def test_calibrate_noise_multiplier_names_a_histogram_that_spends_the_budget():
    with pytest.raises(ValueError, match="histogram_noise"):
        calibrate_noise_multiplier(0.5, 32561, 4096, histogram_noise=0.1, steps=100, delta=1e-4, accountant="pld")


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("overrides, match", [
    ({"num_examples": 0}, "num_examples"),
    ({"batch_size": 40000}, "batch_size"),
    ({"batch_size": 0}, "batch_size"),
    ({"noise_multiplier": -1.0}, "noise_multiplier"),
    ({"noise_multiplier": "4"}, "noise_multiplier"),
    ({"histogram_noise": 0.0}, "histogram_noise"),
    ({"histogram_noise": -2.0}, "histogram_noise"),
    ({"steps": 0}, "steps"),
    ({"steps": 2.5}, "steps"),
    ({"delta": 0.0}, "delta"),
    ({"delta": 1.0}, "delta"),
    ({"histogram_mechanism": "exponential"}, "histogram_mechanism"),
    ({"accountant": "moments"}, "accountant"),
])
def test_bad_arguments_are_named(overrides, match):
    args = {**ADULT, "steps": 10, **overrides}
    with pytest.raises((ValueError, TypeError), match=match):
        compute_epsilon(**args)


@pytest.mark.parametrize("args, match", [
    ((0.0, 4.0, 2.0), "sampling_rate"),
    ((1.5, 4.0, 2.0), "sampling_rate"),
    ((0.1, 0.0, 2.0), "noise_multiplier"),
    ((0.1, 4.0, -1.0), "laplace_scale"),
    ((0.1, 4.0, 2.0, 0.0), "value_discretization_interval"),
])
def test_joint_step_pld_rejects_bad_arguments(args, match):
    with pytest.raises((ValueError, TypeError), match=match):
        joint_step_pld(*args)


def test_calibration_rejects_bad_targets():
    with pytest.raises(ValueError, match="target_epsilon"):
        calibrate_steps(0.0, **ADULT)
    with pytest.raises(ValueError, match="target_epsilon"):
        calibrate_noise_multiplier(-1.0, 32561, 4096, 2.0, 10)
