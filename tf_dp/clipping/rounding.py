"""Rounding-error bounds that make per-example norms safe to clip against (docs/algorithms.md §6).

A clip factor c_i = C / max(U_i, C) bounds example i's released contribution c_i ĝ_i by C
only if U_i ≥ ‖ĝ_i‖, ĝ_i being the per-example gradient as the clipped sum computes it.
Forms that sum over positions t (Σ_t a_it s_itᵀ, the Gram form, repeated embedding ids)
can cancel — large terms, a small sum — so in floating point ĝ_i, the Gram estimate Ñ_i
and the exact g_i can all differ by much more than their own size. Each rule therefore
returns an upper bound U_i² valid for any finite input, on BOTH the exact ‖g_i‖ and the
norm of what it releases; the clip factor comes from that bound.

Standard model (Higham, Accuracy and Stability of Numerical Algorithms, §3.1): summing n
terms in any order, with unit roundoff u (2⁻²⁴ float32, 2⁻⁵³ float64), errs by at most
γ_{n−1}·Σ|terms|, γ_n = n·u / (1 − n·u); products of two float32 values are exact in
float64. With M_i = Σ_t ‖a_it‖‖s_it‖ (so ‖g_i‖ ≤ M_i):

    a sum ĝ_i = Σ_t a_it s_itᵀ (explicit form; or example i's part of a clipped sum)
        ‖ĝ_i − g_i‖_F ≤ γ_T · M_i            ⇒ U_i = ‖ĝ_i‖ + γ_{T+1} M_i
    the Gram form in float64, Ñ_i² = Σ_{t,t'} (a_it·a_it')(s_it·s_it')
        |Ñ_i² − ‖g_i‖²| ≤ γ_{T²+d+k+1} M_i²  ⇒ U_i = sqrt(max(Ñ_i², 0) + γ_G M_i²) + γ_R M_i
                                              (γ_R for the float64 clipped sum)

Sums of squares (‖ĝ_i‖², ‖a_it‖²) have positive terms only: relative error ≈ 1e-6, bounded
above in squared_sum (a float32 overflow gives inf, and the example is dropped, not under-
clipped). The margins are tiny for ordinary inputs — relative γ_{T+1}·M_i/‖g_i‖, about
T·6e-8·√T in float32 (≈ 1e-5 for T = 64) — and only bite under cancellation, where they
cap the example's weight. Outside these bounds: materialized per-example gradients from a
TensorFlow kernel (grouped/depthwise conv route, LayerNormalization, the per-layer and
vectorized fallbacks) are clipped by the norm of exactly the vector released, which bounds
the release but not the kernel's own distance to the exact gradient.
"""

from __future__ import annotations

import functools
from typing import Optional

import numpy as np
import tensorflow as tf

from tf_dp._xla import compiling_with_xla

