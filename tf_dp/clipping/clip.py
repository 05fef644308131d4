"""Clip factors: ḡ_i = c_i g_i with c_i = min(1, C / ‖g_i‖₂) (ALGORITHMS §1 step 3)."""

from __future__ import annotations

import tensorflow as tf


def clip_factors(squared_norms: tf.Tensor, l2_norm_clip: tf.Tensor, mask: tf.Tensor | None = None) -> tf.Tensor:
    """c_i = C / max(‖g_i‖, C) (= min(1, C/‖g_i‖), and 1 for a zero gradient), times the
    0/1 padding mask so padded rows contribute nothing."""
    clip = tf.cast(l2_norm_clip, squared_norms.dtype)
    factors = clip / tf.maximum(tf.sqrt(squared_norms), clip)
    return factors if mask is None else factors * tf.cast(mask, factors.dtype)
