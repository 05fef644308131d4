"""Per-example losses ℓ_i from a Keras loss specification (no reduction over the batch)."""

from __future__ import annotations

from typing import Callable

import keras
import tensorflow as tf


def per_example_loss(loss) -> Callable[[tf.Tensor, tf.Tensor], tf.Tensor]:
    """Returns f(y_true, y_pred) -> [P] with ℓ_i averaged over any non-batch axes, as
    Keras' "sum_over_batch_size" reduction would weight them."""
    if loss is None:
        raise ValueError("`loss` is required: DP training clips the gradient of each example's loss.")
    if isinstance(loss, (list, tuple, dict)):
        raise ValueError(
            "tf_dp supports one loss for a single-output model; got a structure of losses. "
            "Combine the outputs' losses into one keras.losses.Loss."
        )
    resolved = keras.losses.get(loss)
    if resolved is None:
        raise ValueError(f"Unknown `loss`: {loss!r}.")
    unreduced = resolved.call if isinstance(resolved, keras.losses.Loss) else resolved

    def losses(y_true, y_pred):
        y_true = tf.cast(y_true, y_pred.dtype)
        values = tf.convert_to_tensor(unreduced(y_true, y_pred))
        if values.shape.rank is not None and values.shape.rank > 1:
            values = tf.reduce_mean(tf.reshape(values, [tf.shape(values)[0], -1]), axis=1)
        return values

    return losses
