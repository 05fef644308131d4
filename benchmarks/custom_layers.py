"""Step time of DP-SGD on models with layers that have no registered ghost rule (issue 33,
item 9): keras.io's Antirectifier (a custom layer: a kernel matmul after x − mean,
l2-normalize and [relu(x), relu(−x)]) and SeparableConv2D (depthwise then pointwise conv).
Both get their ghost norms from the op-level rule (tf_dp/clipping/op_rules.py). The
baselines write the same computations with stock layers that have registered rules
(``dense_baseline``, ``separable_baseline``): the cost of DP with ghost rules on that model.

Each round times the DP step (``DPModel.train_on_batch``, σ = 1), a plain Keras step
(``keras.Model.train_on_batch``, SGD) and the noise floor (the plain step plus one Philox
Gaussian per parameter) of the same architecture in the same process, alternating, and prints
the ratio DP ÷ plain per round and its median; also the clipped gradient sum alone
(``clipped_gradient_sum`` compiled) ÷ the plain gradient alone: the cost of the ghost and
op-level rules without the step around them (noise, optimizer, the DP step's checks).

    TF_CPP_MIN_LOG_LEVEL=2 python benchmarks/custom_layers.py
    TF_CPP_MIN_LOG_LEVEL=2 python benchmarks/custom_layers.py --models=antirectifier --rounds=5 --steps=20

``--clock=process`` times the CPU time of the whole process (all TF pool threads) instead of the
elapsed time: robust on a loaded machine. ``--output=benchmarks/results/custom_layers.json``
writes the medians with their provenance (benchmarks/record.py).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import keras
import numpy as np
import tensorflow as tf
from absl import app, flags
from keras import ops

import tf_dp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/record.py, also when loaded by path
from record import write_json  # noqa: E402  (writes the command, commit, machine and date)
from noise_floor import NoiseFloorModel  # noqa: E402  (the plain step plus its noise draw)

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["antirectifier", "separable_conv"], "Models to time.")
flags.DEFINE_integer("batch_size", 128, "Batch size (keras.io's Antirectifier example uses 128).")
flags.DEFINE_integer("rounds", 5, "Alternating rounds (DP, plain).")
flags.DEFINE_integer("steps", 10, "Steps per timing.")
flags.DEFINE_enum("clock", "wall", ["wall", "thread", "process"], "wall: elapsed time; thread: CPU time of the "
                  "calling thread (host Python and dispatch only); process: CPU time of all the process's threads "
                  "(the kernels included) — the robust measure on a loaded machine.")
flags.DEFINE_string("output", "", "If set, write the results as JSON here (e.g. "
                    "benchmarks/results/custom_layers.json).")


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
    return _ms_per_call(lambda: model.train_on_batch(x, y, **kwargs), steps)


def _ms_per_call(call, steps):
    start = _now()
    for _ in range(steps):
        call()
    return (_now() - start) / steps * 1000


def _now() -> float:
    clocks = {"wall": time.perf_counter, "thread": time.thread_time, "process": time.process_time}
    return clocks[FLAGS.clock]()


def _gradient_functions(model, x, y):
    """(the clipped sum alone, the plain gradient alone) as compiled functions of the same
    model: what the ghost and op-level rules cost over a gradient, without the step around them."""
    per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    x, y, mask = tf.constant(x), tf.constant(y), tf.ones([len(y)])

    @tf.function
    def clipped():
        return tf_dp.clipping.clipped_gradient_sum(model, per_example, x, y, mask, 1.0).clipped_sums

    @tf.function
    def gradient():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(per_example(y, model(x, training=True)))
        return tape.gradient(loss, model.trainable_variables)

    return clipped, gradient


def _build(name, cls, loss, optimizer):
    keras.utils.set_random_seed(0)
    inputs, outputs, x = MODELS[name]()
    model = cls(inputs, outputs)
    model.compile(optimizer=optimizer, loss=loss)
    return model, x


def measure(name):
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    private, x = _build(name, tf_dp.DPModel, loss, tf_dp.DPSGD(0.1, noise_multiplier=1.0, seed=0))
    plain, _ = _build(name, keras.Model, loss, keras.optimizers.SGD(0.1))
    floor, _ = _build(name, NoiseFloorModel, loss, keras.optimizers.SGD(0.1))
    y = np.random.randint(0, 10, FLAGS.batch_size)
    timed = {"dp": lambda: private.train_on_batch(x, y, batch_size=len(y)), "plain": lambda: plain.train_on_batch(x, y),
             "floor": lambda: floor.train_on_batch(x, y)}
    timed["clipped_sum"], timed["gradient"] = _gradient_functions(plain, x, y)
    for call in timed.values():  # trace outside the timings
        _ms_per_call(call, 2)
    times = {key: [] for key in timed}
    for round_ in range(FLAGS.rounds):
        for key, call in timed.items():
            times[key].append(_ms_per_call(call, FLAGS.steps))
        print(f"{name} round {round_}: " + ", ".join(f"{key} {t[-1]:.1f} ms" for key, t in times.items())
              + f"; DP ÷ plain {times['dp'][-1] / times['plain'][-1]:.2f}", flush=True)
    ratio = [d / p for d, p in zip(times["dp"], times["plain"])]
    result = {"model": name, "batch_size": FLAGS.batch_size, "clock": FLAGS.clock, "rounds": FLAGS.rounds,
              "steps": FLAGS.steps, **{f"{key}_ms": statistics.median(t) for key, t in times.items()},
              "ratio": statistics.median(ratio), "ratios": [round(r, 3) for r in ratio],
              "floor_ratio": statistics.median(f / p for f, p in zip(times["floor"], times["plain"])),
              "clipping_ratio": statistics.median(c / g for c, g in zip(times["clipped_sum"], times["gradient"]))}
    print(f"{name}: median DP ÷ plain = {result['ratio']:.2f}, noise floor ÷ plain = {result['floor_ratio']:.2f}, "
          f"clipped sum ÷ gradient = {result['clipping_ratio']:.2f} (batch {FLAGS.batch_size}, {FLAGS.clock} clock)",
          flush=True)
    return result


def main(_):
    results = [measure(name) for name in FLAGS.models]
    if FLAGS.output:
        write_json(FLAGS.output, {"date": time.strftime("%Y-%m-%d"), "results": results}, indent=2)


if __name__ == "__main__":
    app.run(main)
