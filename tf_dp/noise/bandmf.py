"""Banded matrix-factorization noise, BandMF / MF-DP-FTRL (docs/algorithms.md §10).

The released noisy sum of step t is x_t + w_t, where x_t = Σ_i ḡ_i(t) is the clipped sum
and w = C⁻¹z is noise CORRELATED across steps: z_t ~ N(0, σ²C_clip² I) is the very draw
DP-SGD would add at (key, t, variable) (``tf_dp.noise.gaussian.gaussian_draw``), and C is the
lower-triangular b-banded Toeplitz matrix with C[t, t−j] = c_j for j < b, normalised so that
Σ_j c_j² = 1 (its largest column norm). Forward substitution gives w online:

    w_t = (z_t − Σ_{j=1}^{b−1} c_j w_{t−j}) / c_0,

so the state is the last b − 1 vectors w (kept in units of each step's σC, see ``privatize``).
b = 1 is DP-SGD bit for bit. The buffer keeps b slots (memory b·|θ|): slot t mod b receives
w_t, and the slot it overwrites held w_{t−b}, which no step t' ≥ t reads. So a step that runs
twice at the same counter (a step a privacy budget blocks and the release that reuses its
counter, docs/algorithms.md A.4) computes the same w_t both times.

The privacy account of this noise holds only with cyclic Poisson sampling
(``tf_dp.sampling.CyclicPoissonSampler``: example i may join only steps t ≡ group(i) mod b), so
``required_sampling = "cyclic_poisson"``; the event is ``tf_dp.accounting.bandmf.bandmf_event``.

Several tf.distribute replicas (docs/algorithms.md §10.4): the recursion is linear, so each of
the R replicas runs it on its own SHARE, ζ_t^r ~ N(0, I) on its own Philox stream scaled by the
share's std σC/√R, with its own buffer (per-replica ``ON_READ`` variables); the all-reduced sum
Σ_r w_t^r = C⁻¹(Σ_r z^r)_t with Σ_r z_t^r ~ N(0, σ²C² I): the single-device mechanism's
distribution, as for white noise (``tf_dp.optimizers.transforms.privatize``).

Secrecy (docs/algorithms.md §10, Appendix B): the buffer determines future noise exactly as the
key does, so it lives in ``tf.Variable``s held by a plain Python object (``_NoiseBuffer``, like
``tf_dp.noise.NoiseKey``) that neither Keras saving nor ``tf.train.Checkpoint`` can reach. A
resumed model, a re-keyed one or a new ``fit`` (a new group assignment) starts a fresh, zero
buffer via ``reset``: the factorization becomes block-diagonal, still b-banded with column norms
≤ 1, so the account holds (the ledger starts a new segment).
"""

from __future__ import annotations

import math
import warnings
from typing import Optional, Sequence, Union

import numpy as np
import tensorflow as tf

import tf_dp.accounting.bandmf  # noqa: F401  (registers the "cyclic_poisson" event wherever BandMF exists)
from tf_dp import _checks
from tf_dp.noise.gaussian import add_gaussian_noise, gaussian_draw
from tf_dp.noise.privatizer import Privatizer, register_privatizer


def sqrt_coefficients(num_bands: int) -> np.ndarray:
    """c_j = binom(2j, j)/4^j for j < b (1, 1/2, 3/8, 5/16, …): the first b coefficients of
    (1 − x)^(−1/2), the square root of the prefix-sum workload; not yet normalised (§10)."""
    coefficients = np.ones(num_bands, dtype=np.float64)
    for j in range(1, num_bands):
        coefficients[j] = coefficients[j - 1] * (2 * j - 1) / (2 * j)
    return coefficients


def normalized_coefficients(num_bands: int, coefficients: Union[str, Sequence[float]] = "sqrt") -> np.ndarray:
    """c / ‖c‖₂, so that the banded Toeplitz C has largest column norm 1 (docs/algorithms.md §10).

    Args:
      num_bands: b ≥ 1.
      coefficients: "sqrt" (``sqrt_coefficients``) or b numbers c_0 > 0, c_1, …, c_{b−1}.

    Returns:
      float64 array of length b with Σ c_j² = 1.
    """
    if isinstance(coefficients, str):
        if coefficients != "sqrt":
            raise ValueError(f"`coefficients` must be 'sqrt' or a sequence of {num_bands} numbers, got "
                             f"{coefficients!r}.")
        raw = sqrt_coefficients(num_bands)
    else:
        raw = _checked_sequence(num_bands, coefficients)
    normalized = raw / math.sqrt(float(np.sum(raw * raw)))
    _warn_if_unstable(normalized)
    return normalized


