"""FIBER vs DP-AdamW (and DP-AdamBC) on MNIST or Fashion-MNIST at one ε.

Every optimizer trains the same MLP (784-256-64-10) from the same initial weights, with
the same Poisson batch size, epochs, clip bound and σ (calibrated by
``compile(target_epsilon=...)``, so all reach the same ε), and the same learning rate.
Each run draws its own noise key and Poisson batches from OS entropy; ``--noise_seed``
gives every run the same noise key and batches (bit-for-bit reproducible, paired) but
voids the guarantee (examples/_seeds.py).
Prints per-epoch ε, then test accuracy and the step time relative to DP-AdamW (timed after
training on throwaway copies at the same σ, the optimizers taking turns, so that load from
other jobs hits all of them alike).
FIBER evaluates the per-example gradient at two points (θ and θ + γd), so its step
costs up to two forward/backward passes.

    python examples/fiber_vs_adamw.py                                  # MNIST, ε = 4
    python examples/fiber_vs_adamw.py --dataset=fashion_mnist --target_epsilon=1

The full protocol (learning-rate tuning, 3 seeds, ε ∈ {1, 4, 8}, DP-SGD and DiSK too) is
``benchmarks/filtered_optimizers.py``; that module defines absl flags at import, so this
script is self-contained instead of importing it.
"""

from __future__ import annotations

import os
from typing import Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
from absl import app, flags  # noqa: E402

import tf_dp  # noqa: E402
from _seeds import define_seed_flags, noise_seed, warn_if_fixed_noise  # noqa: E402
from _timing import BatchClock, random_subset, time_steps  # noqa: E402
from tf_dp.data import load_fashion_mnist, load_mnist  # noqa: E402

OPTIMIZERS = ("fiber", "dpadamw", "dpadambc")
BASELINE = "dpadamw"

FLAGS = flags.FLAGS
flags.DEFINE_enum("dataset", "mnist", ["mnist", "fashion_mnist"], "Data set.")
flags.DEFINE_list("optimizers", list(OPTIMIZERS), f"Subset of {', '.join(OPTIMIZERS)}; must include {BASELINE}.")
flags.DEFINE_float("target_epsilon", 4.0, "ε of every run (σ calibrated for the planned steps).")
flags.DEFINE_float("delta", 1e-5, "δ of the (ε, δ) guarantee.")
flags.DEFINE_integer("epochs", 3, "Epochs (⌈N/L⌉ Poisson steps each).")
flags.DEFINE_integer("batch_size", 256, "Expected Poisson batch size L.")
flags.DEFINE_float("learning_rate", 1e-3, "Learning rate of every optimizer (Adam family).")
flags.DEFINE_float("l2_norm_clip", 1.0, "Per-example clip bound C.")
flags.DEFINE_integer("train_examples", None, "Train on N examples drawn at random (smoke tests).")
flags.DEFINE_integer("test_examples", None, "Evaluate on N test examples drawn at random (smoke tests).")
define_seed_flags("Seed of the initial weights and the random subsets (public: data-independent).")
flags.DEFINE_integer("timing_rounds", 3, "Timing rounds after training, optimizers taking turns (0: fit's own median).")
flags.DEFINE_integer("timing_steps", 20, "Steps per timing round.")


def make_optimizer(name: str, seed: Optional[int],
                   noise_multiplier: Optional[float] = None) -> keras.optimizers.Optimizer:
    """A tf_dp optimizer; σ None is left for ``compile(target_epsilon=...)`` to calibrate;
    ``seed`` None draws the noise key from the OS."""
    common = dict(l2_norm_clip=FLAGS.l2_norm_clip, noise_multiplier=noise_multiplier, seed=seed)
    if name == "fiber":
        return tf_dp.FIBER(FLAGS.learning_rate, **common)
    if name == "dpadamw":
        return tf_dp.DPAdamW(FLAGS.learning_rate, **common)
    if name == "dpadambc":
        return tf_dp.DPAdamW(FLAGS.learning_rate, noise_bias_correction=True, **common)
    raise ValueError(f"unknown optimizer {name!r}; choose from {OPTIMIZERS}")


