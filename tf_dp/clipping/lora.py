"""Ghost rules for LoRA-enabled ``Dense``, ``EinsumDense`` and ``Embedding`` layers
(``layer.enable_lora(rank)``).

z = a (W₀ + s·A B) + b with W₀ frozen, A ∈ R^{d×r}, B ∈ R^{r×k}, s = alpha/rank. With
per-example activations a_i [T, d] and output gradients g_i [T, k]:

    ∂ℓ_i/∂A = a_iᵀ (s · g_i Bᵀ)        (Dense form: activations a_i, gradients s·g_i Bᵀ)
    ∂ℓ_i/∂B = (s · a_i A)ᵀ g_i          (Dense form: activations s·a_i A, gradients g_i)

so each adapter matrix is a Dense contribution of rank-r width, and the norms add up.
A and B are read inside the recorded call, so a look-ahead evaluation point uses its own.
The products with A and B are taken in float64 (they can cancel too): the Dense forms then
certify their norms against those exact inputs (rounding.py).
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from tf_dp.clipping.registry import CombinedContribution, Contribution, Recording


def lora_enabled(layer) -> bool:
    return getattr(layer, "lora_enabled", False)


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


def lora_contribution(layer, recordings, grads, has_bias: bool, dense_contribution) -> Contribution:
    """``dense_contribution(activations, output_grads, has_bias)`` builds the Dense form."""
    scale = _scale(layer)
    activations_a, grads_a, activations_b = [], [], []
    for recording, grad in zip(recordings, grads):
        a, b = (tf.cast(t, tf.float64) for t in recording.extras)
        inputs, grad = tf.cast(recording.inputs, tf.float64), tf.cast(grad, tf.float64)
        activations_a.append(inputs)
        grads_a.append(scale * tf.matmul(grad, b, transpose_b=True))
        activations_b.append(scale * tf.matmul(inputs, a))
    variables = lora_variables(layer, has_bias)
    return CombinedContribution([dense_contribution(activations_a, grads_a, False),
                                 dense_contribution(activations_b, grads, has_bias)],
                                [tuple(v.shape) for v in variables])


def einsum_lora_contribution(layer, recordings, grads, contracted: int, has_bias: bool, dense_contribution,
                             materialized_contribution) -> Contribution:
    """LoRA on an EinsumDense in Dense form: kernel axes [contracted C | new N', n], A of
    shape [C, N', r], B of shape [r, n], W = W₀ + s·A B. Per example, with a_t ∈ R^C and
    g_t ∈ R^{N'×n}:

        ∂ℓ/∂A = a_tᵀ (s · g_t Bᵀ) summed over t    (Dense form, gradient width N'·r)
        ∂ℓ/∂B = Σ_{t,n'} (s · a_t A)[n'] ᵀ g_t[n']   (Dense form over T·N' positions)
        ∂ℓ/∂b = Σ_t g_t                              (materialized; the size of b)
    """
    scale = _scale(layer)
    kernel_shape = tuple(layer._kernel.shape)
    c, n = math.prod(kernel_shape[:contracted]), kernel_shape[-1]
    middle = math.prod(kernel_shape[contracted:-1])
    rank = layer.lora_rank
    activations_a, grads_a, activations_b, grads_b, bias_grads = [], [], [], [], []
    for recording, grad in zip(recordings, grads):
        a_weights, b_weights = (tf.cast(t, tf.float64) for t in recording.extras)
        batch = tf.shape(recording.inputs)[0]
        inputs = tf.reshape(tf.cast(recording.inputs, tf.float64), tf.stack([batch, -1, c]))
        grad = tf.reshape(tf.cast(grad, tf.float64), tf.stack([batch, -1, middle, n]))
        activations_a.append(inputs)
        grads_a.append(tf.reshape(scale * tf.einsum("ptmj,rj->ptmr", grad, b_weights),
                                  tf.stack([batch, -1, middle * rank])))
        projected = scale * tf.einsum("ptc,cr->ptr", inputs, tf.reshape(a_weights, [c, middle * rank]))
        activations_b.append(tf.reshape(projected, tf.stack([batch, -1, rank])))
        grads_b.append(tf.reshape(grad, tf.stack([batch, -1, n])))
        bias_grads.append(tf.reduce_sum(tf.reshape(grad, tf.stack([batch, -1, middle * n])), axis=1))
    parts = [dense_contribution(activations_a, grads_a, False), dense_contribution(activations_b, grads_b, False)]
    shapes = [tuple(layer.lora_kernel_a.shape), tuple(layer.lora_kernel_b.shape)]
    if has_bias:
        parts.append(materialized_contribution([tf.add_n(bias_grads)]))
        shapes.append(tuple(layer.bias.shape))
    return CombinedContribution(parts, shapes)


def lora_embedding_tapped_call(layer, ids):
    a, b = keras.ops.convert_to_tensor(layer.lora_embeddings_a), keras.ops.convert_to_tensor(layer.lora_embeddings_b)
    z = keras.ops.take(layer.embeddings, ids, axis=0)  # rows of E₀ + s·A B, as Keras computes them
    return z, Recording(ids, [z], extras=(a, b))


def lora_embedding_contribution(layer, recordings, grads, embedding_contribution, dense_contribution) -> Contribution:
    """LoRA on an Embedding: z_t = E₀[id_t] + s·A[id_t] B with E₀ frozen, A ∈ R^{V×r},
    B ∈ R^{r×k}. Per example, with output gradients g_t:

        ∂ℓ/∂A = Σ_t e_{id_t} (s · g_t Bᵀ)ᵀ    (Embedding form: ids, gradients s·g_t Bᵀ)
        ∂ℓ/∂B = Σ_t (s · A[id_t])ᵀ g_t         (Dense form: activations s·A[id_t], gradients g_t)

    ``embedding_contribution(ids, output_grads, vocabulary_size)`` builds the Embedding form."""
    scale = _scale(layer)
    ids, grads_a, activations_b, grads_b = [], [], [], []
    for recording, grad in zip(recordings, grads):
        a, b = (tf.cast(t, tf.float64) for t in recording.extras)
        batch = tf.shape(recording.inputs)[0]
        example_ids = tf.reshape(tf.cast(recording.inputs, tf.int64), tf.stack([batch, -1]))
        grad = tf.reshape(tf.cast(grad, tf.float64), tf.stack([batch, -1, tf.shape(grad)[-1]]))
        ids.append(example_ids)
        grads_a.append(scale * tf.einsum("ptk,rk->ptr", grad, b))
        activations_b.append(scale * tf.gather(a, example_ids))
        grads_b.append(grad)
    parts = [embedding_contribution(tf.concat(ids, axis=1), tf.concat(grads_a, axis=1), layer.input_dim),
             dense_contribution(activations_b, grads_b, False)]
    return CombinedContribution(parts, [tuple(layer.lora_embeddings_a.shape), tuple(layer.lora_embeddings_b.shape)])
