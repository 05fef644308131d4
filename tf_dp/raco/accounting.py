"""Privacy accounting of RaCO-DP (docs/algorithms.md §5), a plug-in of ``tf_dp.accounting``.

The step is the ``StepEvent`` ``GaussianLaplaceDpEvent`` (its own RDP and PLD), registered for
the ledger's scheme "raco_poisson" (``Phase.parameter`` = the Laplace scale 1/b), so the
ledger, ``tf_dp.compute_epsilon(..., scheme="raco_poisson", parameter=1/b)`` and this
module's functions all go through ``tf_dp.accounting.events.epsilon``.

One RaCO-DP step reads ONE Poisson batch (rate q) twice: a Gaussian mechanism on the clipped
gradient sum (noise multiplier σ, ℓ2 sensitivity 1 after dividing by the clip C) and a
Laplace mechanism on the rate histogram (scale 1/b, ℓ1 sensitivity 1, so pure b-DP). The
step is therefore ONE Poisson-subsampled mechanism whose base mechanism is the pair
M = (Gaussian, Laplace). It is not the composition of a subsampled Gaussian with a separately
subsampled Laplace (that understates δ at the reference noise, see docs/algorithms.md §5).

Notation (used throughout): with P = M(D ∪ {x}) and Q = M(D), the base privacy loss is
Z = log(dP/dQ) = Z_G + Z_L, the two parts independent under P and under Q:

    Z_G ~ N(+μ, s²) under P,  N(−μ, s²) under Q,       s = 1/σ,  μ = s²/2;
    Z_L = (|y| − |y − 1|)·b  for the Laplace output y, supported on [−b, b]:
        under Q: atom ½ at −b, atom ½e^{−b} at +b, density ¼e^{−(u+b)/2} on (−b, b);
        under P: the mirror image (atom ½ at +b, ½e^{−b} at −b, density ¼e^{(u−b)/2}).

Poisson subsampling (dp_accounting's convention, ``privacy_loss_mechanism``):
    remove: upper (1−q)Q + qP, lower Q:  L = log(1 − q + q·e^Z),   Z ~ (1−q)Q + qP;
    add:    upper Q, lower (1−q)Q + qP:  L = −log(1 − q + q·e^Z),  Z ~ Q.

Modes of :func:`compute_epsilon` (accountant "rdp" by default, as everywhere in tf_dp):
    laplace + pld  the joint-step PLD (:func:`joint_step_pld`), self-composed T times;
    laplace + rdp  base RDP ε_G(α) + ε_L(α) through Zhu & Wang 2019 Thm 6 (sound, looser);
    gaussian       one subsampled Gaussian with σ_eff = (σ⁻² + σ_h⁻²)^(−1/2), any accountant.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import attr
import numpy as np
from dp_accounting import dp_event
from dp_accounting.pld import pld_pmf
from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution
from scipy import special, stats

from tf_dp import _checks
from tf_dp.accounting import accountant as core
from tf_dp.accounting.accountant import LARGEST_NOISE_MULTIPLIER, PLD_DISCRETIZATION, RDP_ORDERS, largest_fitting
from tf_dp.accounting.events import DEFAULT_ACCOUNTANT, Phase, StepEvent, check_accountant, register_event

HISTOGRAM_MECHANISMS = ("laplace", "gaussian")
# Integer RDP orders only: Zhu & Wang's general subsampling bound holds for integer α ≥ 2.
INTEGER_RDP_ORDERS = tuple(int(a) for a in RDP_ORDERS if float(a).is_integer() and a >= 2)
# Probability mass of Z beyond the PLD grid, per side and per step (pessimistically handled).
TAIL_MASS = 1e-15
SCHEME = "raco_poisson"  # the ledger's scheme of a RaCO-DP phase (Phase.parameter = Laplace scale)


# --------------------------------------------------------------------------------------
# The base privacy loss Z = Z_G + Z_L of the pair (Gaussian, Laplace): exact CDFs.
# --------------------------------------------------------------------------------------


def _log_normal_mass(lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
    """log(Φ(upper) − Φ(lower)) for lower ≤ upper, accurate in both tails."""
    in_upper_tail = lower > 0
    # By symmetry Φ(u) − Φ(l) = Φ(−l) − Φ(−u): use the side where the CDFs are small.
    big = np.where(in_upper_tail, special.log_ndtr(-lower), special.log_ndtr(upper))
    small = np.where(in_upper_tail, special.log_ndtr(-upper), special.log_ndtr(lower))
    with np.errstate(divide="ignore", invalid="ignore"):
        log_mass = big + np.log1p(-np.exp(small - big))
    return np.where(np.isneginf(big), -np.inf, log_mass)  # both CDFs underflow: mass 0


@dataclass(frozen=True)
class JointBaseLoss:
    """Privacy loss Z = Z_G + Z_L of the base pair (Gaussian σ, Laplace scale 1/b).

    Under Q write Z = G + U with G ~ N(−μ, s²) and U = Z_L. The continuous part of U is
    −b + V with V of density ¼e^{−v/2} on (0, 2b), so with w = z + μ + b, a = ½, B = 2b:

        F_Q(z) = ½Φ((z+μ+b)/s) + ½e^{−b}Φ((z+μ−b)/s) + ½K(w),
        K(w)   = ∫₀^B a e^{−av} Φ((w−v)/s) dv
               = Φ(w/s) − e^{−aB}Φ((w−B)/s) − J(w),
        J(w)   = e^{−aw + a²s²/2} [Φ((B−w)/s + as) − Φ(−w/s + as)]   (integration by parts),

    and K̄(w) = (1 − e^{−aB}) − K(w) = Φ̄(w/s) − e^{−aB}Φ̄((w−B)/s) + J(w) for the survival
    function. Under P, Z has the law of −Z under Q (both parts are symmetric), so
    F_P(z) = S_Q(−z) and S_P(z) = F_Q(−z). Everything is closed form: no quadrature.
    """

    noise_multiplier: float
    laplace_scale: float

    @property
    def gaussian_loss_std(self) -> float:
        """s = 1/σ: Z_G = (2x − 1)/(2σ²) for the Gaussian output x has std 1/σ."""
        return 1.0 / self.noise_multiplier

    @property
    def gaussian_loss_mean(self) -> float:
        """μ = 1/(2σ²) = KL divergence of the Gaussian part."""
        return 0.5 * self.gaussian_loss_std**2

    @property
    def laplace_epsilon(self) -> float:
        """b = sensitivity / scale = 1 / scale: Z_L ∈ [−b, b]."""
        return 1.0 / self.laplace_scale

    def support_bounds(self, tail_mass: float = TAIL_MASS) -> tuple[float, float]:
        """[z_lo, z_hi] with P(Z ∉ [z_lo, z_hi]) ≤ tail_mass per side under both P and Q.

        Every mixture component of Z is a normal with std s and mean in [−μ−b, μ+b].
        """
        reach = self.gaussian_loss_mean + self.laplace_epsilon
        reach += self.gaussian_loss_std * float(stats.norm.isf(tail_mass))
        return -reach, reach

    def _laplace_exponential_part(self, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(K(w), K̄(w)) of the class docstring, each from its cancellation-free side."""
        s, b, a = self.gaussian_loss_std, self.laplace_epsilon, 0.5
        width = 2.0 * b
        w = z + self.gaussian_loss_mean + b
        with np.errstate(invalid="ignore"):
            log_j = -a * w + 0.5 * (a * s) ** 2 + _log_normal_mass(-w / s + a * s, (width - w) / s + a * s)
        j = np.where(np.isfinite(w), np.exp(log_j), 0.0)  # J(±∞) = 0
        decay = math.exp(-a * width)
        k = special.ndtr(w / s) - decay * special.ndtr((w - width) / s) - j
        k_bar = special.ndtr(-w / s) - decay * special.ndtr((width - w) / s) + j
        # Use each closed form where it is small (no cancellation against 1 − e^{−aB}).
        total = -math.expm1(-a * width)
        k_out = np.where(w < b, k, total - k_bar)
        k_bar_out = np.where(w < b, total - k, k_bar)
        return np.clip(k_out, 0.0, total), np.clip(k_bar_out, 0.0, total)

    def cdf_without(self, z: np.ndarray) -> np.ndarray:
        """F_Q(z) = P(Z ≤ z), Z under Q (the example absent)."""
        s, mu, b = self.gaussian_loss_std, self.gaussian_loss_mean, self.laplace_epsilon
        z = np.asarray(z, dtype=float)
        k, _ = self._laplace_exponential_part(z)
        atoms = 0.5 * special.ndtr((z + mu + b) / s) + 0.5 * math.exp(-b) * special.ndtr((z + mu - b) / s)
        return np.clip(atoms + 0.5 * k, 0.0, 1.0)

    def sf_without(self, z: np.ndarray) -> np.ndarray:
        """S_Q(z) = P(Z > z), Z under Q."""
        s, mu, b = self.gaussian_loss_std, self.gaussian_loss_mean, self.laplace_epsilon
        z = np.asarray(z, dtype=float)
        _, k_bar = self._laplace_exponential_part(z)
        atoms = 0.5 * special.ndtr(-(z + mu + b) / s) + 0.5 * math.exp(-b) * special.ndtr(-(z + mu - b) / s)
        return np.clip(atoms + 0.5 * k_bar, 0.0, 1.0)

    def cdf_with(self, z: np.ndarray) -> np.ndarray:
        """F_P(z) = S_Q(−z), Z under P (the example present)."""
        return self.sf_without(-np.asarray(z, dtype=float))

    def sf_with(self, z: np.ndarray) -> np.ndarray:
        """S_P(z) = F_Q(−z)."""
        return self.cdf_without(-np.asarray(z, dtype=float))


