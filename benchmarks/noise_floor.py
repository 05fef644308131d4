"""The noise floor the step-time benchmarks divide by: a plain Keras step that also draws one
Gaussian per parameter with the Philox sampler tf_dp uses (the cost of DP-SGD without any
clipping). Shared by benchmarks/step_time.py and benchmarks/custom_layers.py."""

import keras


class NoiseFloorModel(keras.Model):
    """A non-private step that also draws one Gaussian per parameter (the irreducible cost
    of DP-SGD's noise), with the same Philox sampler tf_dp uses."""

    def train_step(self, data):
        """One plain step plus one N(0, 0.01²) draw per coordinate of the gradients.

        Args:
          data: a Keras batch, (x, y) or (x, y, sample_weight).

        Returns:
          The logs: the loss (fit needs a log; the plain and DP steps log their loss too).
        """
        import tensorflow as tf  # at call time: step_time.py sets its thread counts before TensorFlow starts

        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True), training=True)
        grads = tape.gradient(loss, self.trainable_variables)
        step = tf.cast(self.optimizer.iterations, tf.int64)
        grads = [g + 0.01 * tf.random.stateless_normal(
                     tf.shape(g), seed=tf.stack([tf.constant(7, tf.int64), step * 64 + i]), alg="philox")
                 for i, g in enumerate(grads)]
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}
