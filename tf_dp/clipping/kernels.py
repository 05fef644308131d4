"""What the running TensorFlow's kernels support, probed once per process.

oneDNN's batched matmul (``_MklBatchMatMulV2``, TensorFlow 2.21) corrupts memory and kills
the process (SIGSEGV or a glibc "free(): invalid pointer" abort inside
``OneDnnThreadPool::parallel_for``) on a left operand whose batch axes are [B, 1] broadcast
against a right operand without batch axes — e.g. x [6, 1, 8, 16] @ W [16, 16]. That is
exactly what ``tf.vectorized_map`` makes of a layer applying ``matmul`` to one example
[1, T, d] (keras-hub's attention projections, LoRA adapters): the whole-model vectorized
engine aborted on keras-hub GPT-2 there. ``crash_prone_batch_matmuls`` finds such ops in a
traced graph before it runs (shapes that merely resemble the crash, e.g. other broadcasts
with a size-1 batch axis after a larger one, are flagged too: a false alarm costs a slower
per-example map, a miss costs the process).

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


@functools.lru_cache(maxsize=None)
def onednn_enabled() -> bool:
    """True iff this TensorFlow runs its oneDNN (MKL) CPU kernels."""
    try:
        from tensorflow.python.util import _pywrap_util_port
        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):  # pragma: no cover — no such switch: assume the kernels are there
        return True


_BATCH_MATMULS = ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")


def crash_prone_batch_matmuls(operations) -> list:
    """The batched matmuls among ``operations`` (graph ops with static shapes) of the shape
    oneDNN crashes on (module docstring): operands whose batch axes differ (broadcast) while
    one of them has a size-1 batch axis after an axis that is not 1. Empty when oneDNN is off."""
    if not onednn_enabled():
        return []
    risky = []
    for op in operations:
        if op.type not in _BATCH_MATMULS or len(op.inputs) < 2:
            continue
        shapes = [t.shape for t in op.inputs[:2]]
        if any(shape.rank is None for shape in shapes):
            risky.append(op)
            continue
        batches = [shape.as_list()[:-2] for shape in shapes]
        if batches[0] != batches[1] and any(_one_after_larger(batch) for batch in batches):
            risky.append(op)
    return risky


def _one_after_larger(batch: list) -> bool:
    return any(size == 1 and any(before != 1 for before in batch[:i]) for i, size in enumerate(batch))
