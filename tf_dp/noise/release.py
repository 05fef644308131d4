"""A second noised release of a sum, drawn by the optimizer for a plug-in (docs/algorithms.md §5, B.3).

RaCO-DP releases a noisy histogram beside the noisy gradient. The plug-in never holds the
noise key: it hands the optimizer the sum and a ``SumNoise`` (distribution, sensitivity,
multiplier), and ``DPOptimizer.release_sum`` draws the noise from its own key on the allocated
stream ``tf_dp.streams.SUM_RELEASE`` inside the drawing window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import tensorflow as tf

from tf_dp import _checks, streams
from tf_dp.noise.gaussian import _philox_normal, draw_seed
from tf_dp.noise.laplace import laplace_noise

DISTRIBUTIONS = ("laplace", "gaussian")


@dataclass(frozen=True)
class SumNoise:
    """The noise of one released sum: scale = ``noise_multiplier`` · ``sensitivity``.

    Args:
      distribution: "laplace" (scale b, ℓ1 ``sensitivity``) or "gaussian" (std, ℓ2 ``sensitivity``).
      sensitivity: how far one example moves the sum (ℓ1 for Laplace, ℓ2 for Gaussian).
      noise_multiplier: the noise scale per unit of sensitivity (RaCO-DP: the Laplace scale 1/b).
    """

    distribution: str
    sensitivity: float
    noise_multiplier: float

    def __post_init__(self):
        _checks.one_of("distribution", self.distribution, DISTRIBUTIONS)
        _checks.positive("sensitivity", self.sensitivity)
        _checks.non_negative("noise_multiplier", self.noise_multiplier)

    @property
    def scale(self) -> float:
        """The Laplace scale b or the Gaussian std of the draw."""
        return float(self.noise_multiplier) * float(self.sensitivity)

    @property
    def stddev(self) -> float:
        """The draw's standard deviation (√2·b for Laplace)."""
        return self.scale * (math.sqrt(2.0) if self.distribution == "laplace" else 1.0)

    def draw(self, shape, dtype, key: tf.Tensor, step: tf.Tensor, stream: int) -> tf.Tensor:
        """Independent draws of ``shape`` keyed by (key, step, stream).

        Args:
          shape: the draw's shape.
          dtype: its dtype.
          key: the optimizer's Philox key.
          step: the ledger's DP step.
          stream: an allocated Philox stream code.

        Returns:
          The noise tensor.
        """
        if self.distribution == "laplace":
            return laplace_noise(shape, self.scale, key, step, dtype, stream=stream)
        return tf.cast(self.scale, dtype) * _philox_normal(shape, draw_seed(key, step, stream), dtype)


def noised_sum(total: tf.Tensor, noise: SumNoise, key: tf.Tensor, step: tf.Tensor,
               stream: int = streams.SUM_RELEASE.code) -> tf.Tensor:
    """``total`` + one draw of ``noise``, summed over the tf.distribute replicas.

    Under R replicas each holds its share of the sum; replica 0 adds the draw before the
    all-reduce and the others add nothing, so every replica holds Σ_r total_r + ONE draw (the
    one a single device makes with the same key and step), also in secure mode, where the
    replicas' keys differ.

    Args:
      total: this replica's share of the sum (the whole sum on one device).
      noise: the noise to add.
      key: the optimizer's Philox key.
      step: the ledger's DP step.
      stream: an allocated Philox stream code.

    Returns:
      The released sum, identical on every replica.
    """
    def noised():
        return total + noise.draw(tf.shape(total), total.dtype, key, step, stream)

    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return noised()
    share = tf.where(tf.equal(context.replica_id_in_sync_group, 0), noised(), total)
    return context.all_reduce(tf.distribute.ReduceOp.SUM, share)
