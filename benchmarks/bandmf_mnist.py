"""BandMF (banded matrix-factorization noise, docs/algorithms.md §10) vs DP-SGD on MNIST.

Two parts:
  1. cost of the noise: ms per privatize call on the recipe model's trainable variables
     (graph mode) and the secret buffer's memory, b·|θ| floats, for DP-SGD and each b;
  2. accuracy at ε ∈ --epsilons with the same epochs: DP-SGD (σ calibrated by compile) and
     BandMF(b) (σ calibrated to the amplified-BandMF account, §10.3), the recipe of
     examples/mnist_dpsgd.py (the main job, scripts/main.sh). Part 2 needs the DP optimizers'
     ``noise=`` and fit's cyclic Poisson sampling; without them it is reported as skipped.

    python benchmarks/bandmf_mnist.py --quick          # < 3 min: pixels CNN, 2048 examples, 1 epoch, ε = 3, b = 4,
                                                       # no averaging
    python benchmarks/bandmf_mnist.py                  # the full study: DP-SGD and BandMF(4) (hours on 2 CPU cores)
    python benchmarks/bandmf_mnist.py --epochs=10 --features_cache=/tmp/scattering.npz   # fewer epochs, both arms

Prints Markdown tables and writes JSON (--output).
"""

from __future__ import annotations

import inspect
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "examples")]  # this checkout's tf_dp and the recipe

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import mnist_dpsgd as recipe  # noqa: E402  (defines the recipe's flags)
import tf_dp  # noqa: E402
from tf_dp.accounting.bandmf import calibrate_bandmf_noise_multiplier  # noqa: E402
from tf_dp.noise import BandMF  # noqa: E402
from tf_dp.noise.privatizer import GaussianNoise  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/record.py, also when loaded by path
from record import write_json  # noqa: E402  (writes the command, commit, machine and date)

FLAGS = flags.FLAGS
flags.DEFINE_bool("quick", False, "A < 3 min smoke run: pixels CNN, 2048 examples, 1 epoch, ε = 3, b = 4 for accuracy.")
flags.DEFINE_list("epsilons", ["1", "3", "8"], "Target ε of the accuracy runs.")
flags.DEFINE_list("bands", ["2", "4", "8", "16"], "Numbers of bands b timed (and trained, unless --quick).")
flags.DEFINE_list("train_bands", ["4"], "Numbers of bands b trained beside DP-SGD (same epochs; --quick: 4).")
flags.DEFINE_integer("timing_steps", 50, "privatize calls per timing round.")
flags.DEFINE_integer("timing_rounds", 5, "Alternating timing rounds (the median is reported).")
flags.DEFINE_string("output", "benchmarks/results/bandmf_mnist.json", "Where to write the JSON results.")


def recipe_model() -> keras.Model:
    """The recipe's model, built (no data needed): the scattering CNN or the pixels CNN."""
    if FLAGS.features == "pixels":
        return recipe.tutorial_cnn(FLAGS.activation, recipe.input_scaling(FLAGS.input_scaling, FLAGS.dataset))
    return recipe.scatternet_cnn(FLAGS.activation)


def time_privatizer(privatizer, variables) -> float:
    """Median ms per privatize call (zero sums, σC = 1) over rounds, graph mode."""
    privatizer.build(variables)
    zeros = [tf.zeros_like(v) for v in variables]
    key = tf.constant(12345, tf.int64)

    @tf.function
    def run(first):
        for i in tf.range(FLAGS.timing_steps, dtype=tf.int64):
            noisy = privatizer.privatize(zeros, tf.constant(1.0), key, first + i)
        return noisy[0][0]

    run(tf.constant(0, tf.int64))  # trace
    times = []
    for r in range(FLAGS.timing_rounds):
        start = time.perf_counter()
        run(tf.constant((r + 1) * FLAGS.timing_steps, tf.int64)).numpy()
        times.append((time.perf_counter() - start) / FLAGS.timing_steps * 1e3)
    return statistics.median(times)


def noise_cost() -> list:
    variables = recipe_model().trainable_variables
    parameters = sum(int(np.prod(v.shape)) for v in variables)
    rows = [{"noise": "DP-SGD", "bands": 1, "ms_per_step": time_privatizer(GaussianNoise(), variables),
             "buffer_MB": 0.0, "parameters": parameters}]
    for bands in [int(b) for b in FLAGS.bands]:
        privatizer = BandMF(bands)
        ms = time_privatizer(privatizer, variables)
        rows.append({"noise": f"BandMF({bands})", "bands": bands, "ms_per_step": ms,
                     "buffer_MB": privatizer.buffer_bytes() / 2**20, "parameters": parameters})
    print(f"\nnoise cost per step, {parameters} parameters ({FLAGS.features} model), graph mode, "
          f"median of {FLAGS.timing_rounds} rounds × {FLAGS.timing_steps} calls:\n")
    print("| noise | ms/step | buffer MB |\n|---|---|---|")
    for row in rows:
        print(f"| {row['noise']} | {row['ms_per_step']:.3f} | {row['buffer_MB']:.3f} |")
    return rows


