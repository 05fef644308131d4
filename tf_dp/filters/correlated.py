"""The noise a linear filter leaves when fed BandMF's correlated noise (docs/algorithms.md §10.6).

A filter with state x_t (DiSK's EMA: x = g̃; FIBER's innovation filter: x = (g̃, r)) is

    x_t = F x_{t−1} + b·ĝ_t.

BandMF's noise in ĝ_t is σ_w·w̄_t with w̄ = C_b⁻¹ζ, ζ_t ~ N(0, 1) i.i.d. per coordinate, i.e.
the recursion c_0 w̄_t = ζ_t − Σ_{j=1}^{b−1} c_j w̄_{t−j}. Its last b − 1 values
s_t = (w̄_t, …, w̄_{t−b+2}) evolve as s_t = G s_{t−1} + e_1 ζ_t/c_0 (G: first row −c_{1:}/c_0,
ones below the diagonal). The pair X_t = (x_t, s_t) is one linear system driven by WHITE noise:

    X_t = M X_{t−1} + u ζ_t,   M = [[F, b·g], [0, G]],  g = −c_{1:}/c_0,  u = (b, e_1)/c_0,

so its noise covariance (per unit σ_w², one coordinate) advances exactly as

    P_t = M P_{t−1} Mᵀ + u uᵀ,

with the noise block of P_{t−1} (rows and columns of s) zeroed whenever BandMF starts a new
segment from a zero buffer. P_t[0, 0] is the variance of the filtered noise in g̃_t and
P_t[s_0, s_0] = F_n that of w̄_t; the filter hands on σ_w²·F_n·A'_t with A'_t = P_t[0, 0]/F_n.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf


def noise_recursion_system(coefficients: np.ndarray) -> tuple:
    """(G, g): the state s_t = (w̄_t, …, w̄_{t−b+2}) of c_0 w̄_t = ζ_t − Σ_{j≥1} c_j w̄_{t−j} advances as
    s_t = G s_{t−1} + e_1 ζ_t/c_0, and w̄_t = g·s_{t−1} + ζ_t/c_0 (g = G's first row).

    Args:
      coefficients: c_0 > 0, c_1, …, c_{b−1} (b ≥ 2).

    Returns:
      G [b−1, b−1] and g [b−1] as float64 arrays.
    """
    coefficients = np.asarray(coefficients, np.float64)
    size = len(coefficients) - 1
    first_row = -coefficients[1:] / coefficients[0]
    transition = np.zeros((size, size))
    transition[0] = first_row
    transition[1:, :-1] += np.eye(size - 1)
    return transition, first_row


def joint_system(filter_transition, filter_input, coefficients) -> tuple:
    """(M, u) of X_t = (x_t, s_t) = M X_{t−1} + u ζ_t (the module docstring, §10.6).

    Args:
      filter_transition: F [d, d] of the filter x_t = F x_{t−1} + b ĝ_t.
      filter_input: b [d].
      coefficients: BandMF's c_0, …, c_{b−1} (b ≥ 2).

    Returns:
      M [D, D] and u [D], D = d + b − 1, float64.
    """
    f = np.atleast_2d(np.asarray(filter_transition, np.float64))
    b = np.asarray(filter_input, np.float64).reshape(-1)
    noise_transition, noise_row = noise_recursion_system(coefficients)
    d, m = len(b), len(noise_row)
    transition = np.zeros((d + m, d + m))
    transition[:d, :d] = f
    transition[:d, d:] = np.outer(b, noise_row)
    transition[d:, d:] = noise_transition
    drive = np.concatenate([b, np.eye(m)[0]]) / float(coefficients[0])
    return transition, drive


def joint_covariance_step(covariance: tf.Tensor, transition: np.ndarray, drive: np.ndarray, filter_size: int,
                          restarted) -> tf.Tensor:
    """P_t = M P̃_{t−1} Mᵀ + u uᵀ, P̃ = P with the noise block zeroed when ``restarted`` (§10.6).

    Args:
      covariance: P_{t−1} flattened, [D·D] (zeros for a filter started at zero).
      transition, drive: M, u of ``joint_system``.
      filter_size: d, the filter's state size (the first d rows/columns of P).
      restarted: bool scalar tensor: BandMF started a new segment at step t (a zero buffer), so
        w̄_t is independent of everything before it.

    Returns:
      P_t flattened, [D·D], in ``covariance``'s dtype.
    """
    size = transition.shape[0]
    keep = np.zeros((size, size))
    keep[:filter_size, :filter_size] = 1.0
    previous = tf.reshape(tf.cast(covariance, tf.float64), [size, size])
    previous = tf.where(restarted, previous * tf.constant(keep), previous)
    m = tf.constant(transition)
    advanced = m @ previous @ tf.transpose(m) + tf.constant(np.outer(drive, drive))
    return tf.cast(tf.reshape(advanced, [-1]), covariance.dtype)


def attenuation_of_marginal(covariance: tf.Tensor, filter_size: int) -> tf.Tensor:
    """A'_t = P_t[0, 0] / P_t[d, d]: the filtered noise's variance per unit of the marginal
    variance F_n of the noise entering the filter (0 before the first step)."""
    size = int(round(float(covariance.shape[0]) ** 0.5))
    matrix = tf.reshape(covariance, [size, size])
    marginal = matrix[filter_size, filter_size]
    return tf.math.divide_no_nan(matrix[0, 0], marginal)


def stationary_attenuation_of_marginal(transition: np.ndarray, drive: np.ndarray, filter_size: int,
                                       max_steps: int = 100_000, tolerance: float = 1e-13) -> float:
    """lim A'_t: P iterated from zero (no restart) to its fixed point, P_∞[0, 0]/P_∞[d, d].

    Raises:
      ValueError: if P does not converge (an unstable filter or noise recursion).
    """
    covariance = np.zeros_like(transition)
    driving = np.outer(drive, drive)
    for _ in range(max_steps):
        following = transition @ covariance @ transition.T + driving
        if np.max(np.abs(following - covariance)) <= tolerance * max(1.0, np.max(np.abs(following))):
            return float(following[0, 0] / following[filter_size, filter_size])
        covariance = following
    raise ValueError("correction='stationary': the noise covariance of this filter fed this BandMF noise does not "
                     f"converge within {max_steps} steps (an unstable recursion); use correction='transient'.")
