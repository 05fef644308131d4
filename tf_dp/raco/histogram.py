"""The noisy histogram of RaCO-DP (docs/algorithms.md §5).

H[q, k] = Σ_{i ∈ B ∩ D_q} p_k(x_i): adding or removing one example changes one row by a
probability vector, so ‖ΔH‖₁ ≤ 1 and Ĥ = H + Laplace(1/b) per cell is b-DP on the batch.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_dp import _checks
from tf_dp.noise.laplace import LAPLACE_STREAM
from tf_dp.noise.release import SumNoise, noised_sum


def tempered(probabilities: tf.Tensor, temperature: float) -> tf.Tensor:
    """softmax(log p / T): the paper's softmax temperature, applied to probabilities."""
    if temperature == 1.0:
        return probabilities
    return tf.nn.softmax(tf.math.log(tf.maximum(probabilities, 1e-12)) / temperature, axis=-1)


def check_probabilities(probabilities: tf.Tensor) -> list:
    """Graph assertions that model outputs are probability vectors (softmax outputs)."""
    total = tf.reduce_sum(probabilities, axis=-1)
    return [
        tf.debugging.assert_non_negative(probabilities, message="RaCO-DP needs probability outputs (a softmax "
                                         "layer): the model returned negative values."),
        tf.debugging.assert_near(total, tf.ones_like(total), atol=1e-3, message="RaCO-DP needs probability "
                                 "outputs (a softmax layer): the model's outputs do not sum to 1."),
    ]


def _finite_rows(probabilities: tf.Tensor, finite: tf.Tensor) -> tf.Tensor:
    """The rows where ``finite``; the uniform distribution elsewhere (a placeholder that the
    probability checks accept and that is then given weight 0)."""
    uniform = tf.ones_like(probabilities) / tf.cast(tf.shape(probabilities)[-1], probabilities.dtype)
    return tf.where(finite[:, None], probabilities, uniform)


@keras.saving.register_keras_serializable(package="tf_dp")
class NoisyHistogram(keras.layers.Layer):
    """Per-(partition, class) histogram of probability outputs, with Laplace(scale) noise
    in training. Used by ``RateConstrainedModel.train_step`` only, so it is never part of
    the model's inference or serving graph.

    Args:
      num_partitions: Q, the number of partitions (groups, or groups × labels).
      noise_scale: Laplace scale 1/b (> 0).
      temperature: softmax temperature applied before counting.
      **kwargs: passed to ``keras.layers.Layer`` (the layer is never trainable).
    """

    def __init__(self, num_partitions: int, noise_scale: float, temperature: float = 1.0, **kwargs):
        super().__init__(trainable=False, **kwargs)
        self.num_partitions = _checks.positive_int("num_partitions", num_partitions)
        self.noise_scale = _checks.positive("noise_scale", noise_scale, "It is the Laplace scale 1/b of the histogram.")
        self.temperature = _checks.positive("temperature", temperature)

    def counts(self, probabilities, partition_ids, mask=None) -> tf.Tensor:
        """H without noise: Σ_i mask_i · p̃(x_i) into row partition_i.

        A row whose outputs are not finite (an example with a NaN/Inf feature) adds nothing,
        as DP-SGD gives an example with a non-finite gradient clip factor 0: the histogram of
        a batch with that row is the histogram of the batch without it, and training goes on
        (a crash at the first step that samples the row would tell when it was sampled)."""
        finite = tf.reduce_all(tf.math.is_finite(probabilities), axis=-1)
        probabilities = _finite_rows(probabilities, finite)
        checks = check_probabilities(probabilities)
        checks += [
            tf.debugging.assert_non_negative(partition_ids, message="partition ids must be >= 0"),
            tf.debugging.assert_less(partition_ids, tf.cast(self.num_partitions, partition_ids.dtype),
                                     message=f"partition ids must be < num_partitions={self.num_partitions}"),
        ]
        with tf.control_dependencies(checks):
            weights = tempered(probabilities, self.temperature) * tf.cast(finite, probabilities.dtype)[:, None]
            if mask is not None:
                weights = weights * tf.cast(mask, weights.dtype)[:, None]
            return tf.math.unsorted_segment_sum(weights, partition_ids, self.num_partitions)

    def sum_noise(self) -> SumNoise:
        """The histogram's noise: Laplace(1/b) per cell, ℓ1 sensitivity 1 (what the optimizer draws).

        Returns:
          A ``tf_dp.noise.release.SumNoise``.
        """
        return SumNoise("laplace", 1.0, self.noise_scale)

    def add_noise(self, histogram: tf.Tensor, seed: tf.Tensor, step: tf.Tensor) -> tf.Tensor:
        return histogram + self.sum_noise().draw(tf.shape(histogram), histogram.dtype, seed, step, LAPLACE_STREAM)

    def release(self, counts: tf.Tensor, seed: tf.Tensor, step: tf.Tensor) -> tf.Tensor:
        """Ĥ of the WHOLE global batch from this replica's ``counts`` of its chunks, with a seed the
        caller holds (this layer's ``call``; in training RaCO-DP asks the optimizer instead,
        ``DPOptimizer.release_sum``, which never hands out its key).

        Under tf.distribute the replicas' counts are summed and exactly ONE Laplace draw is
        added (``tf_dp.noise.release.noised_sum``): every replica holds the same Ĥ = Σ_r H_r +
        noise — one Laplace mechanism on the global batch, as the joint accountant assumes.
        """
        return noised_sum(counts, self.sum_noise(), seed, step, LAPLACE_STREAM)

    def call(self, probabilities, partition_ids, mask=None, training=False, seed=None, step=None):
        histogram = self.counts(probabilities, partition_ids, mask)
        if training:
            if seed is None or step is None:
                raise ValueError("NoisyHistogram in training needs the noise `seed` and `step`.")
            histogram = self.release(histogram, seed, step)
        return histogram

    def get_config(self):
        return {**super().get_config(), "num_partitions": self.num_partitions, "noise_scale": self.noise_scale,
                "temperature": self.temperature}
