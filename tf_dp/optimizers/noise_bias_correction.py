"""Adam's update with the noise-variance bias of the second moment removed (DP-AdamBC).

Adam's v_t = β₂ v_{t−1} + (1−β₂) ĝ_t² absorbs the DP noise variance σ_w² per coordinate
(Tang et al. 2024). The corrected step uses

    v̄_t = max(v̂_t − A·σ_w², variance_floor),   θ ← θ − η m̂_t / (√v̄_t + ε)

with A = 1 for DP-AdamBC and A = A(ω) for FIBER's filtered gradient.
"""

from __future__ import annotations

import tensorflow as tf


def corrected_adam_direction(
    m: tf.Tensor,
    v: tf.Tensor,
    step: tf.Tensor,
    beta_1: float,
    beta_2: float,
    epsilon: float,
    noise_variance: tf.Tensor,
    variance_floor: float,
) -> tf.Tensor:
    """Returns m̂ / (√max(v̂ − noise_variance, variance_floor) + ε)."""
    dtype = m.dtype
    step = tf.cast(step, dtype)
    m_hat = m / (1 - tf.pow(tf.cast(beta_1, dtype), step))
    v_hat = v / (1 - tf.pow(tf.cast(beta_2, dtype), step))
    v_bar = tf.maximum(v_hat - tf.cast(noise_variance, dtype), tf.cast(variance_floor, dtype))
    return m_hat / (tf.sqrt(v_bar) + tf.cast(epsilon, dtype))
