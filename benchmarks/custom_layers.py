"""Step time of DP-SGD on models with layers that have no registered ghost rule (issue 33,
item 9): keras.io's Antirectifier (a custom layer: a kernel matmul after x − mean,
l2-normalize and [relu(x), relu(−x)]) and SeparableConv2D (depthwise then pointwise conv).
Both get their ghost norms from the op-level rule (tf_dp/clipping/op_rules.py). The
baselines write the same computations with stock layers that have registered rules
(``dense_baseline``, ``separable_baseline``): the cost of DP with ghost rules on that model.

Each round times the DP step (``DPModel.train_on_batch``, σ = 1) and a plain Keras step
(``keras.Model.train_on_batch``, SGD) of the same architecture in the same process,
alternating, and prints the ratio DP ÷ plain per round and its median.

    TF_CPP_MIN_LOG_LEVEL=2 python benchmarks/custom_layers.py
    TF_CPP_MIN_LOG_LEVEL=2 python benchmarks/custom_layers.py --models=antirectifier --rounds=5 --steps=20
"""

from __future__ import annotations

import statistics
import time

import keras
import numpy as np
from absl import app, flags
from keras import ops

import tf_dp

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["antirectifier", "separable_conv"], "Models to time.")
flags.DEFINE_integer("batch_size", 128, "Batch size (keras.io's Antirectifier example uses 128).")
flags.DEFINE_integer("rounds", 5, "Alternating rounds (DP, plain).")
flags.DEFINE_integer("steps", 10, "Steps per timing.")


class Antirectifier(keras.layers.Layer):
    """As in keras.io/examples/keras_recipes/antirectifier (with the l2 normalization of its
    original version)."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1] * 2, input_shape[-1]), initializer="he_normal",
                                      name="kernel")

    def call(self, inputs):
        inputs -= ops.mean(inputs, axis=-1, keepdims=True)
        inputs = ops.normalize(inputs, axis=-1)
        concatenated = ops.concatenate([ops.relu(inputs), ops.relu(-inputs)], axis=-1)
        return ops.matmul(concatenated, self.kernel)


def antirectifier():
    inputs = keras.Input((784,))
    x = keras.layers.Dense(256)(inputs)
    x = Antirectifier()(x)
    x = keras.layers.Dense(256)(x)
    x = Antirectifier()(x)
    x = keras.layers.Dropout(0.1)(x)
    return inputs, keras.layers.Dense(10)(x), np.random.rand(FLAGS.batch_size, 784).astype("float32")


def dense_baseline():
    """The Antirectifier model with each Antirectifier replaced by a Dense of the same kernel
    (512 → 256, no bias) on [relu(x), relu(−x)] built from stock layers: the cost of a Dense rule."""
    inputs = keras.Input((784,))
    x = keras.layers.Dense(256)(inputs)
    x = keras.layers.Dense(256, use_bias=False)(keras.layers.Concatenate()([keras.layers.ReLU()(x),
                                                                            keras.layers.ReLU()(-x)]))
    x = keras.layers.Dense(256)(x)
    x = keras.layers.Dense(256, use_bias=False)(keras.layers.Concatenate()([keras.layers.ReLU()(x),
                                                                            keras.layers.ReLU()(-x)]))
    x = keras.layers.Dropout(0.1)(x)
    return inputs, keras.layers.Dense(10)(x), np.random.rand(FLAGS.batch_size, 784).astype("float32")


def separable_conv():
    inputs = keras.Input((28, 28, 1))
    x = keras.layers.Conv2D(16, 3, activation="relu")(inputs)
    x = keras.layers.SeparableConv2D(32, 3, activation="relu")(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.SeparableConv2D(64, 3, activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return inputs, keras.layers.Dense(10)(x), np.random.rand(FLAGS.batch_size, 28, 28, 1).astype("float32")


def separable_baseline():
    """separable_conv with each SeparableConv2D written as DepthwiseConv2D then a 1×1 Conv2D
    (stock layers with registered rules; biases and activation placed as SeparableConv2D's)."""
    inputs = keras.Input((28, 28, 1))
    x = keras.layers.Conv2D(16, 3, activation="relu")(inputs)
    x = keras.layers.Conv2D(32, 1, activation="relu")(keras.layers.DepthwiseConv2D(3, use_bias=False)(x))
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(64, 1, activation="relu")(keras.layers.DepthwiseConv2D(3, use_bias=False)(x))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return inputs, keras.layers.Dense(10)(x), np.random.rand(FLAGS.batch_size, 28, 28, 1).astype("float32")


MODELS = {"antirectifier": antirectifier, "dense_baseline": dense_baseline, "separable_conv": separable_conv,
          "separable_baseline": separable_baseline}


def _ms_per_step(model, x, y, steps):
    kwargs = {"batch_size": len(y)} if isinstance(model, tf_dp.DPModel) else {}
    start = time.perf_counter()
    for _ in range(steps):
        model.train_on_batch(x, y, **kwargs)
    return (time.perf_counter() - start) / steps * 1000


def measure(name):
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    keras.utils.set_random_seed(0)
    inputs, outputs, x = MODELS[name]()
    private = tf_dp.DPModel(inputs, outputs)
    private.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0, seed=0), loss=loss)
    inputs, outputs, _ = MODELS[name]()
    plain = keras.Model(inputs, outputs)
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    y = np.random.randint(0, 10, FLAGS.batch_size)
    for model in (private, plain):  # trace outside the timings
        _ms_per_step(model, x, y, 2)
    ratios = []
    for round_ in range(FLAGS.rounds):
        dp = _ms_per_step(private, x, y, FLAGS.steps)
        base = _ms_per_step(plain, x, y, FLAGS.steps)
        ratios.append(dp / base)
        print(f"{name} round {round_}: DP {dp:.1f} ms, plain {base:.1f} ms, ratio {dp / base:.2f}", flush=True)
    print(f"{name}: median DP ÷ plain = {statistics.median(ratios):.2f} (batch {FLAGS.batch_size})", flush=True)


def main(_):
    for name in FLAGS.models:
        measure(name)


if __name__ == "__main__":
    app.run(main)