# --------------------------------------------------------------------------------------
# Poisson subsampling of the base loss, and the pessimistic PLD grid.
# --------------------------------------------------------------------------------------


def _subsampled_remove_loss(z: np.ndarray, q: float) -> np.ndarray:
    """L = log(1 − q + q·e^z) (increasing in z)."""
    with np.errstate(divide="ignore"):
        return np.logaddexp(math.log1p(-q) if q < 1 else -np.inf, math.log(q) + z)


def _base_loss_at_remove_loss(loss: np.ndarray, q: float) -> np.ndarray:
    """Inverse of L = log(1 − q + q·e^z): z = L + log(1 − (1−q)e^{−L}) − log q."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return loss + np.log1p(-(1.0 - q) * np.exp(-loss)) - math.log(q)


def _base_loss_at_add_loss(loss: np.ndarray, q: float) -> np.ndarray:
    """Inverse of L = −log(1 − q + q·e^z): z = −L + log(1 − (1−q)e^{L}) − log q.

    Returns −∞ where (1−q)e^{L} ≥ 1, i.e. where every z gives a loss ≤ L.
    """
    shrink = (1.0 - q) * np.exp(loss)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = -loss + np.log1p(-np.minimum(shrink, 1.0)) - math.log(q)
    return np.where(shrink >= 1.0, -np.inf, z)


def _grid_indices(lowest_loss: float, highest_loss: float, interval: float) -> np.ndarray:
    """Grid points k (loss k·interval) covering [lowest_loss, highest_loss], rounded up."""
    return np.arange(math.ceil(lowest_loss / interval), math.ceil(highest_loss / interval) + 1)


def _pessimistic_pmf(indices: np.ndarray, loss_cdf: np.ndarray, infinity_mass: float,
                     interval: float) -> pld_pmf.DensePLDPmf:
    """PMF that puts the mass of L ∈ ((k−1)Δ, kΔ] on kΔ (rounding UP, pessimistic).

    ``loss_cdf[j] = P(L ≤ indices[j]·Δ)``; the mass below the first point goes to the first
    point (rounded up too) and the mass above the last point is ``infinity_mass``.
    """
    probs = np.diff(loss_cdf, prepend=0.0)
    probs = np.clip(probs, 0.0, None)  # float noise of the differences, never > 1e-16
    return pld_pmf.DensePLDPmf(interval, int(indices[0]), probs, float(infinity_mass),
                               pessimistic_estimate=True)


def _remove_pmf(base: JointBaseLoss, q: float, interval: float) -> pld_pmf.DensePLDPmf:
    """PLD (remove): L = log(1 − q + q e^Z) with Z ~ (1−q)Q + qP.

    P(L ≤ kΔ) = (1−q)F_Q(z_k) + q F_P(z_k) at z_k = L⁻¹(kΔ); P(L > last) goes to +∞.
    """
    z_lo, z_hi = base.support_bounds()
    losses = _subsampled_remove_loss(np.array([z_lo, z_hi]), q)
    indices = _grid_indices(losses[0], losses[1], interval)
    z = _base_loss_at_remove_loss(indices * interval, q)
    cdf = (1.0 - q) * base.cdf_without(z) + q * base.cdf_with(z)
    infinity_mass = (1.0 - q) * base.sf_without(z[-1]) + q * base.sf_with(z[-1])
    return _pessimistic_pmf(indices, cdf, infinity_mass, interval)


def _add_pmf(base: JointBaseLoss, q: float, interval: float) -> pld_pmf.DensePLDPmf:
    """PLD (add): L = −log(1 − q + q e^Z) with Z ~ Q (L ≤ −log(1−q), decreasing in Z).

    P(L ≤ kΔ) = S_Q(z'_k) at z'_k = L⁻¹(kΔ); P(L > last) = F_Q(z'_last) goes to +∞.
    """
    z_lo, z_hi = base.support_bounds()
    losses = -_subsampled_remove_loss(np.array([z_hi, z_lo]), q)
    indices = _grid_indices(losses[0], losses[1], interval)
    z = _base_loss_at_add_loss(indices * interval, q)
    cdf = base.sf_without(z)
    infinity_mass = base.cdf_without(z[-1])
    return _pessimistic_pmf(indices, cdf, infinity_mass, interval)


def _sampling_rate(value: float) -> float:
    value = _checks.positive("sampling_rate", value)
    if value > 1:
        raise ValueError(f"`sampling_rate` must lie in (0, 1], got {value}.")
    return value


def joint_step_pld(
    sampling_rate: float,
    noise_multiplier: float,
    laplace_scale: float,
    value_discretization_interval: float = PLD_DISCRETIZATION,
) -> PrivacyLossDistribution:
    """PLD of ONE RaCO-DP step: Poisson(q) applied to the pair (Gaussian σ, Laplace 1/b).

    The base loss Z = Z_G + Z_L (module docstring) is mapped to L = log(1 − q + q e^Z)
    (remove) and L = −log(1 − q + q e^Z) (add); both PMFs are put on the grid
    Δ·ℤ (Δ = ``value_discretization_interval``) by rounding losses UP, the mass beyond
    the grid's top (≤ 1e-15) counts as infinite loss. The result is a pessimistic
    (upper-bounding) ``dp_accounting`` PLD: compose it with ``.self_compose(T)``.
    σ is the noise multiplier of the gradient sum (ℓ2 sensitivity 1),
    ``laplace_scale`` = 1/b the histogram's Laplace scale (ℓ1 sensitivity 1).

    Args:
      sampling_rate: q, the Poisson sampling rate.
      noise_multiplier: σ of the gradient sum (positive).
      laplace_scale: 1/b, the histogram's Laplace scale (positive).
      value_discretization_interval: Δ, the grid step of the losses.

    Returns:
      The pessimistic ``PrivacyLossDistribution`` of one step.
    """
    q = _sampling_rate(sampling_rate)
    base = JointBaseLoss(
        _checks.positive("noise_multiplier", noise_multiplier),
        _checks.positive("laplace_scale", laplace_scale),
    )
    interval = _checks.positive("value_discretization_interval", value_discretization_interval)
    remove = _remove_pmf(base, q, interval)
    if q == 1.0:  # no subsampling: add and remove coincide (the base pair is symmetric)
        return PrivacyLossDistribution(remove)
    return PrivacyLossDistribution(remove, _add_pmf(base, q, interval))


# --------------------------------------------------------------------------------------
# RDP: base RDP of the pair through Zhu & Wang's general Poisson-subsampling bound.
# --------------------------------------------------------------------------------------


def gaussian_rdp(orders: np.ndarray, noise_multiplier: float) -> np.ndarray:
    """ε_G(α) = α / (2σ²) (Gaussian, ℓ2 sensitivity 1)."""
    return np.asarray(orders, dtype=float) / (2.0 * noise_multiplier**2)


def laplace_rdp(orders: np.ndarray, laplace_scale: float) -> np.ndarray:
    """Mironov 2017, Prop. 6 (ℓ1 sensitivity 1, scale λ = 1/b), α > 1:

        ε_L(α) = 1/(α−1) · log[ α/(2α−1)·e^{(α−1)b} + (α−1)/(2α−1)·e^{−αb} ]
               = b + log1p( (α−1)/(2α−1) · (e^{(1−2α)b} − 1) ) / (α−1).
    """
    alpha = np.asarray(orders, dtype=float)
    b = 1.0 / laplace_scale
    return b + np.log1p((alpha - 1) / (2 * alpha - 1) * np.expm1((1 - 2 * alpha) * b)) / (alpha - 1)


def poisson_subsampled_rdp(sampling_rate: float, orders: np.ndarray,
                           base_rdp: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """Zhu & Wang 2019, Thm 6 (any base mechanism, integer α ≥ 2), γ = q:

        ε(α) ≤ 1/(α−1) · log{ (1−γ)^{α−1}(αγ − γ + 1)
                              + C(α,2) γ² (1−γ)^{α−2} e^{ε(2)}
                              + 3 Σ_{l=3}^{α} C(α,l) (1−γ)^{α−l} γ^l e^{(l−1)ε(l)} }.

    ``base_rdp`` maps integer orders to the base mechanism's RDP. q = 1 returns it as is.
    """
    orders = np.asarray(orders, dtype=int)
    if np.any(orders < 2):
        raise ValueError("Zhu & Wang's bound needs integer orders >= 2.")
    if sampling_rate == 1.0:
        return base_rdp(orders)
    q = sampling_rate
    all_l = np.arange(2, int(orders.max()) + 1)
    base_cgf = (all_l - 1) * base_rdp(all_l)  # (l−1)·ε(l), l = 2..max α
    bounds = []
    for alpha in orders:
        l = all_l[: alpha - 1]  # 2..α
        log_terms = (special.gammaln(alpha + 1) - special.gammaln(l + 1) - special.gammaln(alpha - l + 1)
                     + special.xlogy(alpha - l, 1 - q) + l * math.log(q) + base_cgf[: alpha - 1])
        log_terms[1:] += math.log(3.0)  # l ≥ 3
        head = (alpha - 1) * math.log1p(-q) + math.log1p((alpha - 1) * q)
        bounds.append(special.logsumexp(np.append(log_terms, head)) / (alpha - 1))
    return np.array(bounds)


def _joint_step_rdp(sampling_rate: float, noise_multiplier: float, laplace_scale: float,
                    orders=INTEGER_RDP_ORDERS) -> np.ndarray:
    """Per-step RDP at integer ``orders`` (≥ 2) of Poisson(q) ∘ (Gaussian, Laplace)."""
    if not all(float(a).is_integer() for a in orders):
        raise ValueError("Zhu & Wang's bound needs integer orders >= 2.")

    def base_rdp(alphas: np.ndarray) -> np.ndarray:  # RDP composes additively
        return gaussian_rdp(alphas, noise_multiplier) + laplace_rdp(alphas, laplace_scale)

    return poisson_subsampled_rdp(sampling_rate, np.asarray(orders).astype(int), base_rdp)


# --------------------------------------------------------------------------------------
# The plug-in: one RaCO-DP step as a StepEvent, and the ledger scheme "raco_poisson".
# --------------------------------------------------------------------------------------


@attr.s(frozen=True, slots=True, auto_attribs=True)
class GaussianLaplaceDpEvent(StepEvent):
    """ONE RaCO-DP step: Poisson(q) applied to the pair (Gaussian σ, Laplace scale 1/b).

    Attributes:
      sampling_rate: q, the Poisson sampling rate.
      noise_multiplier: σ of the gradient sum.
      laplace_scale: 1/b, the histogram's Laplace scale.
    """

    sampling_rate: float
    noise_multiplier: float
    laplace_scale: float

    rdp_orders = INTEGER_RDP_ORDERS  # Zhu & Wang's bound holds at integer orders ≥ 2 only

    def rdp(self, orders) -> np.ndarray:
        """Zhu & Wang's bound on Poisson(q) ∘ (ε_G + ε_L) at integer ``orders`` (``_joint_step_rdp``)."""
        return _joint_step_rdp(self.sampling_rate, self.noise_multiplier, self.laplace_scale, orders)

    def pld(self, value_discretization_interval: float) -> PrivacyLossDistribution:
        """The pessimistic one-step PLD (``joint_step_pld``), built once per setting."""
        return _cached_joint_step_pld(self.sampling_rate, self.noise_multiplier, self.laplace_scale,
                                      value_discretization_interval)


@functools.lru_cache(maxsize=64)
def _cached_joint_step_pld(q: float, sigma: float, scale: float, interval: float) -> PrivacyLossDistribution:
    return joint_step_pld(q, sigma, scale, interval)


@register_event(SCHEME)
def raco_event(phase: Phase) -> dp_event.DpEvent:
    """T × GaussianLaplaceDpEvent(q, σ, 1/b), 1/b = ``phase.parameter`` (docs/algorithms.md §5)."""
    if phase.parameter <= 0:
        raise ValueError(f"A {SCHEME!r} phase needs its Laplace scale > 0 as `parameter`, got {phase.parameter}.")
    return dp_event.SelfComposedDpEvent(
        GaussianLaplaceDpEvent(phase.sampling_rate, phase.noise_multiplier, phase.parameter), phase.steps)


# --------------------------------------------------------------------------------------
# Public API: ε, and calibration of T or σ — RaCO-DP's argument names over tf_dp.accounting.
# --------------------------------------------------------------------------------------


def effective_noise_multiplier(noise_multiplier: float, histogram_std: float) -> float:
    """σ_eff = (σ⁻² + σ_h⁻²)^(−1/2): one Gaussian on the joint vector (ḡ_i/C, p_i).

    Args:
      noise_multiplier: σ of the gradient sum (0: not private).
      histogram_std: σ_h, the Gaussian histogram's std.

    Returns:
      σ_eff (0.0 when ``noise_multiplier`` is 0).
    """
    if noise_multiplier == 0:
        return 0.0
    return (noise_multiplier**-2 + histogram_std**-2) ** -0.5


def _epsilon_of_steps(num_examples: int, batch_size: int, noise_multiplier: float,
                      histogram_noise: float, delta: float, histogram_mechanism: str,
                      accountant: str) -> Callable[[int], float]:
    """T ↦ ε(T) for fixed settings, by ``tf_dp.accounting.compute_epsilon``: scheme
    "raco_poisson" (Laplace) or the Poisson-sampled Gaussian at σ_eff (Gaussian histogram)."""
    num_examples = _checks.positive_int("num_examples", num_examples)
    batch_size = _checks.batch_size_for(num_examples, batch_size)
    sigma = _checks.non_negative("noise_multiplier", noise_multiplier)
    histogram_noise = _checks.positive("histogram_noise", histogram_noise)
    delta = _checks.delta(delta)
    _checks.one_of("histogram_mechanism", histogram_mechanism, HISTOGRAM_MECHANISMS)
    check_accountant(accountant)
    if histogram_mechanism == "gaussian":
        sigma_eff = effective_noise_multiplier(sigma, histogram_noise)
        return lambda steps: core.compute_epsilon(num_examples, batch_size, sigma_eff, steps=steps, delta=delta,
                                                  accountant=accountant)
    return lambda steps: core.compute_epsilon(num_examples, batch_size, sigma, steps=steps, delta=delta,
                                              accountant=accountant, scheme=SCHEME, parameter=histogram_noise)


def compute_epsilon(
    num_examples: int,
    batch_size: int,
    noise_multiplier: float,
    histogram_noise: float,
    steps: int,
    delta: float = 1e-5,
    histogram_mechanism: str = "laplace",
    accountant: str = DEFAULT_ACCOUNTANT,
) -> float:
    """ε of T RaCO-DP steps at Poisson rate q = batch_size / num_examples.

    ``tf_dp.compute_epsilon(N, L, σ, steps=T, scheme="raco_poisson", parameter=histogram_noise)``
    with RaCO-DP's argument names. ``histogram_noise`` is the Laplace scale 1/b
    (``histogram_mechanism="laplace"``, ℓ1 sensitivity 1) or the Gaussian histogram std σ_h
    (``"gaussian"``, ℓ2 sensitivity 1 since ‖p_i‖₂ ≤ 1). ``accountant="rdp"`` (default, as
    everywhere; sound, looser) or ``"pld"`` (tight); see the module docstring.
    ``noise_multiplier=0`` means the gradient is not noised: ε = ∞.

    Args:
      num_examples: N, the dataset size.
      batch_size: L, the expected batch size (q = L / N).
      noise_multiplier: σ of the gradient sum (0: not private).
      histogram_noise: the histogram's Laplace scale 1/b, or its Gaussian std σ_h.
      steps: T, the number of steps.
      delta: δ in (0, 1).
      histogram_mechanism: "laplace" or "gaussian".
      accountant: a registered accountant ("rdp" default, "pld").

    Returns:
      ε at ``delta``.

    Raises:
      ValueError: an argument is out of range.
    """
    steps = _checks.positive_int("steps", steps)
    epsilon = _epsilon_of_steps(num_examples, batch_size, noise_multiplier, histogram_noise,
                                delta, histogram_mechanism, accountant)
    return epsilon(steps)


def calibrate_steps(
    target_epsilon: float,
    num_examples: int,
    batch_size: int,
    noise_multiplier: float,
    histogram_noise: float,
    delta: float = 1e-5,
    histogram_mechanism: str = "laplace",
    accountant: str = DEFAULT_ACCOUNTANT,
    max_steps: int = 1_000_000,
) -> int:
    """Largest T ≤ ``max_steps`` with ε(T) ≤ target (doubling, then binary search).

    Raises ``ValueError`` if even one step exceeds the target.

    Args:
      target_epsilon: the ε not to exceed (positive).
      num_examples: N, the dataset size.
      batch_size: L, the expected batch size (q = L / N).
      noise_multiplier: σ of the gradient sum.
      histogram_noise: the histogram's Laplace scale 1/b, or its Gaussian std σ_h.
      delta: δ in (0, 1).
      histogram_mechanism: "laplace" or "gaussian".
      accountant: a registered accountant ("rdp" default, "pld").
      max_steps: the largest T considered.

    Returns:
      The number of steps T.

    Raises:
      ValueError: an argument is out of range, or one step already exceeds the target.
    """
    target_epsilon = _checks.positive("target_epsilon", target_epsilon)
    max_steps = _checks.positive_int("max_steps", max_steps)
    epsilon = _epsilon_of_steps(num_examples, batch_size, noise_multiplier, histogram_noise,
                                delta, histogram_mechanism, accountant)
    if epsilon(1) > target_epsilon:
        raise ValueError(
            f"target_epsilon={target_epsilon} is unreachable: a single step already costs "
            f"ε={epsilon(1):.4g}. Raise noise_multiplier / histogram_noise or target_epsilon."
        )
    return largest_fitting(lambda steps: epsilon(steps) <= target_epsilon, 1, max_steps)


def calibrate_noise_multiplier(
    target_epsilon: float,
    num_examples: int,
    batch_size: int,
    histogram_noise: float,
    steps: int,
    delta: float = 1e-5,
    histogram_mechanism: str = "laplace",
    accountant: str = DEFAULT_ACCOUNTANT,
) -> float:
    """Smallest σ (to 0.1 % relative) with ε(σ) ≤ target at fixed T and histogram noise:
    ``tf_dp.calibrate_noise_multiplier``'s search (``calibrate_sigma``) on RaCO-DP's ε.

    Raises ``ValueError`` if the histogram noise alone spends the target (no σ helps).

    Args:
      target_epsilon: the ε to reach (positive).
      num_examples: N, the dataset size.
      batch_size: L, the expected batch size (q = L / N).
      histogram_noise: the histogram's Laplace scale 1/b, or its Gaussian std σ_h.
      steps: T, the number of steps.
      delta: δ in (0, 1).
      histogram_mechanism: "laplace" or "gaussian".
      accountant: a registered accountant ("rdp" default, "pld").

    Returns:
      The noise multiplier σ.

    Raises:
      ValueError: an argument is out of range, or no σ reaches the target.
    """
    target_epsilon = _checks.positive("target_epsilon", target_epsilon)
    steps = _checks.positive_int("steps", steps)
    _epsilon_of_steps(num_examples, batch_size, 1.0, histogram_noise, delta, histogram_mechanism, accountant)

    def epsilon(sigma: float) -> float:
        return compute_epsilon(num_examples, batch_size, sigma, histogram_noise, steps, delta,
                               histogram_mechanism, accountant)

    if epsilon(LARGEST_NOISE_MULTIPLIER) > target_epsilon:
        raise ValueError(
            f"target_epsilon={target_epsilon} is unreachable: with histogram_noise="
            f"{histogram_noise} the histogram alone costs more than that over {steps} steps "
            f"(even noise_multiplier={LARGEST_NOISE_MULTIPLIER:g}). Raise histogram_noise, lower "
            "steps, or raise target_epsilon."
        )
    if histogram_mechanism == "laplace":
        return core.calibrate_noise_multiplier(target_epsilon, num_examples, batch_size, steps=steps, delta=delta,
                                               accountant=accountant, scheme=SCHEME, parameter=histogram_noise)
    rate = batch_size / num_examples
    return core.calibrate_sigma(
        lambda sigma: core.dp_sgd_event(rate, effective_noise_multiplier(sigma, histogram_noise), steps),
        target_epsilon, delta, accountant)


def epsilon_of_phases(phases, delta: float, accountant: str = DEFAULT_ACCOUNTANT) -> float:
    """ε of ledger phases, RaCO-DP ones included (``tf_dp.accounting.events.epsilon``).

    Args:
      phases: the ledger ``Phase`` records, in order.
      delta: δ in (0, 1).
      accountant: a registered accountant ("rdp" default, "pld").

    Returns:
      ε at ``delta``.
    """
    return core.epsilon(list(phases), delta, accountant)
