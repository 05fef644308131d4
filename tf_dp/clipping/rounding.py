"""Rounding-error bounds that make per-example norms safe to clip against (ALGORITHMS §6).

A clip factor c_i = C / max(U_i, C) bounds the released contribution c_i ĝ_i by C only if
U_i ≥ ‖ĝ_i‖, where ĝ_i is the per-example gradient as the clipped sum computes it. Forms
that sum over positions t (the Gram form, explicit A_iᵀS_i, repeated embedding ids) can
cancel: large terms, a small sum. Their norms and released sums are therefore computed in
float64 from the float32 inputs, and U_i is inflated by a worst-case rounding bound.

Standard model (Higham, Accuracy and Stability of Numerical Algorithms, §3.1): with
u = 2⁻⁵³, any summation order of n float64 terms errs by at most γ_{n−1}·Σ|terms|,
γ_n = n·u / (1 − n·u); a product of two float32 values is exact in float64. With
M_i = Σ_t ‖a_it‖‖s_it‖ (so ‖g_i‖ ≤ M_i) this gives, for g_i = Σ_t a_it s_itᵀ:

    Gram form  |Ñ_i² − ‖g_i‖²| ≤ γ_{T²+d+k+1} · M_i²
    a sum Σ_t a_it s_itᵀ (explicit form, or the released Σ_i c_i A_iᵀS_i of one example)
               ‖ĝ_i − g_i‖_F ≤ γ_T · M_i

so U_i = sqrt(max(Ñ_i², 0) + γ_G M_i²) + γ_R M_i ≥ max(‖g_i‖, ‖ĝ_i‖), with γ_G, γ_R
the bounds of the Gram and summed forms (doubled to cover the rounding of M_i and U_i
themselves, whose terms are all positive). The inflation is tiny for ordinary inputs
(relative γ·(M_i/‖g_i‖)², ~1e-12) and only bites under cancellation, where it caps the
weight of an example at C / (sqrt(γ_G)·M_i): a cancelling example is never amplified.
"""

from __future__ import annotations

import functools

import tensorflow as tf

FLOAT32_MAX = 3.4028234663852886e38


def unit_roundoff(dtype) -> float:
    """u of the arithmetic ``dtype`` tensors are summed in: 2⁻⁵³ for float64, 2⁻²⁴ for
    float32 — or 2⁻¹¹ where TensorFloat-32 is on and a GPU is visible (TF32 matmuls round
    their float32 inputs to 10 mantissa bits; on by default on Ampere and later)."""
    if tf.as_dtype(dtype) == tf.float64:
        return 2.0 ** -53
    if tf.config.experimental.tensor_float_32_execution_enabled() and _gpus_visible():
        return 2.0 ** -11
    return 2.0 ** -24


@functools.lru_cache(maxsize=None)
def _gpus_visible() -> bool:
    return bool(tf.config.list_physical_devices("GPU"))


def gamma(n, dtype=tf.float64) -> tf.Tensor:
    """γ_n = n·u / (1 − n·u) in float64 (n a Python or tensor count, u of ``dtype``), times
    1 + 2⁻³⁰ for the float64 rounding of the bound's own positive terms; +inf once
    n·u ≥ 1/2 (no bound: the example then gets a zero clip factor)."""
    nu = tf.maximum(tf.cast(n, tf.float64), 0.0) * unit_roundoff(dtype)
    return tf.where(nu < 0.5, (1.0 + 2.0 ** -30) * nu / (1.0 - nu), tf.constant(float("inf"), tf.float64))


def certified_norm(squared_estimate: tf.Tensor, cancellation_scale: tf.Tensor, gram_terms, summed_terms,
                   squared_terms=0, summed_dtype=tf.float64) -> tf.Tensor:
    """U = sqrt(max(Ñ², 0)·(1 + γ_S) + γ_G M²) + γ_R M, an upper bound on the exact norm and
    on the norm of the sum that is released. ``gram_terms``: the n of γ_G (0 when Ñ² is a
    float64 sum of ``squared_terms`` squares of the released values themselves, whose
    relative error γ_S the factor covers); ``summed_terms``: the n of γ_R, for sums in
    ``summed_dtype``."""
    m = cancellation_scale
    squared = tf.maximum(squared_estimate, 0.0) * (1.0 + gamma(squared_terms))
    gram_slack = tf.math.multiply_no_nan(gamma(gram_terms), tf.square(m))  # 0 (not NaN) when M = 0
    return tf.sqrt(squared + gram_slack) + tf.math.multiply_no_nan(gamma(summed_terms, summed_dtype), m)


def row_norms(tensor: tf.Tensor) -> tf.Tensor:
    """‖x_t‖ over the last axis, float64 (float32 inputs: the squares are exact)."""
    return tf.sqrt(tf.reduce_sum(tf.square(tf.cast(tensor, tf.float64)), axis=-1))


def round_down_to_float32(values: tf.Tensor) -> tf.Tensor:
    """float64 → float32 rounding toward zero (for nonnegative values), so a clip factor
    never grows in the cast."""
    rounded = tf.cast(values, tf.float32)
    too_big = tf.cast(rounded, tf.float64) > values
    return tf.where(too_big, tf.math.nextafter(rounded, tf.zeros_like(rounded)), rounded)