# The marginal-variance table stops once Σ h_k² has converged (relative increment below
# _VARIANCE_TOLERANCE: after 20–400 terms for "sqrt" with b ≤ 128) or at _VARIANCE_HORIZON terms
# (only coefficients warned as unstable get there; their noise explodes anyway).
_VARIANCE_TOLERANCE, _VARIANCE_HORIZON = 1e-10, 4096


def inverse_impulse_response(coefficients: np.ndarray, length: int) -> np.ndarray:
    """h_k = C⁻¹[t, t−k] for k < length: C⁻¹ is lower-triangular Toeplitz too (docs/algorithms.md §10.1).

    h_0 = 1/c_0,  h_k = −(Σ_{j=1}^{min(k, b−1)} c_j h_{k−j}) / c_0, the forward substitution of
    ``BandMF.privatize`` applied to a unit impulse.

    Args:
      coefficients: c_0..c_{b−1} (normalised, c_0 > 0).
      length: how many terms.

    Returns:
      float64 array [length].
    """
    coefficients = np.asarray(coefficients, dtype=np.float64)
    response = np.zeros(int(length))
    response[0] = 1.0 / coefficients[0]
    with np.errstate(over="ignore", invalid="ignore"):  # unstable coefficients (warned) overflow
        for k in range(1, len(response)):
            lags = min(k, len(coefficients) - 1)
            response[k] = -np.dot(coefficients[1:lags + 1], response[k - 1::-1][:lags]) / coefficients[0]
    return response


def marginal_variance_factors(coefficients: np.ndarray) -> np.ndarray:
    """F_n = Σ_{k=0}^{n} h_k² = Σ_j (C⁻¹[t, j])²: the variance of one coordinate of the released
    noise w_t per unit of the step's (σC)², at position n = t − (first step of the segment)
    (docs/algorithms.md §10.5). F_n increases to its limit Σ_k h_k²; F ≡ 1 for b = 1.

    Returns:
      float64 array, F_0..F_H (H where the sum has converged, at most _VARIANCE_HORIZON terms);
      positions past H use F_H.
    """
    response = inverse_impulse_response(coefficients, 64)
    while True:
        with np.errstate(over="ignore", invalid="ignore"):
            factors = np.cumsum(response * response)
        factors = np.where(np.isfinite(factors), factors, np.finfo(np.float32).max)
        large = np.nonzero(response * response > _VARIANCE_TOLERANCE * factors)[0]
        converged_at = int(large[-1]) + 1 if len(large) else 0
        if converged_at < len(response) // 2:  # the second half of the terms adds nothing
            return factors[:converged_at + 1]
        if len(response) >= _VARIANCE_HORIZON:
            return factors
        response = inverse_impulse_response(coefficients, min(2 * len(response), _VARIANCE_HORIZON))


def _checked_sequence(num_bands: int, coefficients) -> np.ndarray:
    try:
        raw = np.asarray([float(c) for c in coefficients], dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"`coefficients` must be 'sqrt' or a sequence of {num_bands} real numbers, got "
                        f"{coefficients!r}.") from None
    if raw.shape != (num_bands,):
        raise ValueError(f"`coefficients` must have num_bands = {num_bands} entries (c_0..c_{num_bands - 1}), "
                         f"got {raw.size}.")
    if not np.all(np.isfinite(raw)):
        raise ValueError(f"`coefficients` must be finite, got {list(raw)}.")
    if raw[0] <= 0:
        raise ValueError(f"`coefficients[0]` (c_0, the diagonal of C) must be > 0 so that C is invertible, got "
                         f"{raw[0]}.")
    return raw


def _warn_if_unstable(coefficients: np.ndarray) -> None:
    """The recursion w_t = (z_t − Σ c_j w_{t−j})/c_0 grows geometrically when the polynomial
    Σ c_j x^j has a root inside the unit disk (utility, not privacy). Positive, non-increasing
    coefficients such as "sqrt" never do (Eneström–Kakeya)."""
    if len(coefficients) < 2:
        return
    roots = np.roots(coefficients[::-1])
    if len(roots) and np.min(np.abs(roots)) < 1 - 1e-9:
        shown = [round(float(c), 4) for c in coefficients]
        warnings.warn(f"tf_dp.noise.BandMF: the coefficients {shown} make C⁻¹ grow geometrically "
                      f"(a root of Σ c_j x^j has modulus {np.min(np.abs(roots)):.3g} < 1): the noise w = C⁻¹z "
                      "explodes over many steps. Use coefficients='sqrt'.", UserWarning, stacklevel=3)


