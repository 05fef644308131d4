"""Ghost rule for ``keras.layers.EinsumDense`` (and so ``MultiHeadAttention``'s projections).

When the equation contracts the input's trailing axes with the kernel's leading axes and
appends the kernel's remaining axes — ``"abc,cde->abde"`` (query/key/value projections),
``"abcd,cde->abe"`` (attention output), ``"ab,bc->ac"`` — the layer is a Dense layer on
flattened axes: a_it = x_i[t, contracted] ∈ R^C, z_it = a_it W + b with W the kernel
reshaped to [C, K]. The Dense sequence rule then gives norms and clipped sums.
"""

from __future__ import annotations

import math
from typing import Optional

import keras
import tensorflow as tf

from tf_dp.clipping.dense import DenseContribution, dense_contribution
from tf_dp.clipping.layer_per_example import MaterializedContribution
from tf_dp.clipping.lora import einsum_lora_contribution, lora_enabled
from tf_dp.clipping.registry import CombinedContribution, GhostRule, Recording, register_ghost_rule


def dense_form(equation: str) -> Optional[tuple[int, int]]:
    """(number of contracted axes, number of new axes) if ``equation`` is a Dense on
    flattened trailing axes, else None."""
    inputs, output = equation.replace(" ", "").split("->")
    x, kernel = inputs.split(",")
    if x.startswith("...") != output.startswith("..."):
        return None
    x, output = x.removeprefix("..."), output.removeprefix("...")
    if "." in x + kernel + output:
        return None
    contracted = "".join(c for c in kernel if c in x and c not in output)
    new = "".join(c for c in kernel if c not in x)
    if not contracted or kernel != contracted + new or not x.endswith(contracted):
        return None
    if output != x[: len(x) - len(contracted)] + new:
        return None
    return len(contracted), len(new)


class EinsumDenseRule(GhostRule):
    def applies_to(self, layer) -> bool:
        form = dense_form(layer.equation)
        kernel = getattr(layer, "_kernel", None)
        if form is None or kernel is None or getattr(layer, "quantization_mode", None) is not None:
            return False
        if lora_enabled(layer):
            if form[1] == 0:  # B would act on a contracted axis: not this Dense form
                return False
        elif not kernel.trainable:
            return False
        new_shape = tuple(kernel.shape[form[0]:])
        return layer.bias is None or tuple(layer.bias.shape) == new_shape  # bias over the new axes only

    def _has_bias(self, layer) -> bool:
        return layer.bias is not None and layer.bias.trainable

    def variables(self, layer):
        kernels = [layer.lora_kernel_a, layer.lora_kernel_b] if lora_enabled(layer) else [layer.kernel]
        return kernels + ([layer.bias] if self._has_bias(layer) else [])

    def tapped_call(self, layer, original_call, recordings, inputs, training=None):
        z = keras.ops.einsum(layer.equation, inputs, layer.kernel)  # W₀ + s·A B under LoRA
        if layer.bias is not None:
            z = keras.ops.add(z, layer.bias)
        extras = (keras.ops.convert_to_tensor(layer.lora_kernel_a),
                  keras.ops.convert_to_tensor(layer.lora_kernel_b)) if lora_enabled(layer) else None
        recordings.append(Recording(inputs, [z], extras=extras))
        return layer.activation(z) if layer.activation is not None else z

    def contribution(self, layer, recordings, output_grads):
        contracted, _ = dense_form(layer.equation)
        if lora_enabled(layer):
            grads = [tf.zeros_like(r.watched[0]) if g is None else g for r, (g,) in zip(recordings, output_grads)]
            return einsum_lora_contribution(layer, recordings, grads, contracted, self._has_bias(layer),
                                            dense_contribution, MaterializedContribution)
        kernel_shape = tuple(layer.kernel.shape)
        c, k = math.prod(kernel_shape[:contracted]), math.prod(kernel_shape[contracted:])
        activations, grads = [], []
        for recording, (grad,) in zip(recordings, output_grads):
            grad = tf.zeros_like(recording.watched[0]) if grad is None else grad
            batch = tf.shape(recording.inputs)[0]
            activations.append(tf.reshape(recording.inputs, tf.stack([batch, -1, c])))
            grads.append(tf.reshape(grad, tf.stack([batch, -1, k])))
        dense = DenseContribution(tf.concat(activations, axis=1), tf.concat(grads, axis=1), self._has_bias(layer),
                                  flat=False)
        return CombinedContribution([dense], [tuple(v.shape) for v in self.variables(layer)])


register_ghost_rule(keras.layers.EinsumDense, EinsumDenseRule())
