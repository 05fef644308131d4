"""FIBER's innovation filter (ALGORITHMS §4): a constant-velocity Kalman form with gain ω.

    ν_t = ĝ_t − g̃_{t−1}            (innovation)
    r_t = (1 − ω) r_{t−1} + ω ν_t   (smoothed residual)
    g̃_t = g̃_{t−1} + r_t           (integrate)

Equivalently g̃_t = 2(1−ω) g̃_{t−1} − (1−ω) g̃_{t−2} + ω ĝ_t, an AR(2) recursion: white
noise of variance s² comes out with variance A(ω)·s².
"""

from __future__ import annotations

from tf_dp import _checks


def innovation_filter(filtered, residual, observation, omega: float):
    """One step; returns (g̃_t, r_t)."""
    residual = (1 - omega) * residual + omega * (observation - filtered)
    return filtered + residual, residual


def attenuation_factor(omega: float) -> float:
    """A(ω) = (2 − ω) / (4 − 3ω): the filter's output variance per unit input white-noise
    variance. A(1) = 1 (no filtering); A(ω) → 1/2 as ω → 0."""
    omega = _checks.real("omega", omega)
    if not 0 < omega <= 1:
        raise ValueError(f"`omega` must lie in (0, 1], got {omega}.")
    return (2 - omega) / (4 - 3 * omega)
