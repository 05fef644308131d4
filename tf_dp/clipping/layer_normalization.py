"""Rule for ``keras.layers.LayerNormalization`` over the last axis.

z = x̂ ⊙ γ + β with x̂ the normalised input. Per example, over its positions t:

    ∂ℓ_i/∂γ = Σ_t s_it ⊙ x̂_it,   ∂ℓ_i/∂β = Σ_t s_it,

which are only [P, d] each: they are formed explicitly (cheaper than any ghost form), and
clipped by the norm of exactly those released vectors (rounding.py), so cancellation over t
cannot enlarge a released contribution beyond C.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_dp.clipping.layer_per_example import MaterializedContribution
from tf_dp.clipping.registry import GhostRule, Recording, register_ghost_rule


def _last_axis_only(layer) -> bool:
    axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
    rank = len(layer.input.shape) if getattr(layer, "_inbound_nodes", None) else None
    return len(axes) == 1 and (axes[0] == -1 or (rank is not None and axes[0] == rank - 1))


class LayerNormalizationRule(GhostRule):
    def applies_to(self, layer) -> bool:
        return not layer.rms_scaling and _last_axis_only(layer)

    def variables(self, layer):
        return [v for v in (layer.gamma, layer.beta) if v is not None and v.trainable]

    def tapped_call(self, layer, original_call, recordings, inputs):
        normalized = keras.ops.layer_normalization(inputs, None, None, layer.axis, layer.epsilon)
        z = normalized
        if layer.gamma is not None:
            z = z * keras.ops.cast(layer.gamma, z.dtype)
        if layer.beta is not None:
            z = z + keras.ops.cast(layer.beta, z.dtype)
        recordings.append(Recording(normalized, [z]))
        return keras.ops.cast(z, layer.compute_dtype)

    def contribution(self, layer, recordings, output_grads):
        return scale_and_offset_contribution(recordings, output_grads, layer.gamma, layer.beta, self.variables(layer))


def scale_and_offset_contribution(recordings, output_grads, scale, offset, variables) -> MaterializedContribution:
    """Per-example ∂ℓ_i/∂γ = Σ_t s_it ⊙ x̂_it and ∂ℓ_i/∂β = Σ_t s_it ([P, d] each, float32)
    of z = x̂ ⊙ γ + β on the last axis, from recordings whose inputs are x̂ and whose watched
    tensor is z; summed over the recorded calls, in the order of ``variables``."""
    scale_grads, offset_grads = 0.0, 0.0
    for recording, (grad,) in zip(recordings, output_grads):
        grad = tf.zeros_like(recording.watched[0]) if grad is None else grad
        width = tf.shape(grad)[-1]
        s = tf.cast(tf.reshape(grad, tf.stack([tf.shape(grad)[0], -1, width])), tf.float32)
        x_hat = tf.reshape(tf.cast(recording.inputs, s.dtype), tf.shape(s))
        scale_grads += tf.reduce_sum(s * x_hat, axis=1)
        offset_grads += tf.reduce_sum(s, axis=1)
    per_variable = {id(scale): scale_grads, id(offset): offset_grads}
    return MaterializedContribution([per_variable[id(v)] for v in variables])


register_ghost_rule(keras.layers.LayerNormalization, LayerNormalizationRule())
