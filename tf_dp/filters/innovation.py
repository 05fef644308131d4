"""FIBER's innovation filter (docs/algorithms.md §4): a constant-velocity Kalman form with gain ω.

    ν_t = ĝ_t − g̃_{t−1}            (innovation)
    r_t = (1 − ω) r_{t−1} + ω ν_t   (smoothed residual)
    g̃_t = g̃_{t−1} + r_t           (integrate)

Equivalently g̃_t = 2(1−ω) g̃_{t−1} − (1−ω) g̃_{t−2} + ω ĝ_t, an AR(2) recursion: white
noise of variance s² comes out with variance A(ω)·s² once stationary. A filter started at
zero passes less: after t steps the variance is A_t·s², where A_t is the first entry of the
noise covariance of the state (g̃, r), advanced by ``innovation_noise_covariance_step``.
"""

from __future__ import annotations

import keras

from tf_dp import _checks


def innovation_filter(filtered, residual, observation, omega: float):
    """One step of the innovation filter: r_t = (1 − ω) r_{t−1} + ω (ĝ_t − g̃_{t−1}), g̃_t = g̃_{t−1} + r_t.

    Args:
      filtered: g̃_{t−1}, the filter's previous output.
      residual: r_{t−1}, the filter's previous residual state (same shape).
      observation: ĝ_t, the new noisy gradient (same shape).
      omega: ω in (0, 1], the filter's gain (1: no filtering).

    Returns:
      The pair (g̃_t, r_t).
    """
    residual = (1 - omega) * residual + omega * (observation - filtered)
    return filtered + residual, residual


def attenuation_factor(omega: float) -> float:
    """A(ω) = (2 − ω) / (4 − 3ω): the filter's output variance per unit input white-noise
    variance. A(1) = 1 (no filtering); A(ω) → 1/2 as ω → 0.

    Args:
      omega: ω in (0, 1], the filter's gain.

    Returns:
      The attenuation factor A(ω).

    Raises:
      ValueError: ``omega`` is not a real number in (0, 1].
    """
    omega = _checks.real("omega", omega)
    if not 0 < omega <= 1:
        raise ValueError(f"`omega` must lie in (0, 1], got {omega}.")
    return (2 - omega) / (4 - 3 * omega)


def innovation_noise_covariance_step(covariance, omega: float):
    """One step of the covariance P = [[a, c], [c, d]] of the noise in the state (g̃, r),
    fed white noise of unit variance. The step is x_t = F x_{t−1} + b w_t with

        F = [[1 − ω, 1 − ω], [−ω, 1 − ω]],   b = (ω, ω),   so   P_t = F P_{t−1} Fᵀ + b bᵀ:

        a_t = (1 − ω)² (a + 2c + d) + ω²
        c_t = (1 − ω) ((1 − ω)(c + d) − ω (a + c)) + ω²
        d_t = ω² a − 2ω(1 − ω) c + (1 − ω)² d + ω²

    ``covariance`` is (a, c, d), zeros for a filter started at zero; A_t = a_t → A(ω).

    Args:
      covariance: the previous step's (a, c, d), a length-3 tensor or sequence.
      omega: ω in (0, 1], the filter's gain.

    Returns:
      The next step's (a_t, c_t, d_t), stacked in one tensor.
    """
    a, c, d = covariance[0], covariance[1], covariance[2]
    keep = 1 - omega
    return keras.ops.stack([
        keep**2 * (a + 2 * c + d) + omega**2,
        keep * (keep * (c + d) - omega * (a + c)) + omega**2,
        omega**2 * a - 2 * omega * keep * c + keep**2 * d + omega**2,
    ])
