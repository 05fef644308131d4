"""Clip factors: ḡ_i = c_i g_i with c_i = min(1, C / ‖g_i‖₂) (docs/algorithms.md §1 step 3)."""

from __future__ import annotations

from typing import Callable

import tensorflow as tf


def clip_factors(squared_norms: tf.Tensor, l2_norm_clip: tf.Tensor, mask: tf.Tensor | None = None) -> tf.Tensor:
    """c_i = C / max(‖g_i‖, C) (= min(1, C/‖g_i‖), and 1 for a zero gradient), times the
    0/1 padding mask so padded rows contribute nothing.

    An example whose gradient is not finite (NaN/Inf) gets c_i = 0: it contributes zero,
    which keeps the sensitivity at C and keeps NaN out of the step; so does a negative
    squared norm (no rule gives one; a factor of 1 would be unsafe).

    Args:
      squared_norms: [P] per-example squared gradient norms ‖g_i‖².
      l2_norm_clip: C, the clipping norm.
      mask: the [P] 0/1 padding mask, or None (every row real).

    Returns:
      The [P] clip factors c_i.
    """
    clip = tf.cast(l2_norm_clip, squared_norms.dtype)
    valid = tf.logical_and(tf.math.is_finite(squared_norms), squared_norms >= 0)
    safe = tf.where(valid, squared_norms, tf.zeros_like(squared_norms))
    factors = tf.where(valid, clip / tf.maximum(tf.sqrt(safe), clip), tf.zeros_like(squared_norms))
    return factors if mask is None else factors * tf.cast(mask, factors.dtype)


def drop_rows(per_example: tf.Tensor, clip_factors: tf.Tensor) -> tf.Tensor:
    """Zeroes the rows of examples with c_i = 0 (padding, non-finite gradients), so that
    0 · NaN never reaches a clipped sum."""
    keep = tf.reshape(clip_factors > 0, [-1] + [1] * (per_example.shape.rank - 1))
    return tf.where(keep, per_example, tf.zeros_like(per_example))


def sum_over_examples(weighted_sum: Callable[..., list], clip_factors: tf.Tensor, *per_example: tf.Tensor) -> list:
    """``weighted_sum(c, *per_example)`` (a list of Σ_i c_i(...) tensors), with every example
    with c_i = 0 adding exactly zero.

    0 · NaN = NaN, so a dropped example (padding, or a NaN/Inf gradient) could poison the
    sum. Zeroing its rows first costs a pass over every per-example tensor, so that runs only
    when needed: the sum over all rows is finite iff no dropped row held NaN/Inf (rows with
    c_i > 0 are finite — their squared norms were), and then it is already exact."""
    fast = weighted_sum(clip_factors, *per_example)
    finite = tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(t)) for t in fast]))
    return tf.cond(finite, lambda: [tf.identity(t) for t in fast],
                   lambda: weighted_sum(clip_factors, *[drop_rows(t, clip_factors) for t in per_example]))


def weighted_row_sum(clip_factors: tf.Tensor, per_example: tf.Tensor) -> tf.Tensor:
    """Σ_i c_i g_i of an explicit [P, ...] per-example tensor (NaN-safe, see sum_over_examples)."""
    def tensordot(c, g):
        return [tf.tensordot(tf.cast(c, g.dtype), g, axes=1)]
    return sum_over_examples(tensordot, clip_factors, per_example)[0]
