"""Adaptive clipping: a private quantile estimate drives the clip bound (docs/algorithms.md §12).

Andrew et al. (2021). Pass ``AdaptiveClip(initial, ...)`` as ``l2_norm_clip=`` of a DP
optimizer; the optimizer keeps C_t in its ``l2_norm_clip`` variable (public: saved, logged)
and per step

* noises the gradient sum with the multiplier ``gradient_noise_multiplier(σ)`` = σ_Δ instead
  of σ, and
* sets C_{t+1} = ``next_bound(C_t, squared_norms, mask, L, key, dp_step)``.

The centred count Σ_i mask_i (1[‖g_i‖ ≤ C_t] − ½) has sensitivity ½ (one example added or
removed moves it by ±½); released with noise N(0, σ_b²) beside the gradient sum (sensitivity
C_t, noise σ_Δ·C_t), the pair is one Gaussian mechanism of multiplier σ with
σ⁻² = σ_Δ⁻² + (2σ_b)⁻². So the ledger records the user's σ and ε is unchanged; the gradient
pays with σ_Δ > σ.

The count noise is drawn from Philox keyed by the run's noise key at the DP step, on stream
``COUNT_STREAM`` (−2, allocated in tf_dp/streams.py), which no Gaussian gradient draw (streams ≥ 0)
and no Laplace draw (−1) uses. Under R > 1 tf.distribute replicas the count is GLOBAL: replica r
adds a share N(0, σ_b²/R) on stream ``count_stream(r, R)`` to its own chunks' count and one
all-reduce sums counts and shares, so every replica updates C from the same noisy global count
(in secure mode too, where the replicas' keys differ).
"""

from __future__ import annotations

import numbers
from typing import Optional

import keras
import tensorflow as tf

from tf_dp import _checks, streams
from tf_dp.noise.gaussian import draw_seed

COUNT_STREAM = streams.ADAPTIVE_COUNT.code  # Philox stream of the count noise (allocated in tf_dp.streams)
DEFAULT_COUNT_STDDEV_FRACTION = 1.0 / 20.0  # σ_b = L/20 (Andrew et al. 2021)


