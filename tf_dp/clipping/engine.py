"""Per-example clipped gradient sums: per-example norms → clip factors → Σ_i c_i g_i.

``engine="ghost"`` (default): one forward and one backward pass of the batch with every
trainable layer tapped. Layers with a ghost rule (Dense, Embedding, user-registered) give
their per-example squared norms and clipped sums from (inputs, output gradients) without
materialising per-example gradients; other layers are replayed per example by
``vectorized_map``. The squared norms of all layers add up to the flat norm ‖g_i‖² over
all trainable variables, which sets one clip factor per example.

``engine="vectorized"``: per-example gradients of the whole model by ``vectorized_map``;
slow, used as the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import tensorflow as tf

from tf_dp.clipping.clip import clip_factors
from tf_dp.clipping.per_example import per_example_gradients
from tf_dp.clipping.tap import LayerTap

ENGINES = ("ghost", "vectorized")


@dataclass
class ClippedBatch:
    clipped_sums: list  # Σ_i c_i g_i per trainable variable
    y_pred: object
    losses: tf.Tensor  # per-example losses ℓ_i (masked rows included, weight them by mask)
    squared_norms: tf.Tensor  # ‖g_i‖² before clipping


def _trainable_units(model) -> list:
    """Layers (the model included) owning trainable variables of the model."""
    trainable = {id(v) for v in model.trainable_variables}
    return [
        layer for layer in model._flatten_layers(include_self=True)
        if any(id(v) in trainable for v in layer._trainable_variables)
    ]


def _ghost(model, per_example_loss, x, y, mask, l2_norm_clip, use_ghost_rules=True) -> ClippedBatch:
    tap = LayerTap(_trainable_units(model), use_ghost_rules=use_ghost_rules)
    with tap:
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            losses = per_example_loss(y, y_pred)
            total = tf.reduce_sum(losses * tf.cast(mask, losses.dtype))
        watched = tap.watched_tensors()
        output_grads = tape.gradient(total, watched)
    contributions = tap.contributions(output_grads)
    squared_norms = tf.add_n([c.squared_norms() for _, _, c in contributions]) if contributions else tf.zeros_like(losses)
    factors = clip_factors(squared_norms, l2_norm_clip, mask)
    by_variable = {}
    for layer, rule, contribution in contributions:
        for variable, grad in zip(rule.variables(layer), contribution.weighted_sums(factors)):
            by_variable[id(variable)] = grad
    sums = [by_variable.get(id(v), tf.zeros_like(v)) for v in model.trainable_variables]
    return ClippedBatch(sums, y_pred, losses, squared_norms)


def _vectorized(model, per_example_loss, x, y, mask, l2_norm_clip) -> ClippedBatch:
    grads = per_example_gradients(model, per_example_loss, x, y)
    squared_norms = tf.add_n([tf.reduce_sum(tf.reshape(tf.square(g), [tf.shape(g)[0], -1]), axis=1) for g in grads])
    factors = clip_factors(squared_norms, l2_norm_clip, mask)
    sums = [tf.tensordot(tf.cast(factors, g.dtype), g, axes=1) for g in grads]
    y_pred = model(x, training=True)
    return ClippedBatch(sums, y_pred, per_example_loss(y, y_pred), squared_norms)


def clipped_gradient_sum(
    model, per_example_loss: Callable, x, y, mask, l2_norm_clip, engine: str = "ghost"
) -> ClippedBatch:
    """Σ_i mask_i · min(1, C/‖g_i‖) · g_i over the batch, g_i the flat per-example gradient
    of ``per_example_loss`` over all of ``model.trainable_variables``."""
    if engine == "ghost":
        return _ghost(model, per_example_loss, x, y, mask, l2_norm_clip)
    if engine == "vectorized":
        return _vectorized(model, per_example_loss, x, y, mask, l2_norm_clip)
    raise ValueError(f"`engine` must be one of {ENGINES}, got {engine!r}.")