def integrated() -> bool:
    """Whether the DP optimizers take ``noise=`` (fit then samples what the privatizer needs)."""
    return "noise" in inspect.signature(tf_dp.DPSGD.__init__).parameters


def train_one(data, x_train, y_train, x_test, epsilon: float, bands: int) -> tuple:
    """One run of the recipe at ``epsilon``: DP-SGD (bands = 1) or BandMF(bands); returns (results, the
    model's training and test inputs, reused by the next run)."""
    keras.utils.set_random_seed(FLAGS.seed)
    model, x_train, x_test = recipe.model_and_inputs(data, x_train) if x_test is None else (recipe_model(), x_train,
                                                                                             x_test)
    n, steps_per_epoch = len(y_train), int(np.ceil(len(y_train) / FLAGS.batch_size))
    averaging = {"use_ema": True, "ema_momentum": FLAGS.ema_momentum} if FLAGS.ema_momentum > 0 else {}
    if bands == 1:
        noise, sigma, target = None, None, epsilon
    else:
        noise, target = BandMF(bands), None
        sigma = calibrate_bandmf_noise_multiplier(epsilon, n, FLAGS.batch_size, bands,
                                                  steps=steps_per_epoch * FLAGS.epochs, delta=FLAGS.delta)
    optimizer = tf_dp.DPSGD(FLAGS.learning_rate, l2_norm_clip=FLAGS.l2_norm_clip, noise_multiplier=sigma,
                            momentum=FLAGS.momentum, noise=noise, **averaging)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], delta=FLAGS.delta, target_epsilon=target)
    start = time.time()
    model.fit(x_train, y_train, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs, verbose=0,
              callbacks=recipe.training_callbacks()[:-1])
    seconds = time.time() - start
    accuracy = recipe.final_test_accuracy(model, x_test, data.y_test)
    return {"epsilon_target": epsilon, "bands": bands, "sigma": float(model.optimizer.noise_multiplier),
            "epsilon": float(model.get_epsilon()), "test_accuracy": float(accuracy), "seconds": seconds,
            "ms_per_step": seconds / (steps_per_epoch * FLAGS.epochs) * 1e3}, x_train, x_test


def accuracy_study(results: dict) -> list:
    if not integrated():
        print("\naccuracy study skipped: tf_dp.DPSGD has no `noise=` yet (the privatizer is not wired into the "
              "optimizers and fit).")
        return []
    data = recipe.LOADERS[FLAGS.dataset]()
    x_train, y_train = data.x_train[: FLAGS.train_examples], data.y_train[: FLAGS.train_examples]
    bands_trained = [4] if FLAGS.quick else [int(b) for b in FLAGS.train_bands]
    bands_trained = [1] + [b for b in bands_trained if b != 1]
    rows, x_test = results["accuracy"], None
    for epsilon in [float(e) for e in FLAGS.epsilons]:
        for bands in bands_trained:
            row, x_train, x_test = train_one(data, x_train, y_train, x_test, epsilon, bands)
            rows.append(row)
            print(f"ε = {epsilon:g}, {'DP-SGD' if bands == 1 else f'BandMF({bands})'}: σ = {row['sigma']:.3f}, "
                  f"ε = {row['epsilon']:.3f}, test accuracy = {row['test_accuracy']:.4f}, "
                  f"{row['ms_per_step']:.0f} ms/step", flush=True)
            write(results)  # a partial study still yields its finished runs
    return rows


def configure() -> None:
    if FLAGS.quick:
        FLAGS.features, FLAGS.train_examples, FLAGS.epochs, FLAGS.epsilons = "pixels", 2048, 1, ["3"]
        FLAGS.batch_size, FLAGS.timing_steps, FLAGS.timing_rounds = 128, 20, 3
        FLAGS.ema_momentum = 0.0  # 16 steps: report the last iterate, not an average still near the start
        if FLAGS.output == FLAGS["output"].default:
            FLAGS.output = "benchmarks/results/bandmf_mnist_quick.json"
    recipe.apply_recipe()


def main(argv):
    del argv
    configure()
    results = {"flags": {"quick": FLAGS.quick, "features": FLAGS.features, "epochs": FLAGS.epochs,
                         "batch_size": FLAGS.batch_size, "train_examples": FLAGS.train_examples,
                         "learning_rate": FLAGS.learning_rate, "l2_norm_clip": FLAGS.l2_norm_clip,
                         "ema_momentum": FLAGS.ema_momentum},
               "noise_cost": noise_cost(), "accuracy": []}
    write(results)
    accuracy_study(results)
    write(results)


def write(results: dict) -> None:
    write_json(FLAGS.output, results)
    print(f"wrote {FLAGS.output}", flush=True)


if __name__ == "__main__":
    app.run(main)
