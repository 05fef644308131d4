"""Per-example gradient norms of a model, per layer and in total — for debugging clipping.

    total_i = ‖∇_θ ℓ(θ; x_i, y_i)‖₂ over all trainable variables,
    per_layer[name]_i = ‖∇_{θ_layer} ℓ(θ; x_i, y_i)‖₂,   total_i² = Σ_layers per_layer_i²

(a variable shared by several layers' calls is counted once, in its owning layer, with all
its uses). ``engine="ghost"`` gives the certified upper bounds the ghost engine clips
against (≥ the exact norm, relative excess ~1e-6); ``engine="vectorized"`` the norms of
per-example gradients from ``tf.vectorized_map``.
"""

from __future__ import annotations

from typing import Callable

import keras
import tensorflow as tf

from tf_dp.clipping.engine import (CURRENT_WEIGHTS, _shared_contributions, _trainable_units, as_graph_inputs,
                                   examples_of, forward)
from tf_dp.clipping.layer_per_example import squared_row_norms
from tf_dp.clipping.per_example import per_example_gradients
from tf_dp.clipping.registry import unit_variables
from tf_dp.clipping.tap import LayerTap


def per_example_losses(loss: Callable, y, y_pred) -> tf.Tensor:
    """ℓ_i, [B]: ``loss(y, y_pred)`` unreduced (a ``keras.losses.Loss`` through its
    element-wise ``call``), averaged over any axes after the example axis."""
    values = loss.call(y, y_pred) if isinstance(loss, keras.losses.Loss) else loss(y, y_pred)
    values = tf.convert_to_tensor(values)
    if values.shape.rank == 0:
        raise ValueError("`loss` must return one value per example (no reduction over the batch), got a scalar.")
    return tf.reduce_mean(values, axis=list(range(1, values.shape.rank))) if values.shape.rank > 1 else values


def per_example_gradient_norms(model, loss: Callable, x, y, engine: str = "ghost"):
    """(total, per_layer): per-example gradient norms [B] of ``loss`` at the model's current
    weights (training mode), in total and per layer owning trainable variables (keyed by
    layer name, or path where names repeat); no masks or clip norms to build by hand.

    ``loss``: a ``keras.losses.Loss`` or a function (y_true, y_pred) → per-example values."""
    units = _trainable_units(model)
    names = _unique_names(units)
    if engine == "ghost":
        squared = _ghost_squared_norms(model, loss, x, y, units)
    elif engine == "vectorized":
        squared = _vectorized_squared_norms(model, loss, x, y, units)
    else:
        raise ValueError(f"`engine` must be 'ghost' or 'vectorized', got {engine!r}.")
    per_layer = {names[id(layer)]: tf.cast(tf.sqrt(value), tf.float32) for layer, value in squared}
    total = tf.sqrt(tf.add_n([value for _, value in squared])) if squared else tf.zeros([tf.shape(y)[0]])
    return tf.cast(total, tf.float32), per_layer


def _ghost_squared_norms(model, loss, x, y, units) -> list:
    if tf.executing_eagerly():  # the taps read the example axis off the traced graph (example_axis.py)
        layers = []

        def graph(x, y):
            squared = _ghost_squared_norms(model, loss, x, y, units)
            layers[:] = [layer for layer, _ in squared]
            return [value for _, value in squared]

        values = tf.function(graph)(x, y)
        return list(zip(layers, values))
    x = as_graph_inputs(x)
    first = tf.nest.flatten(x)[0]
    tap = LayerTap(units, batch_size=examples_of(first), batch_inputs=x)

    def per_example_loss(y_true, y_pred):
        return per_example_losses(loss, y_true, y_pred)

    with tap:
        with tf.GradientTape() as tape:
            total = tf.reduce_sum(tf.cast(per_example_loss(y, forward(model, x)), tf.float32))
        shared = tap.whole_model_layers()  # weights read elsewhere, batch-free outputs not only broadcast
        output_grads = tape.gradient(total, tap.watched_tensors(skip=shared))
    contributions = tap.contributions(output_grads, skip=shared)
    contributions += _shared_contributions(model, per_example_loss, x, y, CURRENT_WEIGHTS, shared, tap.fallback)
    return [(layer, tf.cast(contribution.squared_norms(), tf.float64)) for layer, _, contribution in contributions]


def _vectorized_squared_norms(model, loss, x, y, units) -> list:
    def per_example_loss(y_true, y_pred):
        return per_example_losses(loss, y_true, y_pred)

    grads = per_example_gradients(model, per_example_loss, x, y)
    by_variable = {id(v): g for v, g in zip(model.trainable_variables, grads)}
    result = []
    for layer in units:
        owned = [by_variable[id(v)] for v in unit_variables(layer) if id(v) in by_variable]
        if owned:
            result.append((layer, tf.add_n([squared_row_norms(g) for g in owned])))
    return result


def _unique_names(layers) -> dict:
    counts = {}
    for layer in layers:
        counts[layer.name] = counts.get(layer.name, 0) + 1
    return {id(layer): layer.name if counts[layer.name] == 1 else getattr(layer, "path", layer.name)
            for layer in layers}