FLOAT32_MAX = 3.4028234663852886e38
# Counts and sizes known at trace time become float64 constants and static shapes (fewer ops
# to trace, the same bits); False builds the ops from tf.shape as before (for comparisons).
FOLD_STATIC_COUNTS = True


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
    n·u ≥ 1/2 (no bound: the example then gets a zero clip factor). A count known at trace
    time gives one float64 constant (``gamma_value``: the same float64 operations, so the
    same bits), a tensor count the ops."""
    value = gamma_value(n, dtype)
    if value is not None:
        return tf.constant(value, tf.float64)
    nu = tf.maximum(tf.cast(n, tf.float64), 0.0) * unit_roundoff(dtype)
    return tf.where(nu < 0.5, (1.0 + 2.0 ** -30) * nu / (1.0 - nu), tf.constant(float("inf"), tf.float64))


def gamma_value(n, dtype=tf.float64) -> Optional[float]:
    """γ_n of ``gamma`` as a Python float (IEEE float64, the graph's operations in the
    graph's order) when n is known at trace time (a Python number or a constant tensor),
    else None."""
    count = static_count(n) if FOLD_STATIC_COUNTS else None
    if count is None:
        return None
    nu = max(count, 0.0) * unit_roundoff(dtype)
    return (1.0 + 2.0 ** -30) * nu / (1.0 - nu) if nu < 0.5 else float("inf")


def static_count(n) -> Optional[float]:
    """float64(n) for a count known at trace time (Python, numpy or constant scalar), else None."""
    if isinstance(n, (bool, np.bool_)):
        return None
    if isinstance(n, (int, float, np.integer, np.floating)):
        return float(n)
    if tf.is_tensor(n) and n.shape.rank == 0:
        value = tf.get_static_value(n)
        if value is not None:
            return float(value)
    return None


def dimension(tensor: tf.Tensor, axis: int):
    """``tensor``'s size along ``axis``: a Python int when static, else a scalar tensor."""
    size = tensor.shape[axis]
    return size if size is not None and FOLD_STATIC_COUNTS else tf.shape(tensor)[axis]


def per_example_rows(tensor: tf.Tensor) -> tf.Tensor:
    """``tensor`` [P, ...] as [P, n], n static whenever the trailing sizes are (so
    ``squared_sum`` chunks it without shape ops)."""
    trailing = tensor.shape[1:]
    if FOLD_STATIC_COUNTS and trailing.is_fully_defined() and trailing.num_elements() > 0:
        return tf.reshape(tensor, [-1 if tensor.shape[0] is None else tensor.shape[0], trailing.num_elements()])
    return tf.reshape(tensor, [tf.shape(tensor)[0], -1])


def certified_norm(squared_estimate: tf.Tensor, cancellation_scale: tf.Tensor, gram_terms, summed_terms,
                   summed_dtype=tf.float64) -> tf.Tensor:
    """U = sqrt(max(Ñ², 0) + γ_G M²) + γ_R M, an upper bound on the exact norm and on the
    norm of the sum that is released. ``gram_terms``: the n of γ_G (0 when Ñ² is already
    an upper bound, squared_sum of the released values themselves); ``summed_terms``: the
    n of γ_R, for sums in ``summed_dtype``."""
    m = cancellation_scale
    gram_slack = tf.math.multiply_no_nan(gamma(gram_terms), tf.square(m))  # 0 (not NaN) when M = 0
    return tf.sqrt(tf.maximum(squared_estimate, 0.0) + gram_slack) + tf.math.multiply_no_nan(
        gamma(summed_terms, summed_dtype), m)


_CHUNK = 16  # float32 partial sums of 16 squares: relative error ≤ γ_16 ≈ 1e-6


def _chunk_size(n) -> int:
    """Squares per float32 partial sum: 16, or for a static length n that 16 does not divide
    the largest divisor of n in [8, 16) (5000 → 10), which spares padding a copy of the
    tensor (a vocabulary-wide [P, T, V] one in the tied-embedding rule); else 16 with padding."""
    if n is None or n % _CHUNK == 0:
        return _CHUNK
    return next((size for size in range(_CHUNK - 1, 7, -1) if n % size == 0), _CHUNK)


def squared_sum(tensor: tf.Tensor) -> tf.Tensor:
    """An upper bound on Σ x² over the last axis, in float64. All terms are positive, so the
    only error is relative: float32 tensors are summed in chunks of at most 16 in float32
    (≤ γ_16), the chunk sums in float64 (≤ γ_n of float64), and the result is raised by both.
    A float32 chunk beyond 3.4e38 gives inf: that example is then dropped (clip factor 0),
    never clipped too weakly."""
    if tensor.dtype == tf.float64:
        n = tensor.shape[-1]
        raise_by = _one_plus_gamma(None if n is None else n + 1, lambda: tf.shape(tensor)[-1] + 1)
        return tf.reduce_sum(tf.square(tensor), axis=-1) * raise_by
    n = tensor.shape[-1]
    chunk = _chunk_size(n)
    if n is None or n % chunk:
        tensor = _pad_last_axis(tensor, n, chunk)
    chunks = _reshape_into_chunks(tensor, chunk)
    partial = tf.cast(tf.reduce_sum(tf.square(chunks), axis=-1), tf.float64)
    total = tf.reduce_sum(partial, axis=-1)
    return total * _one_plus_gamma(chunk, lambda: chunk, tensor.dtype) * _one_plus_gamma(
        partial.shape[-1], lambda: tf.shape(partial)[-1])


def _one_plus_gamma(static_n, dynamic_n, dtype=tf.float64):
    """1 + γ_n: a Python float when n is static (``static_n``), else the ops on ``dynamic_n()``."""
    value = None if static_n is None else gamma_value(static_n, dtype)
    return 1.0 + value if value is not None else 1.0 + gamma(dynamic_n(), dtype)


def _pad_last_axis(tensor: tf.Tensor, n, chunk: int) -> tf.Tensor:
    """Zeros up to a multiple of ``chunk`` along the last axis (static paddings when n and the rank are)."""
    rank = tensor.shape.rank
    if FOLD_STATIC_COUNTS and n is not None and rank is not None:
        return tf.pad(tensor, [[0, 0]] * (rank - 1) + [[0, -n % chunk]])
    pad = tf.math.floormod(-tf.shape(tensor)[-1], chunk)
    return tf.pad(tensor, tf.concat([tf.zeros([tf.rank(tensor) - 1, 2], tf.int32), [[0, pad]]], axis=0))


def _reshape_into_chunks(tensor: tf.Tensor, chunk: int) -> tf.Tensor:
    """[..., n] → [..., n / chunk, chunk]: a static shape when at most one leading size is unknown."""
    dims = tensor.shape.as_list() if tensor.shape.rank is not None else None
    if FOLD_STATIC_COUNTS and dims is not None and all(d is None or d > 0 for d in dims) and dims[-1] is not None \
            and sum(d is None for d in dims[:-1]) <= 1:
        return tf.reshape(tensor, [-1 if d is None else d for d in dims[:-1]] + [dims[-1] // chunk, chunk])
    return tf.reshape(tensor, tf.concat([tf.shape(tensor)[:-1], [-1, chunk]], axis=0))


def row_norms(tensor: tf.Tensor) -> tf.Tensor:
    """Upper bounds on ‖x_t‖ over the last axis, in float64 — for the scales M_i of the
    rounding slack only (a loose factor there moves U_i by γ·(that factor)·M_i).

    float32: one EuclideanNorm pass, fl(sqrt(fl(Σ x²))) = r̂, with fl(Σ x²) ≥ (1 − γ_n) Σ x²
    in any summation order (n squares, n − 1 additions) and the square root ≥ (1 − u)·exact,
    so ‖x‖ ≤ r̂ / ((1 − u)(1 − γ_n)^½) ≤ r̂ (1 + 2γ_{n+1}); r̂ in float64 is raised by that and
    by 1 + 2⁻⁵⁰ for the float64 product; plus √(2n)·2⁻⁶³ for what underflow can hide (values
    below 2⁻¹²⁶, flushed to zero, where the relative bound fails). A square beyond 3.4e38 gives inf (the example is
    dropped), as in squared_sum. Other dtypes, and under XLA (no EuclideanNorm kernel; it
    fuses the squares anyway): squared_sum."""
    if tensor.dtype != tf.float32 or compiling_with_xla():
        return tf.sqrt(squared_sum(tensor)) * (1.0 + 2.0 ** -50)
    n = tensor.shape[-1]
    one_plus = _one_plus_gamma(None if n is None else n + 1, lambda: tf.shape(tensor)[-1] + 1, tensor.dtype)
    raise_by = 2.0 * one_plus - 1.0  # 1 + 2γ_{n+1}
    rounded = tf.cast(tf.math.reduce_euclidean_norm(tensor, axis=-1), tf.float64) * raise_by * (1.0 + 2.0 ** -50)
    return rounded + _underflow_slack(n, tensor)


def _underflow_slack(n, tensor: tf.Tensor):
    """√(2n)·2⁻⁶³: what float32 underflow can hide from a sum of n squares. Below 2⁻¹²⁶ the
    relative bound γ_n does not hold, and TensorFlow's CPU kernels flush subnormals to zero:
    each of the 2n − 1 operations loses at most 2⁻¹²⁶ absolutely, so
    Σ x² ≤ fl(Σ x²)/(1 − γ_n) + 2n·2⁻¹²⁶ and ‖x‖ ≤ (the relative bound) + √(2n)·2⁻⁶³."""
    count = tf.constant(float(n), tf.float64) if n is not None else tf.cast(tf.shape(tensor)[-1], tf.float64)
    return tf.sqrt(2.0 * count) * 2.0 ** -63


def round_down_to_float32(values: tf.Tensor) -> tf.Tensor:
    """float64 → float32 rounding toward zero (for nonnegative values), so a clip factor
    never grows in the cast."""
    rounded = tf.cast(values, tf.float32)
    too_big = tf.cast(rounded, tf.float64) > values
    return tf.where(too_big, tf.math.nextafter(rounded, tf.zeros_like(rounded)), rounded)
