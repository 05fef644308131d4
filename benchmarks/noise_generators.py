"""Time of one step's Gaussian draw (670k normals: the 784-512-512-10 MLP) per generator.

    python benchmarks/noise_generators.py

tf_dp's keyed draw, a Box–Muller transform composed from Philox uniforms, the raw
counter-based Philox and ThreeFry ops, and Keras' / TF's stateful samplers, in graph mode
and under XLA; median of rounds, same process, samplers alternating within each round.
"""

from __future__ import annotations

import math
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

from tf_dp.noise.gaussian import _philox_normal, draw_seed  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("draws", 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10, "Normals per step.")
flags.DEFINE_integer("rounds", 7, "Rounds.")
flags.DEFINE_integer("steps", 50, "Draws per round.")


# The run's key, as in tf_dp: a runtime value (a constant key let XLA precompute part of
# ThreeFry's rounds and flattered it 1.6x).
KEY = tf.Variable(12345, dtype=tf.int64, trainable=False)


def stateless(alg: int):
    def draw(step):
        key = tf.reshape(tf.cast(KEY, tf.uint64), [1])
        counter = tf.stack([tf.constant(0, tf.uint64), tf.cast(step, tf.uint64)])
        return tf.raw_ops.StatelessRandomNormalV2(shape=[FLAGS.draws], key=key, counter=counter, alg=alg)

    return draw


def box_muller(step):
    """N(0, 1) composed from Philox bits: r = √(−2 ln u₁) with u₁ ∈ (0, 1] from 53 bits (float64),
    θ = 2π u₂ from 24 bits; the pair (r cos θ, r sin θ). The candidate against TF's fused kernel."""
    half = (FLAGS.draws + 1) // 2
    bits = tf.random.stateless_uniform([2, half], seed=tf.stack([KEY.read_value(), step]), minval=None,
                                       maxval=None, dtype=tf.uint64, alg="philox")
    u1 = (tf.cast(tf.bitwise.right_shift(bits[0], 11), tf.float64) + 1.0) * 2.0 ** -53
    radius = tf.cast(tf.sqrt(-2.0 * tf.math.log(u1)), tf.float32)
    angle = tf.cast(tf.bitwise.right_shift(bits[1], 40), tf.float32) * (2 * math.pi * 2.0 ** -24)
    return tf.reshape(tf.stack([radius * tf.cos(angle), radius * tf.sin(angle)]), [-1])[:FLAGS.draws]


def main(argv):
    del argv
    generator = tf.random.Generator.from_seed(1)
    seed = keras.random.SeedGenerator(1)
    samplers = {
        "tf_dp (tf.random.stateless_normal, philox)": lambda step: _philox_normal(
            [FLAGS.draws], draw_seed(KEY.read_value(), step, 0), tf.float32),
        "Box–Muller composed from Philox uniforms": box_muller,
        "philox (raw StatelessRandomNormalV2, key/counter)": stateless(1),
        "threefry (StatelessRandomNormalV2)": stateless(2),
        "tf.random.Generator (philox, stateful)": lambda step: generator.normal([FLAGS.draws]),
        "keras.random.normal (SeedGenerator)": lambda step: keras.random.normal([FLAGS.draws], seed=seed),
    }
    cells = {name: {} for name in samplers}
    for jit in (False, True):  # samplers alternate within each round
        functions = {}
        for name, sampler in samplers.items():
            function = tf.function(sampler, jit_compile=jit)
            try:
                function(tf.constant(0, tf.int64))
                functions[name] = function
            except Exception as error:  # e.g. an op without an XLA kernel
                cells[name][jit] = f"fails ({type(error).__name__})"
        rounds = {name: [] for name in functions}
        for _ in range(FLAGS.rounds):
            for name, function in functions.items():
                rounds[name].append(_ms_per_draw(function))
        for name, times in rounds.items():
            cells[name][jit] = f"{statistics.median(times):.2f}"
    print("| generator | graph ms/draw | XLA ms/draw |\n|---|---|---|")
    for name, by_jit in cells.items():
        print(f"| {name} | {by_jit[False]} | {by_jit[True]} |")


def _ms_per_draw(function) -> float:
    start = time.perf_counter()
    for step in range(FLAGS.steps):
        function(tf.constant(step, tf.int64)).numpy()
    return (time.perf_counter() - start) / FLAGS.steps * 1000


if __name__ == "__main__":
    app.run(main)
