"""Per-example gradient norms of a model, per layer and in total — for debugging clipping.

    total_i = ‖∇_θ ℓ_i(θ)‖₂ over all trainable variables,
    per_layer[name]_i = ‖∇_{θ_layer} ℓ_i(θ)‖₂,   total_i² = Σ_layers per_layer_i²

with ℓ_i the per-example loss DP training clips (tf_dp.models.losses: the loss reduced per
example, weighted by the example's sample or class weight, docs/algorithms.md §1.2). The norms
come from the training clipping engine itself (``clipped_gradient_sum``), with every layer
owning trainable variables its own group (§6.1), so ``total`` is the norm training clips against
(a variable shared by several layers' calls is counted once, in its owning layer, with all
its uses). ``engine="ghost"`` gives the certified upper bounds the ghost engine clips
against (≥ the exact norm, relative excess ~1e-6); ``engine="vectorized"`` the norms of
per-example gradients from ``tf.vectorized_map``.
"""

from __future__ import annotations

from typing import Callable, Optional

import tensorflow as tf

from tf_dp.clipping.engine import ENGINES, clipped_gradient_sum
from tf_dp.clipping.policy import ClippingPolicy


def per_example_gradient_norms(model, loss: Callable, x, y, engine: str = "ghost",
                               sample_weight=None, class_weight: Optional[dict] = None, layer_registry=None):
    """Per-example gradient norms [B] of the training loss at the model's current weights
    (training mode), in total and per layer owning trainable variables.

    Args:
      model: a Keras model.
      loss: what ``compile(loss=...)`` takes: a ``keras.losses.Loss``, a loss name, or a
        function (y_true, y_pred) → per-example values (further axes are averaged).
      x, y: one batch of inputs and targets.
      engine: "ghost" (the certified upper bounds U_i ≥ ‖g_i‖ clipped against) or
        "vectorized" (per-example gradients by ``tf.vectorized_map``).
      sample_weight: optional weights w_i ([B]) or w_it ([B, T]), as ``fit`` takes them:
        ℓ_i = Σ_t w_it ℓ_it / T (docs/algorithms.md §1.2, tf_dp.models.losses).
      class_weight: optional {class index: weight}, as ``fit`` takes it: w_i = cw[y_i].
      layer_registry: the ``LayerRegistry`` whose ghost rules are used (None: the default).

    Returns:
      (total, per_layer): ``total`` [B] float32, √ of the squared norms training clips
      (``ClippedBatch.squared_norms``); ``per_layer`` {layer name, or path where names
      repeat: [B] float32}.
    """
    if engine not in ENGINES:
        raise ValueError(f"`engine` must be one of {ENGINES}, got {engine!r}.")
    training_loss, targets = _training_loss_and_targets(loss, y, sample_weight, class_weight, _output_names(model))
    recorder = _LayerNorms()

    def norms(x, targets):
        examples = tf.shape(tf.nest.flatten(x)[0])[0]
        clipped = clipped_gradient_sum(model, training_loss, x, targets, tf.ones([examples]), 1.0, engine=engine,
                                       clipping=recorder, layer_registry=layer_registry)
        return clipped.squared_norms, recorder.squared_norms

    # One graph: the taps read the example axis off the traced graph (example_axis.py).
    squared_total, squared_per_layer = tf.function(norms)(*tf.nest.map_structure(tf.convert_to_tensor, (x, targets)))
    names = _unique_names(recorder.layers)
    per_layer = {names[id(layer)]: tf.cast(tf.sqrt(squared), tf.float32)
                 for layer, squared in zip(recorder.layers, squared_per_layer)}
    return tf.sqrt(squared_total), per_layer


def _output_names(model):
    """The output names of a functional model with several outputs (None otherwise): a
    single loss then applies to each output, a dict of losses is keyed by them (as fit)."""
    outputs = getattr(model, "outputs", None)
    try:
        return list(model.output_names) if outputs and len(outputs) > 1 else None
    except (AttributeError, ValueError):
        return None


def _training_loss_and_targets(loss, y, sample_weight, class_weight, output_names=None):
    """(ℓ_i as DP training computes it, y packed with the examples' weights as the train step
    packs them): the same per-example loss and weights handling as ``DPModel.fit``."""
    # tf_dp.models imports tf_dp.clipping: imported here, when called.
    from tf_dp.models.losses import WeightedTargets, class_weights_of, per_example_loss
    from tf_dp.models.plan import class_weight_table

    if sample_weight is not None and class_weight is not None:
        raise ValueError("Pass either `sample_weight` or `class_weight`, not both (as Keras): fold the class "
                         "weights into the sample weights.")
    if class_weight is not None:
        with_chunk_axis = tf.expand_dims(tf.convert_to_tensor(y), 0)  # class_weights_of reads [chunks, P, ...]
        sample_weight = class_weights_of(with_chunk_axis, class_weight_table(class_weight))[0]
    targets = y if sample_weight is None else WeightedTargets(y, sample_weight)
    return per_example_loss(loss, output_names=output_names), targets


class _LayerNorms(ClippingPolicy):
    """Every layer owning trainable variables is its own group; records the layers and each
    group's squared norms U_{i,k}² (float64) while the engine is traced, and clips nothing
    (factors 0): the engine's per-layer norms, read out."""

    def __init__(self):
        self.layers, self.squared_norms = [], []

    def groups(self, layers):
        self.layers = list(layers)
        return list(range(len(self.layers)))

    def factors(self, group_squared_norms, l2_norm_clip, mask):
        self.squared_norms = list(group_squared_norms)
        return [tf.zeros_like(squared) for squared in self.squared_norms]


def _unique_names(layers) -> dict:
    counts = {}
    for layer in layers:
        counts[layer.name] = counts.get(layer.name, 0) + 1
    return {id(layer): layer.name if counts[layer.name] == 1 else getattr(layer, "path", layer.name)
            for layer in layers}
