"""Time of one step's Gaussian draw (670k normals: the 784-512-512-10 MLP) per generator.

    python benchmarks/noise_generators.py

Counter-based (stateless) Philox and ThreeFry, and Keras' / TF's stateful samplers, in
graph mode and under XLA; median of rounds, same process.
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("draws", 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10, "Normals per step.")
flags.DEFINE_integer("rounds", 7, "Rounds.")
flags.DEFINE_integer("steps", 50, "Draws per round.")


def stateless(alg: int):
    def draw(step):
        key = tf.constant([12345], tf.uint64)
        counter = tf.stack([tf.constant(0, tf.uint64), tf.cast(step, tf.uint64)])
        return tf.raw_ops.StatelessRandomNormalV2(shape=[FLAGS.draws], key=key, counter=counter, alg=alg)

    return draw


def main(argv):
    del argv
    generator = tf.random.Generator.from_seed(1)
    seed = keras.random.SeedGenerator(1)
    samplers = {
        "philox (StatelessRandomNormalV2)": stateless(1),
        "threefry (StatelessRandomNormalV2)": stateless(2),
        "tf.random.Generator (philox, stateful)": lambda step: generator.normal([FLAGS.draws]),
        "keras.random.normal (SeedGenerator)": lambda step: keras.random.normal([FLAGS.draws], seed=seed),
    }
    print("| generator | graph ms/draw | XLA ms/draw |\n|---|---|---|")
    for name, sampler in samplers.items():
        cells = []
        for jit in (False, True):
            function = tf.function(sampler, jit_compile=jit)
            try:
                function(tf.constant(0, tf.int64))
            except Exception as error:  # e.g. an op without an XLA kernel
                cells.append(f"fails ({type(error).__name__})")
                continue
            rounds = []
            for _ in range(FLAGS.rounds):
                start = time.perf_counter()
                for step in range(FLAGS.steps):
                    function(tf.constant(step, tf.int64)).numpy()
                rounds.append((time.perf_counter() - start) / FLAGS.steps * 1000)
            cells.append(f"{statistics.median(rounds):.2f}")
        print(f"| {name} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    app.run(main)
