"""Adaptive clipping (docs/algorithms.md §12) on the main job: started 10× and 0.1× away from C.

The recipe of examples/mnist_dpsgd.py (the main job, scripts/main.sh) with
``l2_norm_clip=tf_dp.clipping.AdaptiveClip(factor·C)`` (γ = 0.5, η = 0.2, σ_b = L/20) for each
--factors, and the recipe's fixed C as the reference (``fixed``), all at the same ε (σ
calibrated by compile; the accountant composes the user's σ, the gradient gets σ_Δ > σ) and
the same epochs. Records the test accuracy of the released (averaged) weights and C_t per epoch.

    python benchmarks/adaptive_clip_mnist.py --epochs=10 --features_cache=/tmp/scattering.npz
    python benchmarks/adaptive_clip_mnist.py --factors=0.1,10 --train_examples=4096 --features=pixels  # smoke

Writes JSON (--output) after every run.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "examples")]  # this checkout's tf_dp and the recipe

import keras  # noqa: E402
from absl import app, flags  # noqa: E402

import mnist_dpsgd as recipe  # noqa: E402  (defines the recipe's flags)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/record.py, also when loaded by path
from record import write_json  # noqa: E402  (writes the command, commit, machine and date)

FLAGS = flags.FLAGS
flags.DEFINE_list("factors", ["fixed", "10", "0.1", "1"], "C_0 / C of each run; 'fixed' = the recipe's constant C.")
flags.DEFINE_string("output", "benchmarks/results/adaptive_clip_mnist.json", "Where to write the JSON results.")


class ClipTrace(keras.callbacks.Callback):
    """C_t at the end of every epoch (public), read from the optimizer's clip variable."""

    def __init__(self):
        super().__init__()
        self.clips = []

    def on_epoch_end(self, epoch, logs=None):
        self.clips.append(float(self.model.optimizer.l2_norm_clip))


def train_one(data, x_train, y_train, x_test, factor: str) -> tuple:
    """One run of the recipe with a fixed C or AdaptiveClip(factor·C); returns (row, inputs)."""
    FLAGS.adaptive_clip = factor != "fixed"
    FLAGS.initial_clip_factor = 1.0 if factor == "fixed" else float(factor)
    keras.utils.set_random_seed(FLAGS.seed)
    if x_test is None:
        model, x_train, x_test = recipe.model_and_inputs(data, x_train)
    else:
        model = recipe.scatternet_cnn(FLAGS.activation) if FLAGS.features == "scattering" else recipe.tutorial_cnn(
            FLAGS.activation, recipe.input_scaling(FLAGS.input_scaling, FLAGS.dataset))
    model.compile(optimizer=recipe.dp_optimizer(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], delta=FLAGS.delta, target_epsilon=FLAGS.target_epsilon)
    start, trace = time.time(), ClipTrace()
    model.fit(x_train, y_train, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs, verbose=0,
              callbacks=recipe.training_callbacks()[:-1] + [trace])
    accuracy = recipe.final_test_accuracy(model, x_test, data.y_test)
    clips = trace.clips
    row = {"factor": factor, "initial_clip": FLAGS.initial_clip_factor * FLAGS.l2_norm_clip,
           "final_clip": float(model.optimizer.l2_norm_clip), "clip_per_epoch": clips,
           "sigma": float(model.optimizer.noise_multiplier), "epsilon": float(model.get_epsilon()),
           "test_accuracy": float(accuracy), "seconds": time.time() - start}
    return row, x_train, x_test


def main(argv):
    del argv
    recipe.apply_recipe()
    data = recipe.LOADERS[FLAGS.dataset]()
    x_train, y_train = data.x_train[: FLAGS.train_examples], data.y_train[: FLAGS.train_examples]
    results = {"flags": {"features": FLAGS.features, "epochs": FLAGS.epochs, "batch_size": FLAGS.batch_size,
                         "learning_rate": FLAGS.learning_rate, "l2_norm_clip": FLAGS.l2_norm_clip,
                         "ema_momentum": FLAGS.ema_momentum, "target_epsilon": FLAGS.target_epsilon,
                         "target_quantile": FLAGS.target_quantile, "clip_learning_rate": FLAGS.clip_learning_rate,
                         "train_examples": len(y_train)},
               "runs": []}
    x_test = None
    for factor in FLAGS.factors:
        row, x_train, x_test = train_one(data, x_train, y_train, x_test, factor)
        results["runs"].append(row)
        print(f"C_0 = {row['initial_clip']:g} ({factor}): C_T = {row['final_clip']:.4g}, σ = {row['sigma']:.3f}, "
              f"ε = {row['epsilon']:.3f}, test accuracy = {row['test_accuracy']:.4f}, {row['seconds']:.0f} s",
              flush=True)
        write_json(FLAGS.output, results)
    print("\n| C_0 / C | C_0 | C_T | ε | test accuracy |\n|---|---|---|---|---|")
    for row in results["runs"]:
        print(f"| {row['factor']} | {row['initial_clip']:g} | {row['final_clip']:.4g} | {row['epsilon']:.3f} | "
              f"{100 * row['test_accuracy']:.2f} % |")
    print(f"wrote {FLAGS.output}")


if __name__ == "__main__":
    app.run(main)
