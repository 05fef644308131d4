"""Ghost rule for ``keras.layers.Dense``, with or without a sequence axis.

z = a W + b. With per-example activations A_i ∈ R^{T×d} and output gradients
S_i ∈ R^{T×k} (T = 1 without a sequence axis):

    ∂ℓ_i/∂W = A_iᵀ S_i,   ∂ℓ_i/∂b = Σ_t s_it
    ‖A_iᵀ S_i‖_F² = Σ_{t,t'} (a_it·a_it')(s_it·s_it')   (= ‖a_i‖²‖s_i‖² when T = 1)

The Gram form costs T²(d+k) per example, the explicit A_iᵀS_i costs T·d·k; the cheaper
one is used per layer ("mixed ghost clipping"). The clipped sum is Σ_i c_i A_iᵀ S_i, one
weighted matmul (book-keeping: no second backward pass).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_dp.clipping.clip import sum_over_examples
from tf_dp.clipping.lora import lora_contribution, lora_enabled, lora_tapped_call, lora_variables
from tf_dp.clipping.registry import Contribution, GhostRule, Recording, register_ghost_rule


def _as_sequence(tensor: tf.Tensor) -> tf.Tensor:
    """[P, ..., d] -> [P, T, d]."""
    shape = tf.shape(tensor)
    return tf.reshape(tensor, tf.stack([shape[0], -1, shape[-1]]))


EXPLICIT_FLOATS = 2 ** 26  # per-example kernel gradients [P, d, k] held explicitly up to 256 MB


class DenseContribution(Contribution):
    def __init__(self, activations, output_grads, has_bias: bool, flat: bool):
        # Norms and clipped sums in float32 even under a bfloat16 compute policy.
        self.a, self.s = tf.cast(activations, tf.float32), tf.cast(output_grads, tf.float32)
        self.has_bias, self.flat = has_bias, flat

    def squared_norms(self):
        if self.flat:  # a: [P, d], s: [P, k]
            s_sq = tf.reduce_sum(tf.square(self.s), axis=1)
            norms = tf.reduce_sum(tf.square(self.a), axis=1) * s_sq
            return norms + s_sq if self.has_bias else norms
        a, s = self.a, self.s  # [P, T, d], [P, T, k]
        if self._gram_is_cheaper():
            gram = tf.einsum("ptd,pud->ptu", a, a) * tf.einsum("ptk,puk->ptu", s, s)
            norms = tf.reduce_sum(gram, axis=[1, 2])
        else:
            norms = tf.reduce_sum(tf.square(self._per_example_kernel_grads()), axis=[1, 2])
        if self.has_bias:
            norms += tf.reduce_sum(tf.square(tf.reduce_sum(s, axis=1)), axis=1)
        return norms

    def _gram_is_cheaper(self) -> bool:
        """The Gram form where it costs fewer FLOPs, T(d+k) ≤ dk, or where the explicit
        [P, d, k] products would exceed EXPLICIT_FLOATS."""
        examples, steps, d, k = self.a.shape[0], self.a.shape[1], self.a.shape[2], self.s.shape[2]
        too_big = examples is not None and examples * d * k > EXPLICIT_FLOATS
        return too_big or (steps is not None and steps * (d + k) <= d * k)

    def _per_example_kernel_grads(self) -> tf.Tensor:
        """A_iᵀS_i for every example, [P, d, k]; computed once, used for norms and sums."""
        if not hasattr(self, "_kernel_grads"):
            self._kernel_grads = tf.einsum("ptd,ptk->pdk", self.a, self.s)
        return self._kernel_grads

    def weighted_sums(self, clip_factors):
        c = tf.cast(clip_factors, self.s.dtype)
        if not self.flat and not self._gram_is_cheaper():  # Σ_i c_i (A_iᵀS_i) from the stored products
            return sum_over_examples(self._sum_of_products, c, self._per_example_kernel_grads(), self.s)
        return sum_over_examples(self._weighted_matmul, c, self.a, self.s)

    def _sum_of_products(self, c, kernel_grads, s):
        kernel = tf.tensordot(c, kernel_grads, axes=1)
        return [kernel, tf.reduce_sum(s * c[:, None, None], axis=[0, 1])] if self.has_bias else [kernel]

    def _weighted_matmul(self, c, a, s):
        """Σ_i c_i A_iᵀS_i = Aᵀ (c ⊙ S), one matmul over all examples and positions."""
        weighted_s = s * (c[:, None] if self.flat else c[:, None, None])
        if not self.flat:
            a, weighted_s = tf.reshape(a, [-1, tf.shape(a)[-1]]), tf.reshape(weighted_s, [-1, tf.shape(s)[-1]])
        kernel = tf.matmul(a, weighted_s, transpose_a=True)
        return [kernel, tf.reduce_sum(weighted_s, axis=0)] if self.has_bias else [kernel]


def trainable_bias(layer) -> bool:
    return layer.bias is not None and layer.bias.trainable


def dense_contribution(activations: list, grads: list, has_bias: bool) -> DenseContribution:
    """One Dense contribution from a layer's recordings (several: concatenated along T)."""
    if len(activations) == 1 and activations[0].shape.rank == 2:
        return DenseContribution(activations[0], grads[0], has_bias, flat=True)
    return DenseContribution(tf.concat([_as_sequence(a) for a in activations], axis=1),
                             tf.concat([_as_sequence(g) for g in grads], axis=1), has_bias, flat=False)


class DenseRule(GhostRule):
    """Dense, and LoRA-enabled Dense (adapters A, B trainable, W₀ frozen; see lora.py)."""

    def applies_to(self, layer) -> bool:
        return (
            getattr(layer, "quantization_mode", None) is None
            and (lora_enabled(layer) or getattr(getattr(layer, "_kernel", None), "trainable", True))  # frozen W₀ out of norms
        )

    def variables(self, layer):
        if lora_enabled(layer):
            return lora_variables(layer, trainable_bias(layer))
        return [layer.kernel] + ([layer.bias] if trainable_bias(layer) else [])

    def tapped_call(self, layer, original_call, recordings, inputs, training=None):
        if lora_enabled(layer):
            z, recording = lora_tapped_call(layer, inputs)
            recordings.append(recording)
            return layer.activation(z) if layer.activation is not None else z
        z = keras.ops.matmul(inputs, layer.kernel)
        if layer.bias is not None:
            z = keras.ops.add(z, layer.bias)
        recordings.append(Recording(inputs, [z]))
        return layer.activation(z) if layer.activation is not None else z

    def contribution(self, layer, recordings, output_grads):
        has_bias = trainable_bias(layer)
        grads = [g[0] if g[0] is not None else tf.zeros_like(r.watched[0]) for r, g in zip(recordings, output_grads)]
        if lora_enabled(layer):
            return lora_contribution(layer, recordings, grads, has_bias, dense_contribution)
        return dense_contribution([r.inputs for r in recordings], grads, has_bias)


register_ghost_rule(keras.layers.Dense, DenseRule())
