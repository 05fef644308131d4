"""Ghost rule for ``Conv1D``/``Conv2D`` (channels_last, groups = 1) via unfolded patches.

A convolution is a Dense layer applied at every output position t to the unfolded input
patch a_it ∈ R^{kh·kw·C_in}: z_it = a_it W + b with W the kernel reshaped to
[kh·kw·C_in, C_out]. So the Dense sequence rule applies with T = number of output
positions, and picks per layer between the Gram form (T²(d+k)) and explicit per-example
A_iᵀS_i (T·d·k), as mixed ghost clipping does.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_dp.clipping.dense import DenseContribution
from tf_dp.clipping.registry import Contribution, GhostRule, Recording, register_ghost_rule


def _patches(layer, inputs: tf.Tensor) -> tf.Tensor:
    """[P, T, kh·kw·C_in] unfolded input patches, flattened like the kernel."""
    if layer.rank == 1:
        inputs = inputs[:, :, None, :]
        sizes, strides, rates = (layer.kernel_size[0], 1), (layer.strides[0], 1), (layer.dilation_rate[0], 1)
    else:
        sizes, strides, rates = layer.kernel_size, layer.strides, layer.dilation_rate
    patches = tf.image.extract_patches(
        inputs, sizes=[1, *sizes, 1], strides=[1, *strides, 1], rates=[1, *rates, 1], padding=layer.padding.upper()
    )
    return tf.reshape(patches, tf.stack([tf.shape(patches)[0], -1, tf.shape(patches)[-1]]))


def _trainable_bias(layer) -> bool:
    return layer.use_bias and layer.bias.trainable


class ConvContribution(Contribution):
    """The Dense contribution of the unfolded layer, with the kernel folded back."""

    def __init__(self, dense: DenseContribution, kernel_shape):
        self.dense, self.kernel_shape = dense, kernel_shape

    def squared_norms(self):
        return self.dense.squared_norms()

    def weighted_sums(self, clip_factors):
        kernel, *bias = self.dense.weighted_sums(clip_factors)
        return [tf.reshape(kernel, self.kernel_shape), *bias]


class ConvRule(GhostRule):
    def applies_to(self, layer) -> bool:
        return (
            layer.rank in (1, 2)
            and layer.data_format == "channels_last"
            and layer.groups == 1
            and layer.padding in ("valid", "same")
            and not getattr(layer, "lora_enabled", False)
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
        patches, grads = [], []
        for recording, (grad,) in zip(recordings, output_grads):
            grad = tf.zeros_like(recording.watched[0]) if grad is None else grad
            patches.append(_patches(layer, recording.inputs))
            grads.append(tf.reshape(grad, tf.stack([tf.shape(grad)[0], -1, layer.filters])))
        dense = DenseContribution(tf.concat(patches, axis=1), tf.concat(grads, axis=1), _trainable_bias(layer),
                                  flat=False)
        return ConvContribution(dense, layer.kernel.shape)


register_ghost_rule(keras.layers.Conv1D, ConvRule())
register_ghost_rule(keras.layers.Conv2D, ConvRule())
