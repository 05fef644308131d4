"""Clip factors: ḡ_i = c_i g_i with c_i = min(1, C / ‖g_i‖₂) (ALGORITHMS §1 step 3)."""

from __future__ import annotations

import tensorflow as tf


def clip_factors(squared_norms: tf.Tensor, l2_norm_clip: tf.Tensor, mask: tf.Tensor | None = None) -> tf.Tensor:
    """c_i = C / max(‖g_i‖, C) (= min(1, C/‖g_i‖), and 1 for a zero gradient), times the
    0/1 padding mask so padded rows contribute nothing.

    An example whose gradient is not finite (NaN/Inf) gets c_i = 0: it contributes zero,
    which keeps the sensitivity at C and keeps NaN out of the step."""
    clip = tf.cast(l2_norm_clip, squared_norms.dtype)
    factors = tf.where(tf.math.is_finite(squared_norms), clip / tf.maximum(tf.sqrt(squared_norms), clip), 0.0)
    return factors if mask is None else factors * tf.cast(mask, factors.dtype)


def drop_rows(per_example: tf.Tensor, clip_factors: tf.Tensor) -> tf.Tensor:
    """Zeroes the rows of examples with c_i = 0 (padding, non-finite gradients), so that
    0 · NaN never reaches a clipped sum."""
    keep = tf.reshape(clip_factors > 0, [-1] + [1] * (per_example.shape.rank - 1))
    return tf.where(keep, per_example, tf.zeros_like(per_example))
