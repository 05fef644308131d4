"""Ghost rule for ``Conv1D``/``Conv2D`` (channels_last, any ``groups``) via unfolded patches.

A convolution is a Dense layer applied at every output position t to the unfolded input
patch a_it ∈ R^{kh·kw·C_in}: z_it = a_it W + b with W the kernel reshaped to
[kh·kw·C_in, C_out]. So the Dense sequence rule applies with T = number of output
positions, and picks per layer between the Gram form (T²(d+k)) and explicit per-example
A_iᵀS_i (T·d·k), as mixed ghost clipping does.

Unfolding a single-channel input is slow on CPU, so there (and where the per-example
kernel gradients fit in memory) they are taken without it: with the examples as the groups
of ONE grouped convolution, its filter gradient is exactly the stack of the A_iᵀS_i, in one
call of the platform's convolution kernel. With more input channels unfolding was faster
here (``python benchmarks/conv_routes.py`` times every route; GPU costs unmeasured).

Kernels: a grouped filter gradient runs only where TensorFlow has a kernel for it (on CPU:
oneDNN on, see kernels.py; probed once per process). Without one, the unfolded route.
A grouped layer (``groups = G``) is G Dense contributions, one per group g: input channels
[g·C_in/G, (g+1)·C_in/G) to outputs [g·C_out/G, (g+1)·C_out/G); their norms add up and
their kernel sums are concatenated along the output axis.

Floating point (rounding.py): the unfolded route inherits the Dense form's certified norm;
the grouped route clips the per-example kernel gradients it releases by those
gradients' own norm, which bounds the release by C whatever rounding the kernel did.
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from tf_dp._xla import compiling_with_xla
from tf_dp.clipping import dense
from tf_dp.clipping.kernels import grouped_conv_filter_gradient_available
from tf_dp.clipping.layer_per_example import MaterializedContribution
from tf_dp.clipping.lora import lora_enabled
from tf_dp.clipping.registry import CombinedContribution, GhostRule, Recording, register_ghost_rule


def _as_2d(layer, tensor: tf.Tensor) -> tf.Tensor:
    """Conv1D tensors [P, L, C] as images [P, L, 1, C]."""
    return tensor[:, :, None, :] if layer.rank == 1 else tensor


def _window(layer) -> tuple:
    """(kernel size, strides, dilation) as 2-D tuples."""
    if layer.rank == 1:
        return (layer.kernel_size[0], 1), (layer.strides[0], 1), (layer.dilation_rate[0], 1)
    return tuple(layer.kernel_size), tuple(layer.strides), tuple(layer.dilation_rate)


def _patches(layer, inputs: tf.Tensor) -> tf.Tensor:
    """[P, T, kh·kw·C_in] unfolded input patches, flattened like the kernel."""
    inputs = _as_2d(layer, inputs)
    sizes, strides, rates = _window(layer)
    padding = layer.padding.upper()
    patches = _sliced_patches(inputs, sizes, strides, rates, padding)
    if patches is None:
        patches = tf.image.extract_patches(inputs, sizes=[1, *sizes, 1], strides=[1, *strides, 1],
                                           rates=[1, *rates, 1], padding=padding)
    return tf.reshape(patches, tf.stack([tf.shape(patches)[0], -1, tf.shape(patches)[-1]]))


def _sliced_patches(inputs: tf.Tensor, sizes, strides, rates, padding: str):
    """``tf.image.extract_patches`` (the same values in the same order: window row, column,
    channel) as kh·kw strided slices concatenated along the channels, or None where the
    spatial sizes are not static. The copies are exact; ExtractImagePatches took 17 ms on
    [128, 28, 28, 1] with a 3×3 window against 7 ms for the slices (2-core CPU)."""
    height, width = inputs.shape[1], inputs.shape[2]
    if height is None or width is None:
        return None
    spans = [(size - 1) * rate + 1 for size, rate in zip(sizes, rates)]
    if padding == "SAME":
        outs = [-(-n // stride) for n, stride in zip((height, width), strides)]
        pads = [max((out - 1) * stride + span - n, 0)
                for out, stride, span, n in zip(outs, strides, spans, (height, width))]
        inputs = tf.pad(inputs, [[0, 0], [pads[0] // 2, pads[0] - pads[0] // 2],
                                 [pads[1] // 2, pads[1] - pads[1] // 2], [0, 0]])
    else:
        outs = [(n - span) // stride + 1 for n, span, stride in zip((height, width), spans, strides)]
    if min(outs) < 1:
        return None
    slices = [inputs[:, dy * rates[0]:dy * rates[0] + (outs[0] - 1) * strides[0] + 1:strides[0],
                     dx * rates[1]:dx * rates[1] + (outs[1] - 1) * strides[1] + 1:strides[1], :]
              for dy in range(sizes[0]) for dx in range(sizes[1])]
    return slices[0] if len(slices) == 1 else tf.concat(slices, axis=-1)


_EXAMPLES_PER_CALL = 256  # one call's cost grew 5.4x from 256 to 1024 examples (C_in = 1)
# Grouped route only up to this many input channels. Measured (benchmarks/conv_routes.py,
# batch 256, 2-core CPU): C_in = 1 grouped 4.0x the batch filter gradient vs unfolded 13x;
# C_in = 16 grouped 3.9x vs unfolded 3.1x.
_GROUPED_MAX_CHANNELS = 1


def _per_example_kernel_grads(layer, inputs: tf.Tensor, grads: tf.Tensor) -> tf.Tensor:
    """∂ℓ_i/∂W = A_iᵀS_i of every example, [P, *kernel shape], in groups of at most
    _EXAMPLES_PER_CALL examples."""
    examples = inputs.shape[0]
    if examples is None or examples <= _EXAMPLES_PER_CALL:
        return _grouped_filter_gradient(layer, inputs, grads)
    sizes = [_EXAMPLES_PER_CALL] * (examples // _EXAMPLES_PER_CALL) + (
        [examples % _EXAMPLES_PER_CALL] if examples % _EXAMPLES_PER_CALL else [])
    return tf.concat([_grouped_filter_gradient(layer, a, g)
                      for a, g in zip(tf.split(inputs, sizes), tf.split(grads, sizes))], axis=0)


def _grouped_filter_gradient(layer, inputs: tf.Tensor, grads: tf.Tensor) -> tf.Tensor:
    """Per-example kernel gradients from ONE grouped convolution: the P examples laid side
    by side as the P groups of a single image with P·C_in channels (group p: example p's
    channels, mapped to its own C_out outputs). The filter gradient of that convolution,
    [kh, kw, C_in, P·C_out], is exactly the stack of the A_iᵀS_i (for C_in = 1 it is a
    depthwise convolution). Needs a grouped kernel."""
    inputs, grads = _as_2d(layer, tf.cast(inputs, tf.float32)), _as_2d(layer, tf.cast(grads, tf.float32))
    examples, channels = tf.shape(inputs)[0], tf.shape(inputs)[-1]
    (kh, kw), (sh, sw), _ = _window(layer)
    filter_grad = tf.compat.v1.nn.conv2d_backprop_filter(
        _examples_as_channels(inputs), tf.stack([kh, kw, channels, examples * layer.filters]),
        _examples_as_channels(grads), [1, sh, sw, 1], layer.padding.upper())
    filter_grad = tf.reshape(filter_grad, tf.stack([kh, kw, channels, examples, layer.filters]))
    return tf.reshape(tf.transpose(filter_grad, [3, 0, 1, 2, 4]), tf.concat([[examples], layer.kernel.shape], axis=0))


def _examples_as_channels(tensor: tf.Tensor) -> tf.Tensor:
    """[P, H, W, C] -> [1, H, W, P·C], channel p·C + c."""
    shape = tf.shape(tensor)
    return tf.reshape(tf.transpose(tensor, [1, 2, 0, 3]), tf.stack([1, shape[1], shape[2], shape[0] * shape[3]]))


def _uses_grouped_route(layer, examples) -> bool:
    """Per-example kernel gradients from one grouped filter-gradient call: where TensorFlow
    has that kernel (kernels.py), groups = 1, at most _GROUPED_MAX_CHANNELS input channels,
    no dilation, per-example kernel gradients within dense.EXPLICIT_FLOATS, and not under
    XLA (its CPU kernel for the depthwise form of C_in = 1 took 8.9 s for the tutorial CNN's
    step; graph mode 4.4 ms). Otherwise: unfolded patches. Without oneDNN the depthwise
    filter gradient (the same stack for C_in = 1) took 71 ms at batch 256 against 49 ms
    unfolded, so it is not used (benchmarks/conv_routes.py, TF_ENABLE_ONEDNN_OPTS=0)."""
    examples = _EXAMPLES_PER_CALL if examples is None else examples
    fits = examples * layer.kernel.shape.num_elements() <= dense.EXPLICIT_FLOATS
    return (layer.groups == 1 and layer.kernel.shape[-2] <= _GROUPED_MAX_CHANNELS and fits
            and all(rate == 1 for rate in _window(layer)[2]) and not compiling_with_xla()
            and grouped_conv_filter_gradient_available())


def _trainable_bias(layer) -> bool:
    return layer.use_bias and layer.bias.trainable


class ConvRule(GhostRule):
    def applies_to(self, layer) -> bool:
        return (
            layer.rank in (1, 2)
            and layer.data_format == "channels_last"
            and layer.padding in ("valid", "same")
            and not lora_enabled(layer)
            and getattr(layer, "quantization_mode", None) is None
            and getattr(getattr(layer, "kernel", None), "trainable", True)
        )

    def variables(self, layer):
        return [layer.kernel] + ([layer.bias] if _trainable_bias(layer) else [])

    def tapped_call(self, layer, original_call, recordings, inputs):
        z = layer.convolution_op(inputs, layer.kernel)
        if layer.use_bias:
            z = keras.ops.add(z, keras.ops.reshape(layer.bias, (1,) * (layer.rank + 1) + (layer.filters,)))
        recordings.append(Recording(inputs, [z]))
        return layer.activation(z) if layer.activation is not None else z

    def contribution(self, layer, recordings, output_grads):
        grads = [tf.zeros_like(r.watched[0]) if g is None else g for r, (g,) in zip(recordings, output_grads)]
        if _uses_grouped_route(layer, grads[0].shape[0]):
            kernel = tf.add_n([_per_example_kernel_grads(layer, r.inputs, g) for r, g in zip(recordings, grads)])
            per_example = [kernel]
            if _trainable_bias(layer):
                rank = len(grads[0].shape)
                per_example.append(tf.add_n([tf.reduce_sum(tf.cast(g, tf.float32), axis=list(range(1, rank - 1)))
                                             for g in grads]))
            return MaterializedContribution(per_example)
        return self._unfolded_contribution(layer, recordings, grads)

    def _unfolded_contribution(self, layer, recordings, grads):
        """One Dense contribution per group on [P, T, kh·kw·C_in/G] patches."""
        groups, has_bias = layer.groups, _trainable_bias(layer)
        patches, flat_grads = [], []
        for recording, grad in zip(recordings, grads):
            patches.append(_patches(layer, recording.inputs))
            flat_grads.append(tf.reshape(grad, tf.stack([tf.shape(grad)[0], -1, layer.filters])))
        patches, flat_grads = tf.concat(patches, axis=1), tf.concat(flat_grads, axis=1)
        if groups == 1:
            unfolded = dense.DenseContribution(patches, flat_grads, has_bias, flat=False)
            return CombinedContribution([unfolded], [tuple(v.shape) for v in self.variables(layer)])
        window = math.prod(_window(layer)[0])
        shape = tf.shape(patches)
        patches = tf.reshape(patches, tf.stack([shape[0], shape[1], window, groups, -1]))
        flat_grads = tf.reshape(flat_grads, tf.stack([shape[0], shape[1], groups, -1]))
        parts = [dense.DenseContribution(tf.reshape(patches[:, :, :, g], tf.stack([shape[0], shape[1], -1])),
                                         flat_grads[:, :, g], has_bias, flat=False) for g in range(groups)]
        return GroupedContribution(parts, tuple(layer.kernel.shape), has_bias)


class GroupedContribution(CombinedContribution):
    """G per-group Dense contributions of a grouped convolution: norms add up; the kernel
    sums [kh·kw·C_in/G, C_out/G] are reshaped and concatenated along the output axis, as
    are the bias sums."""

    def __init__(self, parts, kernel_shape: tuple, has_bias: bool):
        super().__init__(parts, [])
        self.kernel_shape, self.has_bias = kernel_shape, has_bias

    def weighted_sums(self, clip_factors):
        sums = [part.weighted_sums(clip_factors) for part in self.parts]
        group_shape = self.kernel_shape[:-1] + (self.kernel_shape[-1] // len(self.parts),)
        kernel = tf.concat([tf.reshape(part_sums[0], group_shape) for part_sums in sums], axis=-1)
        return [kernel, tf.concat([part_sums[1] for part_sums in sums], axis=0)] if self.has_bias else [kernel]


register_ghost_rule(keras.layers.Conv1D, ConvRule())
register_ghost_rule(keras.layers.Conv2D, ConvRule())