@keras.saving.register_keras_serializable(package="tf_dp")
class AdaptiveClip:
    """A clip bound C_t that tracks the γ-quantile of the per-example gradient norms.

    b̃_t = (Σ_i mask_i (1[‖g_i‖ ≤ C_t] − ½) + N(0, σ_b²))/L + ½ and
    C_{t+1} = C_t · exp(−η (b̃_t − γ))  (docs/algorithms.md §12).

    Args:
      initial: C_0 > 0, the bound of the first step.
      target_quantile: γ in (0, 1), the fraction of examples meant to be unclipped.
      learning_rate: η > 0 of the geometric update.
      count_stddev: σ_b, the std of the noise on the centred count; None = L/20 with L the
        expected batch size, which the optimizer passes to both ``next_bound`` and
        ``gradient_noise_multiplier`` (the same L in one step, so both see the same σ_b).
        It must exceed σ/2 for the noise multiplier σ: σ_Δ⁻² = σ⁻² − (2σ_b)⁻² > 0 needs
        2σ_b > σ (else the count takes all the noise and none is left for the gradient);
        0 only with σ = 0 (a non-private run).
    """

    def __init__(self, initial: float, target_quantile: float = 0.5, learning_rate: float = 0.2,
                 count_stddev: Optional[float] = None):
        self.initial = _checks.positive("initial", initial, "It is the first step's clip bound C_0.")
        self.target_quantile = _checks.in_open_unit_interval("target_quantile", target_quantile)
        self.learning_rate = _checks.positive("learning_rate", learning_rate,
                                              "It is η in C_{t+1} = C_t·exp(−η(b̃_t − γ)).")
        self.count_stddev = None if count_stddev is None else _checks.non_negative(
            "count_stddev", count_stddev, "It is σ_b, the std of the noise on the clipped count (None: L/20).")

    def count_stddev_for(self, expected_batch_size):
        """σ_b: ``count_stddev``, or L/20 for L = ``expected_batch_size`` when it is None."""
        if self.count_stddev is not None:
            return self.count_stddev
        if expected_batch_size is None:
            raise ValueError("AdaptiveClip(count_stddev=None) sets σ_b = L/20 and needs the expected batch size L: "
                             "pass `expected_batch_size`, or give `count_stddev` explicitly.")
        if _is_number(expected_batch_size):
            return _checks.positive("expected_batch_size", expected_batch_size) * DEFAULT_COUNT_STDDEV_FRACTION
        return tf.cast(expected_batch_size, tf.float64) * DEFAULT_COUNT_STDDEV_FRACTION

    def smallest_count_stddev(self, noise_multiplier: float) -> float:
        """σ/2: σ_b must be strictly above it to leave noise for the gradient (2σ_b > σ)."""
        return noise_multiplier / 2.0

    def gradient_noise_multiplier(self, noise_multiplier, expected_batch_size=None):
        """σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2), the multiplier of the gradient sum's noise
        (docs/algorithms.md §12). σ = 0 (non-private) gives 0.

        Args:
          noise_multiplier: σ, what the ledger records (a number, or a tensor in a step).
          expected_batch_size: L, needed when ``count_stddev`` is None (σ_b = L/20).

        Returns:
          σ_Δ ≥ σ, a float for numbers (ValueError naming ``count_stddev`` when
          σ_b ≤ σ/2), else a tensor of σ's dtype (float32 if σ is a number), with the same
          check as a runtime assertion.
        """
        count_stddev = self.count_stddev_for(expected_batch_size)
        if _is_number(noise_multiplier) and _is_number(count_stddev):
            return self._static_multiplier(_checks.non_negative("noise_multiplier", noise_multiplier),
                                           float(count_stddev))
        dtype = noise_multiplier.dtype if tf.is_tensor(noise_multiplier) else tf.float32
        sigma = tf.cast(noise_multiplier, tf.float64)
        count_stddev = tf.cast(count_stddev, tf.float64)
        remaining = tf.math.reciprocal(tf.square(sigma)) - tf.math.reciprocal(tf.square(2.0 * count_stddev))
        check = tf.debugging.assert_positive(
            tf.where(sigma > 0, remaining, tf.ones_like(remaining)),
            message="AdaptiveClip: `count_stddev` σ_b must exceed noise_multiplier/2; no noise is left for "
                    "the gradient. Raise count_stddev (or the expected batch size, σ_b = L/20).")
        with tf.control_dependencies([check]):
            multiplier = tf.where(sigma > 0, tf.math.rsqrt(tf.maximum(remaining, 1e-300)), tf.zeros_like(sigma))
        return tf.cast(multiplier, dtype)

    def _static_multiplier(self, sigma: float, count_stddev: float) -> float:
        if sigma == 0:
            return 0.0
        smallest = self.smallest_count_stddev(sigma)
        if not count_stddev > smallest:
            raise ValueError(
                f"AdaptiveClip: `count_stddev` σ_b = {count_stddev} must exceed noise_multiplier/2 = {smallest} "
                f"(noise_multiplier = {sigma}); else the count takes all the noise and none is left for the gradient. "
                f"Use count_stddev > {smallest} (e.g. {2 * smallest}), or a larger expected batch size when "
                "count_stddev is None (σ_b = L/20).")
        return (sigma ** -2 - (2.0 * count_stddev) ** -2) ** -0.5

    def centred_count(self, l2_norm_clip, squared_norms, mask) -> tf.Tensor:
        """Σ_i mask_i (1[‖g_i‖ ≤ C_t] − ½) in float64 (sensitivity ½; it adds over chunks and
        replicas). A non-finite norm counts as above C_t."""
        clip = tf.cast(l2_norm_clip, tf.float64)
        below = tf.cast(tf.cast(squared_norms, tf.float64) <= tf.square(clip), tf.float64)
        return tf.reduce_sum(tf.cast(mask, tf.float64) * (below - 0.5))

    def count_noise(self, key, dp_step, expected_batch_size=None, replica=0, replicas: int = 1) -> tf.Tensor:
        """N(0, σ_b²) in float64 from Philox at (key, dp_step) on stream COUNT_STREAM; under R > 1
        replicas, replica r's share N(0, σ_b²/R) on its own stream ``count_stream(r, R)``."""
        stream = COUNT_STREAM if replicas == 1 else count_stream(replica, replicas)
        seed = draw_seed(key, dp_step, stream)
        stddev = tf.cast(self.count_stddev_for(expected_batch_size), tf.float64) / replicas**0.5
        return stddev * tf.random.stateless_normal([], seed=seed, dtype=tf.float64, alg="philox")

    def next_bound_from_count(self, l2_norm_clip, centred_count, expected_batch_size, key, dp_step) -> tf.Tensor:
        """C_{t+1} = C_t·exp(−η(b̃_t − γ)), b̃_t = (centred count + N(0, σ_b²))/L + ½, in C_t's dtype."""
        noisy = centred_count + self.count_noise(key, dp_step, expected_batch_size)
        return self._bound_from_noisy_count(l2_norm_clip, noisy, expected_batch_size)

    def _bound_from_noisy_count(self, l2_norm_clip, noisy, expected_batch_size) -> tf.Tensor:
        fraction = noisy / tf.cast(expected_batch_size, tf.float64) + 0.5
        clip = tf.cast(l2_norm_clip, tf.float64)
        updated = clip * tf.exp(-self.learning_rate * (fraction - self.target_quantile))
        return tf.cast(updated, getattr(l2_norm_clip, "dtype", tf.float32))

    def next_bound(self, l2_norm_clip, squared_norms, mask, expected_batch_size, key, dp_step,
                   noise_multiplier=None) -> tf.Tensor:
        """C_{t+1} from this step's flat squared norms (docs/algorithms.md §12).

        Args:
          l2_norm_clip: C_t, the bound this step clipped against.
          squared_norms: [B] float32, ClippedBatch.squared_norms (upper bounds on ‖g_i‖²) of
            this replica's chunks. Under R > 1 tf.distribute replicas each replica adds a share
            N(0, σ_b²/R) to its count and the shares are all-reduced with the counts: every
            replica gets the global count + N(0, σ_b²) (one noise) and the same C_{t+1}.
          mask: [B] 0/1 padding mask.
          expected_batch_size: L (Poisson: expected batch size; explicit batch: its size).
          key: int64 scalar, the run's Philox noise key.
          dp_step: the ledger's DP step of this step (the gradient noise's counter).
          noise_multiplier: σ of this step (what the ledger records), if known: where 2σ_b ≤ σ
            (no σ_Δ exists; the in-graph assertion of ``gradient_noise_multiplier`` is a no-op
            under XLA) the count is withheld and C_{t+1} = C_t, so nothing is released at the
            count's multiplier 2σ_b < σ.

        Returns:
          C_{t+1} = C_t·exp(−η(b̃_t − γ)).
        """
        count = self.centred_count(l2_norm_clip, squared_norms, mask)
        replica, replicas = _replica()
        if replicas == 1:
            following = self.next_bound_from_count(l2_norm_clip, count, expected_batch_size, key, dp_step)
        else:
            share = self.count_noise(key, dp_step, expected_batch_size, replica, replicas)
            noisy = summed_over_replicas(count + share)  # the global count + N(0, σ_b²), once
            following = self._bound_from_noisy_count(l2_norm_clip, noisy, expected_batch_size)
        if noise_multiplier is None:
            return following
        return tf.where(self.count_releasable(noise_multiplier, expected_batch_size), following,
                        tf.cast(l2_norm_clip, following.dtype))

    def count_releasable(self, noise_multiplier, expected_batch_size=None) -> tf.Tensor:
        """Whether 2σ_b > σ (or σ = 0): the count may be released beside the gradient (§12)."""
        sigma = tf.cast(noise_multiplier, tf.float64)
        count_stddev = tf.cast(self.count_stddev_for(expected_batch_size), tf.float64)
        return tf.logical_or(sigma <= 0, 2.0 * count_stddev > sigma)

    def get_config(self) -> dict:
        return {"initial": self.initial, "target_quantile": self.target_quantile,
                "learning_rate": self.learning_rate, "count_stddev": self.count_stddev}

    @classmethod
    def from_config(cls, config: dict):
        return cls(**config)

    def __repr__(self) -> str:
        return (f"AdaptiveClip(initial={self.initial!r}, target_quantile={self.target_quantile!r}, "
                f"learning_rate={self.learning_rate!r}, count_stddev={self.count_stddev!r})")


def count_stream(replica, replicas: int) -> tf.Tensor:
    """The Philox stream of replica r's share of the count noise under R > 1 replicas:
    −(2⁴⁰ + r·2²⁰ + R), unique per (r, R), within the range ``tf_dp.streams.ADAPTIVE_COUNT_SHARES``
    (disjoint from every other allocated stream)."""
    if not 1 <= replicas < 2**20:
        raise ValueError(f"count_stream: {replicas} replicas; the allocated range holds fewer than 2^20.")
    return -(tf.constant(2**40, tf.int64) + tf.cast(replica, tf.int64) * 2**20 + replicas)


def summed_over_replicas(value: tf.Tensor) -> tf.Tensor:
    """Σ_r value_r over the tf.distribute replicas (the identity outside a replica context or
    with one replica). Applied to count_r + share_r it gives every replica the same global
    centred count plus N(0, σ_b²) once (docs/algorithms.md §12)."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return value
    return context.all_reduce(tf.distribute.ReduceOp.SUM, value)


def _replica() -> tuple:
    context = tf.distribute.get_replica_context()
    if context is None:
        return 0, 1
    return context.replica_id_in_sync_group, context.num_replicas_in_sync


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