def mlp(num_features: int, num_classes: int) -> tf_dp.DPModel:
    inputs = keras.Input((num_features,))
    x = keras.layers.Dense(256, activation="relu")(inputs)
    x = keras.layers.Dense(64, activation="relu")(x)
    return tf_dp.DPModel(inputs, keras.layers.Dense(num_classes)(x))


def compiled_model(name: str, initial_weights: list, num_features: int, num_classes: int,
                   noise_multiplier: Optional[float] = None) -> tf_dp.DPModel:
    """The MLP from ``initial_weights``, compiled with optimizer ``name``; σ calibrated to
    --target_epsilon unless ``noise_multiplier`` is given."""
    model = mlp(num_features, num_classes)
    model.set_weights(initial_weights)
    model.compile(optimizer=make_optimizer(name, noise_seed(), noise_multiplier),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                  delta=FLAGS.delta, target_epsilon=None if noise_multiplier is not None else FLAGS.target_epsilon)
    return model


def train_one(name: str, initial_weights: list, train, test, num_classes: int) -> dict:
    """One DP run from ``initial_weights``; returns accuracy, ε, σ and fit's median ms/step."""
    model = compiled_model(name, initial_weights, train[0].shape[1], num_classes)
    print(f"--- {name}", flush=True)
    clock = BatchClock()
    model.fit(*train, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs, callbacks=[clock],
              sampling_seed=noise_seed(), verbose=2)
    accuracy = model.evaluate(*test, batch_size=1024, verbose=0, return_dict=True)["accuracy"]
    result = {"accuracy": float(accuracy), "epsilon": model.get_epsilon(), "ms_per_step": clock.ms_per_step(),
              "sigma": float(model.optimizer.noise_multiplier), "steps": int(model.privacy_ledger.steps.numpy())}
    print(f"result {name}: test accuracy = {result['accuracy']:.4f}, epsilon = {result['epsilon']:.3f}, "
          f"sigma = {result['sigma']:.4f}, ms/step during training = {result['ms_per_step']:.1f}", flush=True)
    return result


def final_line(results: dict[str, dict]) -> str:
    accuracies = ", ".join(f"{name} = {r['accuracy']:.4f}" for name, r in results.items())
    base = results[BASELINE]["ms_per_step"]
    ratios = ", ".join(f"{name} {r['ms_per_step'] / base:.2f}x" for name, r in results.items() if name != BASELINE)
    epsilon = max(r["epsilon"] for r in results.values())
    return (f"final: {FLAGS.dataset} test accuracy: {accuracies}; step time vs {BASELINE}: {ratios}; "
            f"epsilon = {epsilon:.3f} (delta = {FLAGS.delta:g}, {results[BASELINE]['steps']} Poisson steps each)")


def main(argv):
    del argv
    names = [name.strip() for name in FLAGS.optimizers]
    if BASELINE not in names:
        raise app.UsageError(f"--optimizers must include {BASELINE}, the step-time baseline.")
    warn_if_fixed_noise()
    keras.utils.set_random_seed(FLAGS.seed)
    data = (load_mnist if FLAGS.dataset == "mnist" else load_fashion_mnist)(flatten=True)
    train = random_subset(data.x_train, data.y_train, FLAGS.train_examples, FLAGS.seed)
    test = random_subset(data.x_test, data.y_test, FLAGS.test_examples, FLAGS.seed)
    num_classes = len(data.class_names)
    initial_weights = mlp(train[0].shape[1], num_classes).get_weights()
    results = {name: train_one(name, initial_weights, train, test, num_classes) for name in names}
    if FLAGS.timing_rounds:  # throwaway copies at the same σ: the trained models are left as they are
        copies = {name: compiled_model(name, initial_weights, train[0].shape[1], num_classes, r["sigma"])
                  for name, r in results.items()}
        for name, ms in time_steps(copies, train, FLAGS.batch_size, FLAGS.timing_rounds, FLAGS.timing_steps).items():
            results[name]["ms_per_step"] = ms
        print(f"timing: median of {FLAGS.timing_rounds} rounds of {FLAGS.timing_steps} steps, optimizers taking turns, "
              f"L = {FLAGS.batch_size}", flush=True)
    warn_if_fixed_noise()
    print(final_line(results))


if __name__ == "__main__":
    app.run(main)
