"""Ghost rule for LoRA-enabled ``Dense`` layers (``layer.enable_lora(rank)``).

z = a (W₀ + s·A B) + b with W₀ frozen, A ∈ R^{d×r}, B ∈ R^{r×k}, s = alpha/rank. With
per-example activations a_i [T, d] and output gradients g_i [T, k]:

    ∂ℓ_i/∂A = a_iᵀ (s · g_i Bᵀ)        (Dense form: activations a_i, gradients s·g_i Bᵀ)
    ∂ℓ_i/∂B = (s · a_i A)ᵀ g_i          (Dense form: activations s·a_i A, gradients g_i)

so each adapter matrix is a Dense contribution of rank-r width, and the norms add up.
A and B are read inside the recorded call, so a look-ahead evaluation point uses its own.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_dp.clipping.registry import Contribution, Recording


def _scale(layer) -> float:
    return layer.lora_alpha / layer.lora_rank


def lora_variables(layer, has_bias: bool) -> list:
    return [layer.lora_kernel_a, layer.lora_kernel_b] + ([layer.bias] if has_bias else [])


def lora_tapped_call(layer, inputs):
    a, b = keras.ops.convert_to_tensor(layer.lora_kernel_a), keras.ops.convert_to_tensor(layer.lora_kernel_b)
    z = keras.ops.matmul(inputs, layer.kernel)  # W₀ + s·A B, as Keras computes it
    if layer.bias is not None:
        z = keras.ops.add(z, layer.bias)
    return z, Recording(inputs, [z], extras=(a, b))


class LoRAContribution(Contribution):
    def __init__(self, kernel_a: Contribution, kernel_b: Contribution):
        self.kernel_a, self.kernel_b = kernel_a, kernel_b

    def squared_norms(self):
        return self.kernel_a.squared_norms() + self.kernel_b.squared_norms()

    def weighted_sums(self, clip_factors):
        return self.kernel_a.weighted_sums(clip_factors) + self.kernel_b.weighted_sums(clip_factors)


def lora_contribution(layer, recordings, grads, has_bias: bool, dense_contribution) -> LoRAContribution:
    """``dense_contribution(activations, output_grads, has_bias)`` builds the Dense form."""
    scale = _scale(layer)
    activations_a, grads_a, activations_b = [], [], []
    for recording, grad in zip(recordings, grads):
        a, b = (tf.cast(t, tf.float32) for t in recording.extras)
        inputs, grad = tf.cast(recording.inputs, tf.float32), tf.cast(grad, tf.float32)
        activations_a.append(inputs)
        grads_a.append(scale * tf.matmul(grad, b, transpose_b=True))
        activations_b.append(scale * tf.matmul(inputs, a))
    return LoRAContribution(dense_contribution(activations_a, grads_a, False),
                            dense_contribution(activations_b, grads, has_bias))
