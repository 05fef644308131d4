"""Per-example gradients of the whole model by ``tf.vectorized_map`` (the reference path).

Materialises g_i = ∂ℓ(θ; x_i)/∂θ for every example: exact for any model whose examples do
not interact, and memory-bound (P copies of the gradient). The fast engine
(``tf_dp.clipping.engine``) must agree with it.
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf


def per_example_gradients(model, per_example_loss: Callable, x, y, training: bool = True) -> list[tf.Tensor]:
    """Returns [P, *shape] per-example gradients for each of ``model.trainable_variables``."""
    variables = model.trainable_variables

    def one_example(example):
        x_i, y_i = tf.nest.map_structure(lambda t: t[None], example)
        with tf.GradientTape() as tape:
            loss = per_example_loss(y_i, model(x_i, training=training))[0]
        grads = tape.gradient(loss, variables)
        return [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g) for g, v in zip(grads, variables)]

    return tf.vectorized_map(one_example, (x, y))
