"""The DP train step (ALGORITHMS §1): chunks → per-example clipped sums → noise → update → ledger.

The batch arrives as Poisson-sampled chunks of static size P with a 0/1 mask (from
``fit``) or as an explicit batch; the clipping engine returns Σ_i c_i g_i over all chunks;
the DP optimizer adds N(0, σ²C² I) once, divides by L (a public constant) and updates; the
ledger records the step with the σ it used.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_dp.clipping import clipped_gradient_sum
from tf_dp.models.data import is_poisson_batch
from tf_dp.optimizers import DPOptimizer


class DPTrainStep:
    """``train_step`` of DP models (mixed into DPModelMixin)."""

    def train_step(self, data):
        if not isinstance(self.optimizer, DPOptimizer):
            raise TypeError("A DPModel trains only with a tf_dp DP optimizer; recompile with one.")
        x, y, mask, expected_batch_size = self._unpack_dp_batch(data)
        return self._dp_step(x, y, mask, expected_batch_size)

    def _dp_step(self, x, y, mask, expected_batch_size):
        """One DP step. σ is read once: the noise and the ledger use the same value, and the
        noise counter is the ledger's step count (unique over the model's life)."""
        optimizer, ledger = self.optimizer, self.privacy_ledger
        dp_step, sigma = ledger.steps.read_value(), optimizer.noise_multiplier_tensor()
        points = optimizer.evaluation_points(self.trainable_variables)
        clipped_sums = self._clipped_sum_over_chunks(x, y, mask, optimizer.clip_bound(), points)
        self._release = self.step_limit.allows(dp_step, sigma)
        ledger.record_step(sigma, self._release)  # before the update: what is released is recorded
        optimizer.apply_private_gradients(
            clipped_sums, self.trainable_variables, expected_batch_size, self._regularization_gradients(),
            dp_step=dp_step, noise_multiplier=sigma, release=self._release,
        )
        return self._step_logs()

    def _step_logs(self) -> dict:
        """Train loss, metrics and the non-finite count — exact functions of the private
        batch, outside ε — unless ``compile(private_logs=True)``, which logs none of them."""
        if self._dp["private_logs"]:  # Keras needs one log: the public noise std σC/L
            return for_multi_worker_reduce({"noise_std": self.optimizer.averaged_noise_stddev()})
        return for_multi_worker_reduce(
            {**self.get_metrics_result(), "nonfinite_examples": self.nonfinite_examples.read_value()})

    def test_step(self, data):
        return for_multi_worker_reduce(super().test_step(data))

    def _unpack_dp_batch(self, data):
        """(x, y, mask, L) with x, y, mask shaped [chunks, P, ...]. L of an explicit batch is
        the phase's declared batch size, never the batch's realized size (ALGORITHMS §7)."""
        if is_poisson_batch(data):
            return data["x"], data["y"], data["mask"], data["expected_batch_size"][0]
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if sample_weight is not None:
            raise ValueError("`sample_weight`/`class_weight` are not supported by DP training in tf_dp.")
        if y is None:
            raise ValueError("DP training needs targets `y` to compute each example's loss.")
        batch = tf.shape(tf.nest.flatten(x)[0])[0]
        add_chunk_axis = lambda t: tf.expand_dims(t, 0)  # noqa: E731
        mask = tf.ones([1, batch], tf.float32)
        return (tf.nest.map_structure(add_chunk_axis, x), tf.nest.map_structure(add_chunk_axis, y), mask,
                self._declared_batch_size.read_value())

    def _clipped_sum_over_chunks(self, x, y, mask, clip, points):
        """Σ over the batch's chunks of Σ_i c_i g_i; also counts non-finite examples."""

        def chunk(index):
            take = lambda t: tf.gather(t, index)  # noqa: E731
            return tf.nest.map_structure(take, x), tf.nest.map_structure(take, y), take(mask)

        totals = ([tf.zeros_like(v) for v in self.trainable_variables], tf.constant(0.0))
        if tf.nest.flatten(x)[0].shape[0] == 1:
            totals = self._clip_chunk(*chunk(0), clip, points, totals)
        else:
            chunks = tf.shape(mask)[0]
            _, totals = tf.while_loop(lambda index, _: index < chunks,
                                      lambda index, t: (index + 1, self._clip_chunk(*chunk(index), clip, points, t)),
                                      (tf.constant(0), totals))
        sums, nonfinite = totals
        # Outside the loop: a cross-replica variable update may not sit in control flow.
        self.nonfinite_examples.assign_add(nonfinite)
        return sums

    def _clip_chunk(self, x, y, mask, clip, points, totals):
        result = clipped_gradient_sum(self, self._chunk_loss(), x, y, mask, clip, engine=self._dp["engine"],
                                      points=points)
        if not self._dp["private_logs"]:
            self._track_train_metrics(x, y, mask, result)
        sums, nonfinite = totals
        return [s + c for s, c in zip(sums, result.clipped_sums)], nonfinite + result.nonfinite_count(mask)

    def _track_train_metrics(self, x, y, mask, result):
        real = tf.reduce_sum(mask)
        losses = tf.cast(result.losses, tf.float32)  # bfloat16 when the output layer computes in bfloat16
        real_losses = tf.where(tf.cast(mask, tf.bool), losses, 0.0)  # padding rows may give NaN losses
        mean_loss = tf.math.divide_no_nan(tf.reduce_sum(real_losses), real)
        self._loss_tracker.update_state(mean_loss + self._regularization_loss(), sample_weight=real)
        self.compute_metrics(x, self._targets(y), result.y_pred, sample_weight=mask)

    def _chunk_loss(self):
        """The per-example loss whose gradients are clipped (subclasses add terms)."""
        return self._dp_loss

    def _targets(self, y):
        """The labels inside ``y`` (subclasses may pack more per-example columns into it)."""
        return y

    def _regularization_loss(self):
        terms = [v.regularizer(v) for v in self.trainable_variables if getattr(v, "regularizer", None)]
        return tf.add_n(terms) if terms else 0.0

    def _regularization_gradients(self):
        """∇ of weight regularizers: a function of θ only, so public (no noise needed)."""
        if not any(getattr(v, "regularizer", None) for v in self.trainable_variables):
            return None
        with tf.GradientTape() as tape:
            penalty = self._regularization_loss()
        return tape.gradient(penalty, self.trainable_variables)


def for_multi_worker_reduce(logs: dict) -> dict:
    """Keras 3 reduces step logs across workers with reduce("MEAN", axis=0), which fails on
    scalars (tensorflow/tensorflow#72388): give each a length-1 axis there."""
    strategy = tf.distribute.get_strategy()
    if not strategy.extended._in_multi_worker_mode():
        return logs
    return {name: tf.reshape(value, [1]) for name, value in logs.items()}
