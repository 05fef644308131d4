"""What the running TensorFlow's kernels support, probed once per process.

A grouped convolution's filter gradient (``Conv2DBackpropFilter`` with fewer filter input
channels than image channels) has a CPU kernel only when oneDNN is on; TensorFlow leaves
oneDNN off on many CPUs (AMD, AVX2-only Intel, ARM, macOS) or when
``TF_ENABLE_ONEDNN_OPTS=0``. Rather than guess from the CPU or the environment, a tiny
grouped filter gradient is run eagerly and its outcome cached.
"""

from __future__ import annotations

import functools

import tensorflow as tf


@functools.lru_cache(maxsize=None)
def grouped_conv_filter_gradient_available() -> bool:
    """True iff a grouped ``Conv2DBackpropFilter`` (2 groups) runs on the default device."""
    with tf.init_scope():  # eager even while a tf.function is being traced
        image, grads = tf.ones([1, 3, 3, 2]), tf.ones([1, 2, 2, 2])
        try:
            tf.compat.v1.nn.conv2d_backprop_filter(image, [2, 2, 1, 2], grads, [1, 1, 1, 1], "VALID")
        except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError, tf.errors.NotFoundError):
            return False
    return True


def grouped_conv_layers(layer) -> list:
    """``layer`` and its sublayers that are Keras convolutions with ``groups > 1``."""
    import keras

    return [sub for sub in layer._flatten_layers(include_self=True)
            if isinstance(sub, keras.src.layers.convolutional.base_conv.BaseConv) and getattr(sub, "groups", 1) > 1]


def require_grouped_conv_kernels(layers, route: str) -> None:
    """Raises a ValueError naming the grouped convolutions among ``layers`` if ``route``
    (a per-example replay by ``vectorized_map``) would need the missing kernel."""
    if grouped_conv_filter_gradient_available():
        return
    grouped = [sub.name for layer in layers for sub in grouped_conv_layers(layer)]
    if grouped:
        raise ValueError(
            f"{route} cannot differentiate the grouped convolution layer(s) {sorted(set(grouped))} per example: "
            "this TensorFlow has no kernel for a grouped convolution's filter gradient (oneDNN is off, as on AMD, "
            "AVX2-only Intel, ARM and macOS CPUs, or TF_ENABLE_ONEDNN_OPTS=0). Use engine='ghost', whose Conv1D/"
            "Conv2D rule handles groups > 1 (channels_last, 'valid'/'same' padding), or enable oneDNN.")