class _NoiseBuffer:
    """The latest noise vectors w, one [b, *shape] variable per trainable variable.

    A plain Python object (not a ``tf.Module``/``Trackable``): whatever holds it is saved
    without it. Slot k of every variable holds w_s for the latest step s ≡ k mod b;
    ``last_step`` is the latest step written (−1: none since the last reset).
    """

    def __init__(self, variables: Sequence, slots: int):
        # Under a tf.distribute strategy every replica keeps its own buffer of its own shares
        # (ON_READ: replica-local reads and writes, no aggregation of the secret buffer).
        self.per_replica = tf.distribute.has_strategy()
        self.replicas = _strategy_replicas()
        with tf.init_scope():
            self.variables = [
                tf.Variable(tf.zeros([slots, *variable.shape], dtype=tf.as_dtype(variable.dtype)), trainable=False,
                            name=f"bandmf_buffer_{index}", **self._placement(tf.VariableAggregation.NONE))
                for index, variable in enumerate(variables)
            ]
            counter = self._placement(tf.VariableAggregation.ONLY_FIRST_REPLICA)  # equal on every replica
            self.last_step = tf.Variable(-1, dtype=tf.int64, trainable=False, name="bandmf_last_step", **counter)
            # The first step of the current segment (the latest start from a zero buffer).
            self.first_step = tf.Variable(-1, dtype=tf.int64, trainable=False, name="bandmf_first_step", **counter)
        self.shapes = [tuple(variable.shape) for variable in variables]
        self.dtypes = [tf.as_dtype(variable.dtype) for variable in variables]

    def _placement(self, aggregation) -> dict:
        if not self.per_replica:
            return {}
        return {"synchronization": tf.VariableSynchronization.ON_READ, "aggregation": aggregation}

    def matches(self, variables: Sequence) -> bool:
        return [tuple(v.shape) for v in variables] == self.shapes and [tf.as_dtype(v.dtype) for v in variables] \
            == self.dtypes

    def zero(self) -> None:
        for buffer in self.variables:
            buffer.assign(tf.zeros(buffer.shape, buffer.dtype), read_value=False)
        self.last_step.assign(-1)
        self.first_step.assign(-1)

    def has_drawn(self) -> bool:
        return int(self.last_step.numpy()) >= 0

    def restart_unless_continuing(self, step: tf.Tensor) -> tf.Tensor:
        """Zeros the slots (in the compiled step) unless ``step`` continues the buffer: the step
        after the latest one written, that step again (a reused counter), or any step after a
        reset. A counter that jumps (a ledger rolled back or moved on without a reset) would
        otherwise mix another run's w's into this one's. A step that starts from a zero buffer
        (after a reset or a restart) becomes the segment's ``first_step``."""
        last = self.last_step.read_value()
        continuing = tf.equal(step, last) | tf.equal(step, last + 1)
        starting = (last < 0) | tf.logical_not(continuing)
        self.first_step.assign(tf.where(starting, step, self.first_step.read_value()))

        def restart():
            with tf.control_dependencies([b.assign(tf.zeros(b.shape, b.dtype), read_value=False)
                                          for b in self.variables]):
                return tf.constant(True)

        return tf.cond((last < 0) | continuing, lambda: tf.constant(False), restart)

    def write(self, buffer: tf.Variable, slot: tf.Tensor, unit_noise: tf.Tensor) -> None:
        """buffer[slot] ← w̄_t. ON_READ variables have no scatter: the whole ring is rewritten."""
        if self.per_replica:
            buffer.assign(tf.tensor_scatter_nd_update(buffer.read_value(), tf.reshape(slot, [1, 1]),
                                                      unit_noise[tf.newaxis]), read_value=False)
        else:
            buffer.scatter_update(tf.IndexedSlices(unit_noise[tf.newaxis], tf.reshape(slot, [1])))

    def position(self) -> tf.Tensor:
        """n = t − first step of the segment, for the latest step t written (0 before any)."""
        return tf.maximum(self.last_step.read_value() - self.first_step.read_value(), 0)

    def num_bytes(self) -> int:
        return sum(int(np.prod(b.shape)) * b.dtype.size for b in self.variables)

    def __repr__(self) -> str:
        return "_NoiseBuffer(<secret>)"


