"""Ghost rule for ``keras.layers.Dense``, with or without a sequence axis.

z = a W + b. With per-example activations A_i ∈ R^{T×d} and output gradients
S_i ∈ R^{T×k} (T = 1 without a sequence axis):

    ∂ℓ_i/∂W = A_iᵀ S_i,   ∂ℓ_i/∂b = Σ_t s_it
    ‖A_iᵀ S_i‖_F² = Σ_{t,t'} (a_it·a_it')(s_it·s_it')   (= ‖a_i‖²‖s_i‖² when T = 1)

The Gram form costs T²(d+k) per example, the explicit A_iᵀS_i costs T·d·k; the cheaper
one is used per layer ("mixed ghost clipping"). The clipped sum is Σ_i c_i A_iᵀ S_i, one
weighted matmul (book-keeping: no second backward pass).

Floating point: both forms sum over t, where large terms can cancel; in float32 a crafted
example's Gram norm came out 4× too small. With a sequence axis, norms and clipped sums
are computed in float64 and clipped against a certified upper bound (rounding.py).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_dp.clipping import rounding
from tf_dp.clipping.clip import sum_over_examples
from tf_dp.clipping.lora import lora_contribution, lora_enabled, lora_tapped_call, lora_variables
from tf_dp.clipping.registry import Contribution, GhostRule, Recording, register_ghost_rule


def _as_sequence(tensor: tf.Tensor) -> tf.Tensor:
    """[P, ..., d] -> [P, T, d]."""
    shape = tf.shape(tensor)
    return tf.reshape(tensor, tf.stack([shape[0], -1, shape[-1]]))


def _common_float(*tensors) -> list:
    """float64 if any is (LoRA's products), else float32 (also under a bfloat16 policy)."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    dtype = tf.float64 if any(t.dtype == tf.float64 for t in tensors) else tf.float32
    return [tf.cast(t, dtype) for t in tensors]


EXPLICIT_FLOATS = 2 ** 26  # per-example kernel gradients [P, d, k] held explicitly up to 256 MB (float32 units)


class DenseContribution(Contribution):
    """Norms and clipped sums of a Dense layer, safe against cancellation (rounding.py).

    Without a sequence axis ‖A_iᵀS_i‖² = ‖a_i‖²‖s_i‖² is a product of sums of squares (no
    cancellation, relative error ≤ γ_{d+k+2}); the clipped sum Aᵀ(c ⊙ S) then has one term
    per example and entry, kept in float32. With one, norms and clipped sums are computed
    in float64 from the float32 inputs and the clip norm is the certified bound
    U_i = sqrt(max(Ñ_i², 0) + γ_G M_i²) + γ_R M_i, M_i = Σ_t ‖a_it‖‖s_it‖ (kernel) and
    Σ_t ‖s_it‖ (bias): U_i ≥ ‖∂ℓ_i/∂θ‖ and ≥ the norm of example i's released sum."""

    def __init__(self, activations, output_grads, has_bias: bool, flat: bool):
        # At least float32 even under a bfloat16 compute policy; float64 copies where summed over t.
        self.a, self.s = _common_float(activations, output_grads)
        self.has_bias, self.flat = has_bias, flat
        if not flat:
            self.a64, self.s64 = tf.cast(self.a, tf.float64), tf.cast(self.s, tf.float64)

    def squared_norms(self):
        """U_i² (float64), an upper bound on ‖∂ℓ_i/∂θ_layer‖² (see the class docstring)."""
        if self.flat:  # a: [P, d], s: [P, k]
            a_sq, s_sq = (tf.reduce_sum(tf.square(tf.cast(t, tf.float64)), axis=1) for t in (self.a, self.s))
            d, k = tf.shape(self.a)[1], tf.shape(self.s)[1]
            norms = a_sq * s_sq * (1.0 + rounding.gamma(d + k + 2))
            return norms + s_sq * (1.0 + rounding.gamma(k)) if self.has_bias else norms
        a, s = self.a64, self.s64  # [P, T, d], [P, T, k]
        steps, d, k = tf.shape(a)[1], tf.shape(a)[2], tf.shape(s)[2]
        scale = tf.reduce_sum(rounding.row_norms(a) * rounding.row_norms(s), axis=1)  # M_i
        if self._gram_is_cheaper():
            gram = tf.einsum("ptd,pud->ptu", a, a) * tf.einsum("ptk,puk->ptu", s, s)
            kernel = rounding.certified_norm(tf.reduce_sum(gram, axis=[1, 2]), scale, steps * steps + d + k + 1,
                                             steps + 2)
        else:
            squares = tf.reduce_sum(tf.square(self._per_example_kernel_grads()), axis=[1, 2])
            kernel = rounding.certified_norm(squares, scale, 0, steps + 2, squared_terms=d * k)
        norms = tf.square(kernel)
        if self.has_bias:
            bias_scale = tf.reduce_sum(rounding.row_norms(s), axis=1)
            squares = tf.reduce_sum(tf.square(self._per_example_bias_grads()), axis=1)
            norms += tf.square(rounding.certified_norm(squares, bias_scale, 0, steps + 2, squared_terms=k))
        return norms

    def _gram_is_cheaper(self) -> bool:
        """The Gram form where it costs fewer FLOPs, T(d+k) ≤ dk, or where the explicit
        [P, d, k] float64 products would exceed EXPLICIT_FLOATS float32 units."""
        examples, steps, d, k = self.a.shape[0], self.a.shape[1], self.a.shape[2], self.s.shape[2]
        too_big = examples is not None and 2 * examples * d * k > EXPLICIT_FLOATS
        return too_big or (steps is not None and steps * (d + k) <= d * k)

    def _per_example_kernel_grads(self) -> tf.Tensor:
        """A_iᵀS_i for every example, [P, d, k] in float64; computed once, used for norms and sums."""
        if not hasattr(self, "_kernel_grads"):
            self._kernel_grads = tf.einsum("ptd,ptk->pdk", self.a64, self.s64)
        return self._kernel_grads

    def _per_example_bias_grads(self) -> tf.Tensor:
        """Σ_t s_it for every example, [P, k] in float64; used for norms and sums alike."""
        if not hasattr(self, "_bias_grads"):
            self._bias_grads = tf.reduce_sum(self.s64, axis=1)
        return self._bias_grads

    def weighted_sums(self, clip_factors):
        if self.flat:
            sums = sum_over_examples(self._weighted_matmul, tf.cast(clip_factors, self.a.dtype), self.a, self.s)
            return [tf.cast(t, tf.float32) for t in sums]
        c = tf.cast(clip_factors, tf.float64)
        bias = [self._per_example_bias_grads()] if self.has_bias else []
        if not self._gram_is_cheaper():  # Σ_i c_i (A_iᵀS_i) from the stored products
            sums = sum_over_examples(self._sum_of_products, c, self._per_example_kernel_grads(), *bias)
        else:
            sums = sum_over_examples(self._weighted_matmul, c, self.a64, self.s64, *bias)
        return [tf.cast(t, tf.float32) for t in sums]

    def _sum_of_products(self, c, kernel_grads, *bias_grads):
        return [tf.tensordot(c, kernel_grads, axes=1)] + [tf.tensordot(c, b, axes=1) for b in bias_grads]

    def _weighted_matmul(self, c, a, s, *bias_grads):
        """Σ_i c_i A_iᵀS_i = Aᵀ (c ⊙ S), one matmul over all examples and positions."""
        weighted_s = s * (c[:, None] if self.flat else c[:, None, None])
        if not self.flat:
            a, weighted_s = tf.reshape(a, [-1, tf.shape(a)[-1]]), tf.reshape(weighted_s, [-1, tf.shape(s)[-1]])
        kernel = tf.matmul(a, weighted_s, transpose_a=True)
        if not self.has_bias:
            return [kernel]
        if self.flat:
            return [kernel, tf.reduce_sum(weighted_s, axis=0)]
        return [kernel, tf.tensordot(c, bias_grads[0], axes=1)]


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
