"""Rules for normalizations with a per-feature scale γ (and offset β) on the last axis:
``keras.layers.RMSNormalization``, ``keras.layers.GroupNormalization`` (channels last),
keras-hub's Gemma ``RMSNormalization`` (z = x̂ ⊙ (1 + γ)), ``LlamaLayerNorm`` and ``T5LayerNorm``.

z_it = x̂_it ⊙ γ + β (or x̂_it ⊙ (1 + γ)) with x̂ the normalised input (RMS: x / rms(x); group:
(x − μ_group) / σ_group). Per example, over its positions t (sequence or spatial):

    ∂ℓ_i/∂γ = Σ_t s_it ⊙ x̂_it,   ∂ℓ_i/∂β = Σ_t s_it,

[P, d] each: formed explicitly and clipped by the norm of exactly those released vectors
(rounding.py: cancellation over t cannot enlarge a released contribution beyond C).
keras-hub classes are matched by name (never imported).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_dp.clipping.layer_normalization import scale_and_offset_contribution
from tf_dp.clipping.registry import GhostRule, Recording, register_ghost_rule, register_ghost_rule_by_name


def _rms_normalized(x, epsilon) -> tf.Tensor:
    """x̂ = x / sqrt(mean_j x_j² + ε) over the last axis, in float32."""
    x = tf.cast(x, tf.float32)
    return x * tf.math.rsqrt(tf.reduce_mean(tf.square(x), axis=-1, keepdims=True) + epsilon)


def _group_normalized(layer, x) -> tf.Tensor:
    """x̂ of GroupNormalization: (x − μ) / sqrt(σ² + ε) over the positions and channels of
    each group (channels last), in float32, back in the input's shape."""
    grouped = tf.cast(layer._reshape_into_groups(x), tf.float32)  # [..., groups, channels per group]
    axes = list(range(1, grouped.shape.rank - 2)) + [grouped.shape.rank - 1]
    mean, variance = tf.nn.moments(grouped, axes=axes, keepdims=True)
    return tf.reshape((grouped - mean) * tf.math.rsqrt(variance + layer.epsilon), tf.shape(x))


class AffineNormalizationRule(GhostRule):
    """z = x̂ ⊙ (offset + γ) + β on the last axis; subclasses say how x̂ is made and which
    of γ, β exist."""

    scale_offset = 0.0  # 1.0 for Gemma's (1 + γ)

    def normalized(self, layer, inputs) -> tf.Tensor:
        raise NotImplementedError

    def scale(self, layer):
        return layer.scale

    def offset(self, layer):
        return None

    def variables(self, layer):
        return [v for v in (self.scale(layer), self.offset(layer)) if v is not None and v.trainable]

    def tapped_call(self, layer, original_call, recordings, inputs):
        x_hat = self.normalized(layer, inputs)
        z = x_hat
        if self.scale(layer) is not None:
            z = z * (self.scale_offset + tf.cast(self.scale(layer), tf.float32))
        if self.offset(layer) is not None:
            z = z + tf.cast(self.offset(layer), tf.float32)
        recordings.append(Recording(x_hat, [z]))
        return keras.ops.cast(z, layer.compute_dtype)

    def contribution(self, layer, recordings, output_grads):
        return scale_and_offset_contribution(recordings, output_grads, self.scale(layer), self.offset(layer),
                                             self.variables(layer))


def _last_axis(layer) -> bool:
    axis = getattr(layer, "axis", -1)
    axis = axis[0] if isinstance(axis, (list, tuple)) and len(axis) == 1 else axis
    return axis == -1


class KerasRMSNormalizationRule(AffineNormalizationRule):
    def applies_to(self, layer) -> bool:
        return _last_axis(layer)

    def normalized(self, layer, inputs):
        return _rms_normalized(inputs, layer.epsilon)


class GroupNormalizationRule(AffineNormalizationRule):
    def applies_to(self, layer) -> bool:
        return layer.axis == -1

    def scale(self, layer):
        return layer.gamma if layer.scale else None

    def offset(self, layer):
        return layer.beta if layer.center else None

    def normalized(self, layer, inputs):
        return _group_normalized(layer, inputs)


class GemmaRMSNormalizationRule(KerasRMSNormalizationRule):
    scale_offset = 1.0


class T5LayerNormRule(KerasRMSNormalizationRule):
    """keras-hub T5LayerNorm: x / rms(x) ⊙ w, its scale named ``weight``."""

    def scale(self, layer):
        return layer.weight


register_ghost_rule(keras.layers.RMSNormalization, KerasRMSNormalizationRule())
register_ghost_rule(keras.layers.GroupNormalization, GroupNormalizationRule())
# keras-hub exports none of these three (keras_hub.layers.RMSNormalization is another class, with
# no rule here): they are keyed by the private module that defines them, matched without importing it.
register_ghost_rule_by_name("keras_hub.src.models.gemma.rms_normalization.RMSNormalization",
                            GemmaRMSNormalizationRule())
register_ghost_rule_by_name("keras_hub.src.models.llama.llama_layernorm.LlamaLayerNorm", KerasRMSNormalizationRule())
register_ghost_rule_by_name("keras_hub.src.models.t5.t5_layer_norm.T5LayerNorm", T5LayerNormRule())
