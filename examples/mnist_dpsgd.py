"""DP-SGD on MNIST: the main job (README's first command).

Trains the tensorflow-privacy tutorial CNN with Poisson sampling, prints ε and accuracy
each epoch, and reports final test accuracy and ε (RDP, δ = 1e-5).

    python examples/mnist_dpsgd.py                       # σ = 1.1, 60 epochs (ε ≈ 2.6)
    python examples/mnist_dpsgd.py --target_epsilon=1.0  # σ calibrated to ε = 1
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
from absl import app, flags  # noqa: E402

import tf_dp  # noqa: E402
from tf_dp.data import load_mnist  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_float("learning_rate", 0.25, "SGD learning rate.")
flags.DEFINE_float("momentum", 0.0, "SGD momentum.")
flags.DEFINE_float("l2_norm_clip", 1.0, "Per-example clip bound C.")
flags.DEFINE_float("noise_multiplier", 1.1, "σ; ignored when --target_epsilon is set.")
flags.DEFINE_float("target_epsilon", None, "Calibrate σ to this ε for the planned epochs.")
flags.DEFINE_float("delta", 1e-5, "δ of the (ε, δ) guarantee.")
flags.DEFINE_integer("batch_size", 256, "Expected Poisson batch size L.")
flags.DEFINE_integer("epochs", 60, "Epochs (⌈N/L⌉ steps each).")
flags.DEFINE_integer("train_examples", None, "Use only the first N training examples (smoke tests).")
flags.DEFINE_enum("accountant", "rdp", ["rdp", "pld"], "Privacy accountant.")
flags.DEFINE_integer("seed", 0, "Seed of the initial weights (public).")
flags.DEFINE_integer("noise_seed", None, "Secret seed of the noise and the Poisson batches, for a reproducible run; "
                     "default: fresh OS entropy (never saved). Whoever knows it can subtract the noise.")
flags.DEFINE_bool("jit_compile", False, "XLA (measured slower on CPU; see README).")


def tutorial_cnn() -> tf_dp.DPModel:
    """The CNN of tensorflow-privacy's MNIST tutorial."""
    inputs = keras.Input((28, 28, 1))
    x = keras.layers.Conv2D(16, 8, strides=2, padding="same", activation="relu")(inputs)
    x = keras.layers.MaxPooling2D(2, 1)(x)
    x = keras.layers.Conv2D(32, 4, strides=2, padding="valid", activation="relu")(x)
    x = keras.layers.MaxPooling2D(2, 1)(x)
    x = keras.layers.Dense(32, activation="relu")(keras.layers.Flatten()(x))
    return tf_dp.DPModel(inputs, keras.layers.Dense(10)(x))


def main(argv):
    del argv
    keras.utils.set_random_seed(FLAGS.seed)
    data = load_mnist()
    x_train, y_train = data.x_train[: FLAGS.train_examples], data.y_train[: FLAGS.train_examples]
    model = tutorial_cnn()
    sigma = None if FLAGS.target_epsilon else FLAGS.noise_multiplier
    model.compile(
        optimizer=tf_dp.DPSGD(FLAGS.learning_rate, l2_norm_clip=FLAGS.l2_norm_clip, noise_multiplier=sigma,
                              momentum=FLAGS.momentum, seed=FLAGS.noise_seed),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        delta=FLAGS.delta,
        accountant=FLAGS.accountant,
        target_epsilon=FLAGS.target_epsilon,
        jit_compile=FLAGS.jit_compile,
    )
    start = time.time()
    model.fit(x_train, y_train, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs,
              validation_data=(data.x_test, data.y_test), sampling_seed=FLAGS.noise_seed, verbose=2)
    _, accuracy = model.evaluate(data.x_test, data.y_test, verbose=0)
    steps = int(model.privacy_ledger.steps.numpy())
    print(f"final: test accuracy = {accuracy:.4f}, epsilon = {model.get_epsilon():.3f} "
          f"(delta = {FLAGS.delta:g}, {FLAGS.accountant.upper()}, sigma = {model.optimizer.noise_multiplier:.4f}, "
          f"{steps} Poisson steps, {time.time() - start:.0f} s)")


if __name__ == "__main__":
    app.run(main)
