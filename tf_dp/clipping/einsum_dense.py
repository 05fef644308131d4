"""Ghost rule for ``keras.layers.EinsumDense`` (and so ``MultiHeadAttention``'s projections).

When the equation contracts the input's trailing axes with the kernel's leading axes and
appends the kernel's remaining axes — ``"abc,cde->abde"`` (query/key/value projections),
``"abcd,cde->abe"`` (attention output), ``"ab,bc->ac"`` — the layer is a Dense layer on
flattened axes: a_it = x_i[t, contracted] ∈ R^C, z_it = a_it W + b with W the kernel
reshaped to [C, K]. The Dense sequence rule then gives norms and clipped sums.

Any other equation whose batch axis b (the input's first axis) is kept in the output and
absent from the kernel — Gemma's "btd,ndh->btnh", "btnh,nhd->btd", "...", a bias on a
non-output axis ("abc,cd->abd", bias_axes="b") — gets explicit per-example gradients:

    ∂ℓ_i/∂W = einsum("x,o->k") restricted to example i = einsum("x,o->bk", x, s)[i],
    ∂ℓ_i/∂bias = s_i summed over the output axes the bias is broadcast along,

[P, *kernel shape], clipped by the norm of exactly those released tensors (rounding.py).
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


def per_example_equation(equation: str) -> Optional[str]:
    """"x,o->bk": the per-example kernel gradient's einsum (b the input's first axis), with an
    ellipsis written as two explicit axes (batch, rest) — None if b is not an example axis."""
    inputs, output = equation.replace(" ", "").split("->")
    x, kernel = inputs.split(",")
    if "..." in x:
        if not (x.startswith("...") and output.startswith("...")) or "." in x[3:] + kernel + output[3:]:
            return None
        free = [c for c in "ZYXWVUTS" if c not in equation][:2]
        x, output = "".join(free) + x[3:], "".join(free) + output[3:]
    elif "." in kernel + output:
        return None
    batch = x[0]
    if batch in kernel or batch not in output or output[0] != batch:
        return None
    return f"{x},{output}->{batch}{kernel}"


def _with_ellipsis_axes(equation: str, tensor: tf.Tensor, explicit: int) -> tf.Tensor:
    """[B, *E, *rest] → [B, prod(E), *rest] when the equation has an ellipsis (``explicit``:
    the number of explicit axes after it)."""
    if "..." not in equation:
        return tensor
    shape = tf.shape(tensor)
    rest = shape[tf.rank(tensor) - explicit:] if explicit else shape[:0]
    return tf.reshape(tensor, tf.concat([shape[:1], [-1], rest], axis=0))


def per_example_bias_grads(s: tf.Tensor, bias_shape: tuple) -> tf.Tensor:
    """[P, *bias shape]: s summed over the output axes the bias is broadcast along (the
    leading ones it does not reach and those where its size is 1)."""
    rank, bias_rank = s.shape.rank, len(bias_shape)
    leading = list(range(1, rank - bias_rank))
    s = tf.reduce_sum(s, axis=leading) if leading else s
    ones = [1 + j for j, size in enumerate(bias_shape) if size == 1]
    return tf.reduce_sum(s, axis=ones, keepdims=True) if ones else s


class GeneralEinsumContribution(MaterializedContribution):
    """Explicit per-example gradients of any EinsumDense equation with an example axis."""

    def __init__(self, layer, recordings, grads, has_bias: bool):
        equation = per_example_equation(layer.equation)
        x_axes = layer.equation.replace(" ", "").split(",")[0]
        out_axes = layer.equation.replace(" ", "").split("->")[1]
        kernel, bias = 0.0, 0.0
        for recording, grad in zip(recordings, grads):
            x = _with_ellipsis_axes(layer.equation, tf.cast(recording.inputs, tf.float32),
                                    len(x_axes.replace("...", "")))
            s = tf.cast(grad, tf.float32)
            kernel += tf.einsum(equation, x, _with_ellipsis_axes(layer.equation, s, len(out_axes.replace("...", ""))))
            if has_bias:
                bias += per_example_bias_grads(s, tuple(layer.bias.shape))
        super().__init__([kernel] + ([bias] if has_bias else []))


class EinsumDenseRule(GhostRule):
    def applies_to(self, layer) -> bool:
        form = dense_form(layer.equation)
        kernel = getattr(layer, "_kernel", None)
        if kernel is None or getattr(layer, "quantization_mode", None) is not None:
            return False
        if form is None:  # general equation: explicit per-example gradients
            return not lora_enabled(layer) and kernel.trainable and per_example_equation(layer.equation) is not None
        if lora_enabled(layer):
            if form[1] == 0:  # B would act on a contracted axis: not this Dense form
                return False
        elif not kernel.trainable:
            return False
        new_shape = tuple(kernel.shape[form[0]:])
        if layer.bias is None or tuple(layer.bias.shape) == new_shape:  # bias over the new axes only
            return True
        return not lora_enabled(layer) and per_example_equation(layer.equation) is not None  # general route

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
        if not _dense_form_applies(layer):
            grads = [tf.zeros_like(r.watched[0]) if g is None else g for r, (g,) in zip(recordings, output_grads)]
            return GeneralEinsumContribution(layer, recordings, grads, self._has_bias(layer))
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


def _dense_form_applies(layer) -> bool:
    form = dense_form(layer.equation)
    return form is not None and (layer.bias is None or tuple(layer.bias.shape) == tuple(layer.kernel.shape[form[0]:]))


register_ghost_rule(keras.layers.EinsumDense, EinsumDenseRule())
