"""Ghost rule for ``keras.layers.Dense``, with or without a sequence axis.

z = a W + b. With per-example activations A_i ∈ R^{T×d} and output gradients
S_i ∈ R^{T×k} (T = 1 without a sequence axis):

    ∂ℓ_i/∂W = A_iᵀ S_i,   ∂ℓ_i/∂b = Σ_t s_it
    ‖A_iᵀ S_i‖_F² = Σ_{t,t'} (a_it·a_it')(s_it·s_it')   (= ‖a_i‖²‖s_i‖² when T = 1)

The explicit A_iᵀS_i costs T·d·k per example and is used wherever it fits in memory; the
Gram form T²(d+k), plus T·d·k for the clipped sum Σ_i c_i A_iᵀ S_i (one weighted matmul;
book-keeping: no second backward pass).

Floating point: both forms sum over t, where large terms can cancel; in float32 a crafted
example's Gram norm came out 4× too small. With a sequence axis the clip norm is a
certified upper bound (rounding.py; DenseContribution says which).
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

    Without a sequence axis ‖A_iᵀS_i‖² = ‖a_i‖²‖s_i‖², a product of sums of squares (no
    cancellation; relative error ≤ γ_{d+k+2}), and the clipped sum Aᵀ(c ⊙ S) has one term
    per example and entry. With one, the clip norm is a certified upper bound U_i on both
    ‖∂ℓ_i/∂θ‖ and the norm of what is released for example i, with M_i = Σ_t ‖a_it‖‖s_it‖
    (kernel) or Σ_t ‖s_it‖ (bias):

    explicit: ĝ_i = A_iᵀS_i summed in precision p, U_i = ‖ĝ_i‖(1 + γ_{dk+1})^½ + γ_{T+1} M_i,
        released Σ_i c_i ĝ_i; p is the input precision, or float64 where T·u would make the
        γ_{T+1} M_i slack loose (T·u > 2⁻¹²: float32 beyond 4,096 positions, TF32);
    Gram: in float64, U_i = sqrt(max(Ñ_i², 0) + γ_{T²+d+k+1} M_i²) + γ_{T+2} M_i
        with Ñ_i² = Σ_{t,t'} (a_it·a_it')(s_it·s_it'), released Aᵀ(c ⊙ S) in float64.

    The explicit form costs T·d·k per example and holds [P, d, k]; the Gram form costs
    T²(d+k) on top of the same T·d·k for its clipped sum and holds [P, T, T]. The Gram form
    is used where it is the cheaper one and fits EXPLICIT_FLOATS (T·(d+k) < d·k), the explicit
    one otherwise wherever [P, d, k] fits, however long T is (a 224² image's first conv:
    T = 12,544 positions, [P, T, T] in float64 = 40 GB at P = 32, d·k = 9,408).
    """

    def __init__(self, activations, output_grads, has_bias: bool, flat: bool):
        # At least float32 even under a bfloat16 compute policy (float64: LoRA's products).
        self.a, self.s = _common_float(activations, output_grads)
        self.has_bias, self.flat = has_bias, flat

    def squared_norms(self):
        """U_i² (float64), an upper bound on ‖∂ℓ_i/∂θ_layer‖² (see the class docstring)."""
        if self.flat:  # a: [P, d], s: [P, k]
            a_sq, s_sq = rounding.squared_sum(self.a), rounding.squared_sum(self.s)
            norms = a_sq * s_sq * (1.0 + rounding.gamma(2))
            return norms + s_sq if self.has_bias else norms
        steps, d, k = (rounding.dimension(t, axis) for t, axis in ((self.a, 1), (self.a, 2), (self.s, 2)))
        s_norms = rounding.row_norms(self.s)
        scale = tf.reduce_sum(rounding.row_norms(self.a) * s_norms, axis=1)  # M_i
        if self._uses_gram_form():
            a, s = self._float64_inputs()
            gram = tf.einsum("ptd,pud->ptu", a, a) * tf.einsum("ptk,puk->ptu", s, s)
            kernel = rounding.certified_norm(tf.reduce_sum(gram, axis=[1, 2]), scale, steps * steps + d + k + 1,
                                             steps + 2)
        else:
            kernel = rounding.certified_norm(_squares(self._per_example_kernel_grads()), scale, 0, steps + 1,
                                             summed_dtype=self._summed_dtype())
        norms = tf.square(kernel)
        if self.has_bias:  # b̂_i = Σ_t s_it, materialized in either form
            norms += tf.square(rounding.certified_norm(_squares(self._per_example_bias_grads()),
                                                       tf.reduce_sum(s_norms, axis=1), 0, steps + 1,
                                                       summed_dtype=self._summed_dtype()))
        return norms

    def _explicit_dtype(self):
        """Precision of the explicit products: the inputs' own, or float64 where their
        rounding bound over T terms would be loose (T·u > 2⁻¹²)."""
        steps = self.a.shape[1]
        coarse = steps is not None and steps * rounding.unit_roundoff(self.s.dtype) > 2.0 ** -12
        return tf.float64 if coarse else self.s.dtype

    def _uses_gram_form(self) -> bool:
        """The cheaper form that fits EXPLICIT_FLOATS float32 units, else the Gram form.

        Per example the explicit products cost T·d·k and hold d·k floats, the Gram matrices
        T²·(d + k) and T² float64s. The Gram form is taken where it is cheaper (a short T with
        wide layers: FIBER's two evaluation points, T = 2, through a 512 × 512 kernel) and its
        [P, T, T] fits, or where the explicit [P, d, k] does not fit (a long T alone calls for
        float64 explicit products, not for [P, T, T]). T unknown when tracing: explicit if it fits.
        """
        examples, steps, d, k = self.a.shape[0], self.a.shape[1], self.a.shape[2], self.s.shape[2]
        if examples is None:
            return False
        width = 2 if self._explicit_dtype() == tf.float64 else 1
        explicit_fits = width * examples * d * k <= EXPLICIT_FLOATS
        gram_cheaper = steps is not None and steps * (d + k) < d * k
        gram_fits = steps is not None and 2 * examples * steps * steps <= EXPLICIT_FLOATS
        return (gram_cheaper and gram_fits) or not explicit_fits

    def _summed_dtype(self):
        """Precision of the per-example sums over T (kernel and bias) and of what is released."""
        return tf.float64 if self._uses_gram_form() else self._explicit_dtype()

    def _float64_inputs(self):
        if not hasattr(self, "_inputs64"):
            self._inputs64 = tf.cast(self.a, tf.float64), tf.cast(self.s, tf.float64)
        return self._inputs64

    def _summed_inputs(self):
        """a and s in the precision of the sums over T."""
        if self._summed_dtype() == tf.float64:
            return self._float64_inputs()
        return self.a, self.s

    def _per_example_kernel_grads(self) -> tf.Tensor:
        """A_iᵀS_i for every example, [P, d, k]; computed once, used for norms and sums."""
        if not hasattr(self, "_kernel_grads"):
            self._kernel_grads = tf.einsum("ptd,ptk->pdk", *self._summed_inputs())
        return self._kernel_grads

    def _per_example_bias_grads(self) -> tf.Tensor:
        """Σ_t s_it for every example, [P, k], in the precision of the sums over T."""
        if not hasattr(self, "_bias_grads"):
            self._bias_grads = tf.reduce_sum(self._summed_inputs()[1], axis=1)
        return self._bias_grads

    def weighted_sums(self, clip_factors):
        if self.flat:
            sums = sum_over_examples(self._weighted_matmul, tf.cast(clip_factors, self.a.dtype), self.a, self.s)
        else:
            bias = [self._per_example_bias_grads()] if self.has_bias else []
            if not self._uses_gram_form():  # Σ_i c_i ĝ_i from the stored products
                c = tf.cast(clip_factors, self._summed_dtype())
                sums = sum_over_examples(_sum_of_products, c, self._per_example_kernel_grads(), *bias)
            else:
                c = tf.cast(clip_factors, tf.float64)
                sums = sum_over_examples(self._weighted_matmul, c, *self._float64_inputs(), *bias)
        return [tf.cast(t, tf.float32) for t in sums]

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


def _squares(per_example: tf.Tensor) -> tf.Tensor:
    """An upper bound on Σ_j g_ij² per example, float64 (rounding.squared_sum)."""
    return rounding.squared_sum(rounding.per_example_rows(per_example))


def _sum_of_products(c, *per_example):
    """[Σ_i c_i g_i] for each [P, ...] tensor."""
    return [tf.tensordot(c, g, axes=1) for g in per_example]


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
            # frozen W₀ out of norms
            and (lora_enabled(layer) or getattr(getattr(layer, "_kernel", None), "trainable", True))
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
