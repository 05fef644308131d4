"""ε of a private random search: the Rényi DP of "run K trials, release the best" for a random K
(Papernot & Steinke, ICLR 2022; docs/algorithms.md §14), from ONE trial's RDP curve.

One trial is a dp_accounting event (its ledger's training event composed with its score's);
its RDP curve comes from dp_accounting's RdpAccountant at the project's orders
(``tf_dp.accounting.accountant.RDP_ORDERS``, the cached per-step path where it applies). The
selection's curve ε'(λ) follows §14 exactly:

* truncated negative binomial (η, γ) — the paper's Theorem 2 as §14 states it,

      ε'(λ) = ε(λ) + min_{λ̂ ≥ 1} [(1 + η)(1 − 1/λ̂)·ε(λ̂) + (1 + η)·ln(1/γ)/λ̂] + ln E[K]/(λ − 1),

  with λ̂ over {1} ∪ the orders: at λ̂ = 1 the ε(λ̂) term vanishes (ε(1) ≤ ε(λ_min) < ∞, the
  Rényi divergence growing with its order). The authors' public code (figure7.py) has three
  forms: its geometric one (η = 1) is Theorem 2; its logarithmic one (η = 0) writes
  ln((1 − γ)/γ) in the λ̂ term (tighter); its negative binomial one (η > 0) writes ln((1 − γ)/γ)
  in the λ̂ term and ln E[K] − ln(1 − γ) in the last (neither tighter nor looser). Only
  Theorem 2 is a stated theorem: tf_dp uses it for every η.
* Poisson (μ): ε'(λ) = ε(λ) + μ·δ̂(λ) + ln μ/(λ − 1), δ̂(λ) the δ of one trial at
  ε̂ = ln(1 + 1/(λ − 1)) from its RDP curve (dp_accounting's ``compute_delta``), for μ >= 1
  only: at μ < 1 the formula is negative near λ = 1 (the public Figure 7's own Poisson points
  at μ = 0.15 and 0.35 have min_λ ε'(λ) = −7.4 and −4.0), which no Rényi divergence is, so
  it is refused there.

ε(δ) of the search is then the project's RDP → (ε, δ) conversion of ε'(λ)
(``accountant._epsilon_from_rdp``, dp_accounting's ``compute_epsilon``).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant

from tf_dp import _checks
from tf_dp.accounting import accountant
from tf_dp.accounting.accountant import RDP_ORDERS, dp_sgd_event
from tf_dp.tuning.distributions import PoissonTrials, TruncatedNegativeBinomial, check_distribution

ORDERS = tuple(float(a) for a in RDP_ORDERS)
_MEAN_SEARCH_RANGE = (1.0, 1e6)  # calibrate_mean_trials looks for E[K] in this range
_MEAN_RELATIVE_TOLERANCE = 1e-3


def fit_steps(num_examples: int, batch_size: int, epochs: Optional[int] = None, steps: Optional[int] = None) -> int:
    """T of a DP ``fit``: ``epochs`` epochs of ⌈N/L⌉ steps each (fit's epoch, which
    ``compile(target_epsilon=...)`` calibrates for too), or ``steps``.

    Args:
      num_examples, batch_size: N and L.
      epochs, steps: exactly one (epochs a whole number, as ``fit`` takes it).

    Returns:
      T.
    """
    if (epochs is None) == (steps is None):
        raise ValueError("Pass exactly one of `epochs` or `steps`.")
    if steps is not None:
        return _checks.positive_int("steps", steps)
    return _checks.positive_int("epochs", epochs) * math.ceil(num_examples / batch_size)


def _orders(orders: Sequence[float]) -> np.ndarray:
    orders = np.asarray(orders, dtype=np.float64)
    if orders.ndim != 1 or not len(orders) or not np.all(orders > 1) or not np.all(np.diff(orders) > 0):
        raise ValueError(f"`orders` must be increasing RDP orders > 1, got {orders!r}.")
    return orders


def trial_rdp(event: dp_event.DpEvent, orders: Sequence[float] = ORDERS) -> np.ndarray:
    """RDP of one trial's ``event`` at ``orders``: dp_accounting's RdpAccountant (through the
    project's cached per-step curves when the event is built of Gaussian steps).

    Args:
      event: the trial's dp_accounting event (training composed with its score).
      orders: RDP orders > 1.

    Returns:
      ε(λ) at each order (∞ where the trial is not private).
    """
    if not isinstance(event, dp_event.DpEvent):
        raise TypeError(f"`event` must be a dp_accounting DpEvent, got {type(event).__name__}.")
    orders = _orders(orders)
    curve = accountant.rdp_of_event(event, tuple(orders))
    if curve is not None:
        return curve
    engine = rdp_privacy_accountant.RdpAccountant(list(orders))
    with accountant._quiet_absl():
        engine.compose(event)
    return np.asarray(engine._rdp, dtype=np.float64)


def selection_rdp(rdp: Sequence[float], distribution, orders: Sequence[float] = ORDERS) -> np.ndarray:
    """ε'(λ) of releasing the best of K trials, K ~ ``distribution`` (docs/algorithms.md §14).

    Args:
      rdp: ε(λ) of one trial at ``orders`` (an upper bound for every trial).
      distribution: ``TruncatedNegativeBinomial`` or ``PoissonTrials``.
      orders: the RDP orders (> 1, increasing) of ``rdp``.

    Returns:
      ε'(λ) at ``orders``.
    """
    distribution = check_distribution(distribution)
    orders = _orders(orders)
    rdp = np.asarray(rdp, dtype=np.float64)
    if rdp.shape != orders.shape or np.any(np.isnan(rdp)) or np.any(rdp < 0):
        raise ValueError(f"`rdp` must hold one value >= 0 per order ({len(orders)}), got shape {rdp.shape}.")
    if isinstance(distribution, PoissonTrials):
        return _poisson_selection(rdp, orders, distribution.mu)
    return _negative_binomial_selection(rdp, orders, distribution)


def _negative_binomial_selection(rdp: np.ndarray, orders: np.ndarray,
                                 distribution: TruncatedNegativeBinomial) -> np.ndarray:
    """Theorem 2: ε(λ) + min_λ̂ (1+η)[(1 − 1/λ̂)ε(λ̂) + ln(1/γ)/λ̂] + ln E[K]/(λ − 1)."""
    weight = 1 + distribution.eta
    hat_orders, hat_rdp = orders, rdp
    if math.isfinite(rdp[0]):  # λ̂ = 1: (1 − 1/λ̂)·ε(1) = 0, since ε(1) <= ε(λ_min) < ∞
        hat_orders, hat_rdp = np.concatenate([[1.0], orders]), np.concatenate([[0.0], rdp])
    second = weight * ((1 - 1 / hat_orders) * hat_rdp + math.log(1 / distribution.gamma) / hat_orders)
    return rdp + np.min(second) + math.log(distribution.mean()) / (orders - 1)


def _poisson_selection(rdp: np.ndarray, orders: np.ndarray, mu: float) -> np.ndarray:
    """ε(λ) + μ·δ̂(λ) + ln μ/(λ − 1), δ̂(λ) = δ of one trial at ε̂ = ln(1 + 1/(λ − 1)); only
    for μ >= 1 (below, ln μ/(λ − 1) → −∞ as λ → 1: a negative "RDP", which bounds nothing)."""
    if mu < 1:
        raise ValueError(
            f"PoissonTrials(mean={mu:g}): the Poisson selection bound needs `mean` >= 1. Below 1 its term "
            "ln(mean)/(λ − 1) is negative and unbounded near λ = 1, so the formula falls below 0, under any Rényi "
            "divergence (it would report ε = 0 for releasing a trained model): it is no bound there "
            "(docs/algorithms.md §14). Use mean >= 1 or a TruncatedNegativeBinomial.")
    with accountant._quiet_absl():
        delta_hat = np.array([
            rdp_privacy_accountant.compute_delta(orders, rdp, math.log1p(1 / (order - 1)))[0] for order in orders])
    return rdp + mu * delta_hat + math.log(mu) / (orders - 1)


def tuning_epsilon(rdp: Sequence[float], delta: float, distribution, orders: Sequence[float] = ORDERS) -> float:
    """ε at δ of the search: the project's RDP → (ε, δ) conversion of ``selection_rdp``.

    Args:
      rdp: ε(λ) of one trial at ``orders``.
      delta: δ.
      distribution: the law of K.
      orders: the RDP orders of ``rdp``.

    Returns:
      ε of releasing the best trial.
    """
    delta = _checks.delta(delta)
    curve = selection_rdp(rdp, distribution, orders)
    return accountant._epsilon_from_rdp(curve, delta, list(_orders(orders)))[0]


def one_trial_epsilon(rdp: Sequence[float], delta: float, orders: Sequence[float] = ORDERS) -> float:
    """ε at δ of ONE trial from its curve (the same conversion), for comparison.

    Args:
      rdp: the trial's RDP curve, one value per order.
      delta: δ in (0, 1).
      orders: the RDP orders of ``rdp``.

    Returns:
      ε at ``delta``.
    """
    delta = _checks.delta(delta)
    return accountant._epsilon_from_rdp(np.asarray(rdp, dtype=np.float64), delta, list(_orders(orders)))[0]


def calibrate_noise_multiplier(target_epsilon: float, distribution, num_examples: int, batch_size: int,
                               epochs: Optional[int] = None, steps: Optional[int] = None, delta: float = 1e-5,
                               score_event: Optional[dp_event.DpEvent] = None) -> float:
    """Smallest σ (to 0.1 %, the project's σ search) whose SEARCH meets ``target_epsilon``: every
    trial T Poisson-sampled DP-SGD steps at q = batch_size/num_examples and σ, then its score.

    Args:
      target_epsilon: the total ε of the tuning (the ε of the model shipped).
      distribution: the law of K.
      num_examples, batch_size, epochs, steps: the trial's training (T = ``fit_steps``: epochs of
        ⌈N/L⌉ steps, as ``fit`` runs them).
      delta: δ.
      score_event: the event of one trial's noisy score (``NoisyAccuracy.event``), if any.

    Returns:
      σ. Raises ``ValueError`` if no σ up to ``LARGEST_NOISE_MULTIPLIER`` reaches the target.
    """
    target_epsilon = _checks.positive("target_epsilon", target_epsilon)
    distribution, delta = check_distribution(distribution), _checks.delta(delta)
    num_examples = _checks.positive_int("num_examples", num_examples)
    batch_size = _checks.batch_size_for(num_examples, batch_size)
    total_steps = fit_steps(num_examples, batch_size, epochs, steps)

    def epsilon_at(sigma: float) -> float:
        training = dp_sgd_event(batch_size / num_examples, sigma, total_steps)
        event = training if score_event is None else dp_event.ComposedDpEvent([training, score_event])
        return tuning_epsilon(trial_rdp(event), delta, distribution)

    return accountant._smallest_sigma_within(epsilon_at, target_epsilon)


def calibrate_mean_trials(target_epsilon: float, rdp: Sequence[float], delta: float = 1e-5,
                          eta: Optional[float] = None, orders: Sequence[float] = ORDERS):
    """The distribution with the LARGEST E[K] (to 0.1 %) whose search meets ``target_epsilon``.

    Args:
      target_epsilon: the total ε of the tuning.
      rdp: ε(λ) of one trial at ``orders``.
      delta: δ.
      eta: None for Poisson trials, else η of a truncated negative binomial.
      orders: the RDP orders of ``rdp``.

    Returns:
      ``PoissonTrials`` or ``TruncatedNegativeBinomial``. Raises ``ValueError`` if even
      E[K] just above 1 exceeds the target.
    """
    target_epsilon = _checks.positive("target_epsilon", target_epsilon)
    delta = _checks.delta(delta)

    def distribution(mean: float):
        return PoissonTrials(mean) if eta is None else TruncatedNegativeBinomial.with_mean(eta, mean)

    def fits(mean: float) -> bool:
        return tuning_epsilon(rdp, delta, distribution(mean), orders) <= target_epsilon

    low, high = _MEAN_SEARCH_RANGE[0] * (1 + _MEAN_RELATIVE_TOLERANCE), _MEAN_SEARCH_RANGE[1]
    if not fits(low):
        raise ValueError(f"target_epsilon={target_epsilon} is unreachable: even E[K] = {low:g} trials exceed it "
                         "(one trial's curve is too large). Raise target_epsilon or the trial's noise_multiplier.")
    if fits(high):
        return distribution(high)
    while high / low > 1 + _MEAN_RELATIVE_TOLERANCE:
        middle = math.sqrt(low * high)
        low, high = (middle, high) if fits(middle) else (low, middle)
    return distribution(low)