@register_privatizer("bandmf")
class BandMF(Privatizer):
    """Banded matrix-factorization noise (docs/algorithms.md §10): x_t + w_t with w = C⁻¹z.

    Args:
      num_bands: b, the number of bands of C (1: DP-SGD). Memory: b·|θ| floats for b > 1.
      coefficients: "sqrt" (c_j = binom(2j, j)/4^j) or b numbers c_0 > 0, …; normalised to
        Σ c_j² = 1 either way.

    Use with ``tf_dp.DPSGD(..., noise=tf_dp.noise.BandMF(4))``; ``fit`` then samples with
    ``tf_dp.sampling.CyclicPoissonSampler`` (each example in one of b groups, q_b = b·L/N).
    Under R tf.distribute replicas each replica runs the recursion on its share (std σC/√R, its
    own stream and buffer); the all-reduced noise is C⁻¹z as on one device (§10.4).
    """

    required_sampling = "cyclic_poisson"

    def __init__(self, num_bands: int, coefficients: Union[str, Sequence[float]] = "sqrt"):
        self.num_bands = _checks.positive_int("num_bands", num_bands)
        self.coefficients = normalized_coefficients(self.num_bands, coefficients)
        self._coefficients_config = coefficients if isinstance(coefficients, str) else [float(c) for c in coefficients]
        self.variance_factors = marginal_variance_factors(self.coefficients)
        self._buffer: Optional[_NoiseBuffer] = None
        self._warned_resume = False
        self._has_drawn = False  # whether this privatizer has drawn for a model (a later reset is no resume)

    # -- state --
    def build(self, variables: Sequence) -> None:
        """Creates the zero buffer of b vectors per variable (eagerly, before tracing; per replica
        under a tf.distribute strategy's scope)."""
        variables = list(variables)
        if self.num_bands == 1:
            return
        if self._buffer is None or not self._buffer.matches(variables) \
                or self._buffer.replicas != _strategy_replicas():
            self._buffer = _NoiseBuffer(variables, self.num_bands)

    def reset(self, dp_step: int = 0) -> None:
        """Zeros the buffer: a fresh factorization segment (a new fit, a re-key, a resume).

        Args:
          dp_step: the ledger's step count; > 0 before this privatizer has drawn any noise means
            a resumed model continues with a fresh buffer, which is warned once (the
            factorization becomes block-diagonal). A later reset (a new fit) is silent.
        """
        self._has_drawn = self._has_drawn or (self._buffer is not None and self._buffer.has_drawn())
        if self._buffer is not None:
            self._buffer.zero()
        if int(dp_step) > 0 and self.num_bands > 1 and not self._has_drawn and not self._warned_resume:
            self._warned_resume = True
            warnings.warn(f"tf_dp.noise.BandMF: this model has taken {int(dp_step)} DP steps; its noise continues "
                          "with a fresh buffer (the previous one is never saved), so the factorization restarts "
                          "here: the privacy account holds, the noise is a little less favourable than an "
                          "uninterrupted run's.", UserWarning, stacklevel=2)

    def buffer_bytes(self) -> int:
        """Memory of the secret buffer: b·|θ|·(bytes per float) (0 for b = 1)."""
        return 0 if self._buffer is None else self._buffer.num_bytes()

    # -- the mechanism --
    def privatize(self, clipped_sums, stddev, key, dp_step, replica=0, replicas=1):
        """x_t + w_t, w_t = (z_t − Σ_{j=1}^{b−1} c_j w_{t−j})/c_0 (docs/algorithms.md §10).

        The buffer holds w̄ = C⁻¹ζ in units of each step's std s_t = σ_tC_t (ζ_t = z_t/s_t, the
        N(0, I) draw) and the step releases x_t + s_t·w̄_t: exactly C⁻¹z while s is constant,
        and private at each participation's own σ when σ or the clip bound C changes (§10.1).

        Under R replicas this is replica r's share: ``stddev`` is σC/√R, ζ_t^r its own stream,
        the buffer its own, and Σ_r s_t w̄_t^r/√R = s_t C⁻¹(Σ_r ζ^r/√R)_t with Σ_r ζ^r/√R ~ N(0, I):
        the all-reduced noise is distributed as one device's (docs/algorithms.md §10.4).

        Args:
          clipped_sums, stddev, key, dp_step, replica, replicas: as ``Privatizer.privatize``;
            z_t is ``gaussian_draw(..., key, dp_step, variable, replica, replicas)``. A second
            call at the same ``dp_step`` (a blocked step's counter reused) returns the same w_t.

        Returns:
          The noisy sums x_t + w_t, one per variable.
        """
        clipped_sums = list(clipped_sums)
        if self.num_bands == 1:  # C = [1]: the very computation of GaussianNoise
            return add_gaussian_noise(clipped_sums, stddev, key, dp_step, replica, replicas)
        if self._buffer is None or len(self._buffer.variables) != len(clipped_sums):
            raise RuntimeError("BandMF.privatize: call build(trainable_variables) first (the DP optimizer does).")
        _refuse_replica_mismatch(self._buffer.replicas, replicas, self.num_bands)
        slot, past_coefficients = self._ring(dp_step)
        with tf.control_dependencies([self._buffer.restart_unless_continuing(tf.cast(dp_step, tf.int64))]):
            slot = tf.identity(slot)
        noisy = []
        for index, (clipped, buffer) in enumerate(zip(clipped_sums, self._buffer.variables)):
            unit_draw = gaussian_draw(tf.shape(clipped), clipped.dtype, 1.0, key, dp_step, index, replica, replicas)
            unit_noise = self._correlated(unit_draw, buffer, past_coefficients)
            self._buffer.write(buffer, slot, unit_noise)
            noisy.append(clipped + tf.cast(stddev, clipped.dtype) * unit_noise)
        self._buffer.last_step.assign(tf.cast(dp_step, tf.int64))
        return noisy

    def _ring(self, dp_step) -> tuple:
        """(slot of w_t, the coefficient of each slot's vector) for t = dp_step: slot k holds
        w_{t−j}, j = (t − k) mod b; it weighs c_j for j ≥ 1 and 0 for j = 0 (slot t mod b, which
        holds w_{t−b} before this step writes w_t there)."""
        bands = self.num_bands
        step = tf.cast(dp_step, tf.int64)
        lags = tf.math.floormod(step - tf.range(bands, dtype=tf.int64), bands)
        past = np.concatenate([[0.0], self.coefficients[1:]])
        return tf.math.floormod(step, bands), tf.gather(tf.constant(past), lags)

    def _correlated(self, fresh: tf.Tensor, buffer: tf.Variable, past_coefficients: tf.Tensor) -> tf.Tensor:
        """w̄_t = (ζ_t − Σ_k c_{j(k)} buffer[k]) / c_0, in units of the step's σC."""
        past = tf.tensordot(tf.cast(past_coefficients, buffer.dtype), buffer.read_value(), axes=1)
        return (fresh - past) / tf.constant(self.coefficients[0], dtype=fresh.dtype)

    # -- what the optimizers' noise-bias corrections need --
    @property
    def white_noise(self) -> bool:
        """Whether the released noise is independent across steps: b = 1 only."""
        return self.num_bands == 1

    def noise_variance_factor(self) -> tf.Tensor:
        """F_n = Σ_j (C⁻¹[t, j])², the latest step's per-coordinate noise variance per unit of
        its (σC)², n its position in the segment (docs/algorithms.md §10.5; 1 for b = 1).

        Read after ``privatize`` in the same step (or after the step): the position is the
        buffer's. Returns a float32 scalar.
        """
        if self.num_bands == 1 or self._buffer is None:
            return tf.constant(1.0, tf.float32)
        factors = tf.constant(self.variance_factors, tf.float64)
        position = tf.minimum(self._buffer.position(), len(self.variance_factors) - 1)
        return tf.cast(tf.gather(factors, position), tf.float32)

    def noise_recursion(self):
        """(c_0, …, c_{b−1}) of c_0 w̄_t = ζ_t − Σ_j c_j w̄_{t−j}; None for b = 1 (white)."""
        return None if self.num_bands == 1 else self.coefficients.copy()

    def segment_restarted(self) -> tf.Tensor:
        """Whether the latest step started from a zero buffer (a segment's first step, §10.6)."""
        if self.num_bands == 1 or self._buffer is None:
            return tf.constant(False)
        return tf.equal(self._buffer.position(), 0)

    # -- what fit and the ledger need --
    def sampling_arguments(self) -> dict:
        return {"num_bands": self.num_bands}

    def get_config(self) -> dict:
        return {"num_bands": self.num_bands, "coefficients": self._coefficients_config}

    def __repr__(self) -> str:
        return f"BandMF(num_bands={self.num_bands}, coefficients={self._coefficients_config!r})"


def _strategy_replicas() -> int:
    return tf.distribute.get_strategy().num_replicas_in_sync if tf.distribute.has_strategy() else 1


def _refuse_replica_mismatch(built_for: int, replicas, num_bands: int) -> None:
    """The buffer must hold one ring per replica that privatizes: built under the strategy's scope."""
    if isinstance(replicas, int) and replicas != built_for:
        where = "a single replica (outside any tf.distribute strategy's scope)" if built_for == 1 else \
            f"{built_for} replicas"
        raise ValueError(f"noise=BandMF({num_bands}): the noise buffer was built for {where} but privatize runs on "
                         f"{replicas} replicas: each replica needs its own buffer of its own noise shares. Build the "
                         "DP optimizer (compile the model) under the same strategy's scope as training.")
