"""Rule for ``keras.layers.DepthwiseConv2D`` (channels last, equal strides, no dilation).

Channel c of example i is convolved with its own filters W[:, :, c, :]; the per-example
filter gradient ∂ℓ_i/∂W[:, :, c, m] = Σ_t patch_it[c] s_it[c·M + m] is what TensorFlow's
depthwise filter gradient computes for one example. Taking the P examples as P·C channels
of ONE image (channel p·C + c), a single call gives all of them at once:

    depthwise_filter_grad(x as [1, H, W, P·C], s as [1, H', W', P·C·M]) = [kh, kw, P·C, M]
    → [P, kh, kw, C, M],   ∂ℓ_i/∂b = Σ_t s_it.

Explicit per-example gradients, clipped by the norm of exactly those released tensors
(rounding.py).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_dp.clipping.layer_per_example import MaterializedContribution
from tf_dp.clipping.registry import GhostRule, Recording, register_ghost_rule


def _examples_as_channels(tensor: tf.Tensor) -> tf.Tensor:
    """[P, H, W, C] → [1, H, W, P·C], channel p·C + c."""
    shape = tf.shape(tensor)
    return tf.reshape(tf.transpose(tensor, [1, 2, 0, 3]), tf.stack([1, shape[1], shape[2], shape[0] * shape[3]]))


class DepthwiseConv2DRule(GhostRule):
    def applies_to(self, layer) -> bool:
        strides = tuple(layer.strides)
        # Dilated filter gradients are refused by oneDNN's depthwise kernel: replayed per example.
        return (layer.data_format == "channels_last" and strides[0] == strides[1]
                and tuple(layer.dilation_rate) == (1, 1)
                and getattr(layer, "quantization_mode", None) is None and layer.kernel.trainable)

    def variables(self, layer):
        return [layer.kernel] + ([layer.bias] if layer.use_bias and layer.bias.trainable else [])

    def tapped_call(self, layer, original_call, recordings, inputs):
        z = keras.ops.depthwise_conv(inputs, layer.kernel, strides=layer.strides, padding=layer.padding,
                                     data_format=layer.data_format, dilation_rate=layer.dilation_rate)
        if layer.use_bias:
            z = keras.ops.add(z, layer.bias)
        recordings.append(Recording(inputs, [z]))
        return layer.activation(z) if layer.activation is not None else z

    def contribution(self, layer, recordings, output_grads):
        kernel, bias = 0.0, 0.0
        for recording, (grad,) in zip(recordings, output_grads):
            grad = tf.cast(tf.zeros_like(recording.watched[0]) if grad is None else grad, tf.float32)
            kernel += self._per_example_filter_grads(layer, tf.cast(recording.inputs, tf.float32), grad)
            bias += tf.reduce_sum(grad, axis=[1, 2])
        grads = [kernel] + ([bias] if len(self.variables(layer)) == 2 else [])
        return MaterializedContribution(grads)

    def _per_example_filter_grads(self, layer, inputs, grads) -> tf.Tensor:
        """[P, kh, kw, C, M] from one depthwise filter-gradient call (module docstring)."""
        kh, kw, channels, multiplier = layer.kernel.shape
        examples = tf.shape(inputs)[0]
        stride = layer.strides[0]
        filter_grad = tf.compat.v1.nn.depthwise_conv2d_native_backprop_filter(
            _examples_as_channels(inputs), tf.stack([kh, kw, examples * channels, multiplier]),
            _examples_as_channels(grads), strides=[1, stride, stride, 1], padding=layer.padding.upper())
        filter_grad = tf.reshape(filter_grad, tf.stack([kh, kw, examples, channels, multiplier]))
        return tf.transpose(filter_grad, [2, 0, 1, 3, 4])


register_ghost_rule(keras.layers.DepthwiseConv2D, DepthwiseConv2DRule())
