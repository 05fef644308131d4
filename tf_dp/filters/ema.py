"""DiSK's state filter (Zhang et al., ICLR 2025; docs/algorithms.md §3).

    g̃_t = (1 − κ) g̃_{t−1} + κ ĝ_t

The filter is linear, so the noise in g̃ evolves on its own. Started at zero and fed white
noise of unit variance, the noise variance in g̃ after t steps is

    A_t = (1 − κ)² A_{t−1} + κ²,   A_0 = 0,   A_t → A = κ / (2 − κ).
"""

from __future__ import annotations

from tf_dp import _checks


def ema_filter(previous, observation, kappa: float):
    """g̃_t = (1 − κ) g̃_{t−1} + κ ĝ_t.

    Args:
      previous: g̃_{t−1}, the filter's previous output (a tensor or array).
      observation: ĝ_t, the new noisy gradient (same shape as ``previous``).
      kappa: κ in (0, 1], the weight of the new observation (1: no filtering).

    Returns:
      g̃_t, the filtered gradient.
    """
    return (1 - kappa) * previous + kappa * observation


def ema_attenuation_factor(kappa: float) -> float:
    """A = κ / (2 − κ): the EMA's stationary output variance per unit input white-noise
    variance (0.54 at κ = 0.7; 1 at κ = 1, no filtering).

    Args:
      kappa: κ in (0, 1], the EMA's weight of the new observation.

    Returns:
      The attenuation factor A.

    Raises:
      ValueError: ``kappa`` is not a real number in (0, 1].
    """
    kappa = _checks.real("kappa", kappa)
    if not 0 < kappa <= 1:
        raise ValueError(f"`kappa` must lie in (0, 1], got {kappa}.")
    return kappa / (2 - kappa)


def ema_noise_variance_step(variance, kappa: float):
    """A_t = (1 − κ)² A_{t−1} + κ²: the noise variance in g̃_t per unit input variance,
    from A_{t−1} (A_0 = 0 for a filter started at zero).

    Args:
      variance: A_{t−1}, the previous step's noise variance per unit input variance.
      kappa: κ in (0, 1], the EMA's weight of the new observation.

    Returns:
      A_t.
    """
    return (1 - kappa) ** 2 * variance + kappa**2
