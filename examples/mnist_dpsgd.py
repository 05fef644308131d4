"""DP-SGD on MNIST or Fashion-MNIST: the main job (README's first command).

Two recipes, both trained by DP-SGD with momentum, Poisson sampling, σ calibrated by the
accountant to the target ε, tanh activations (Papernot et al. 2021) and an exponential
moving average of the weights evaluated at the end (parameter averaging, free
post-processing):
  * ``--features=scattering`` (default): the order-2 scattering transform of every image
    (J = 2, L = 8: 81 × 7 × 7, fixed and data-independent, so free of privacy cost),
    GroupNorm without parameters, and Tramèr & Boneh's (2021) small tanh CNN on top;
  * ``--features=pixels``: the tensorflow-privacy tutorial CNN on the pixels.
Unset flags take the recipe's values (RECIPES, by data set and features). Prints ε and
accuracy each epoch, and the final test accuracy and ε (RDP, δ = 1e-5) on its last line.

    python examples/mnist_dpsgd.py                                # the main job's recipe (ε ≤ 3)
    python examples/mnist_dpsgd.py --target_epsilon=1.0           # σ calibrated to ε = 1
    python examples/mnist_dpsgd.py --noise_multiplier=1.1         # a fixed σ instead of a target ε
    python examples/mnist_dpsgd.py --dataset=fashion_mnist        # Fashion-MNIST's recipe
    python examples/mnist_dpsgd.py --features=pixels              # the tutorial CNN on pixels
    python examples/mnist_dpsgd.py --adaptive_clip --initial_clip_factor=10   # AdaptiveClip from C_0 = 10·C
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

import tf_dp  # noqa: E402
from _seeds import define_seed_flags, noise_seed, warn_if_fixed_noise  # noqa: E402
from tf_dp.data import load_fashion_mnist, load_mnist  # noqa: E402

LOADERS = {"mnist": load_mnist, "fashion_mnist": load_fashion_mnist}
# The pixel mean and standard deviation that the literature publishes for each training split
# (e.g. torchvision's MNIST examples); fixed constants here, nothing is computed from the data.
PUBLISHED_PIXEL_STATISTICS = {"mnist": (0.1307, 0.3081), "fashion_mnist": (0.2860, 0.3530)}
# The recipes (README, "Measured", has each one's accuracy at ε = 3): flags left unset take these.
RECIPES = {
    ("mnist", "scattering"): {"learning_rate": 2.0, "batch_size": 1024, "epochs": 40, "ema_momentum": 0.995},
    ("fashion_mnist", "scattering"): {"learning_rate": 4.0, "batch_size": 2048, "epochs": 40, "ema_momentum": 0.99},
    ("mnist", "pixels"): {"learning_rate": 0.5, "batch_size": 512, "epochs": 60, "ema_momentum": 0.997},
    ("fashion_mnist", "pixels"): {"learning_rate": 4.0, "batch_size": 2048, "epochs": 40, "ema_momentum": 0.99},
}

FLAGS = flags.FLAGS
flags.DEFINE_enum("dataset", "mnist", list(LOADERS), "Training and test data.")
flags.DEFINE_enum("features", "scattering", ["scattering", "pixels"],
                  "Scattering transform + small CNN (Tramèr & Boneh 2021), or the tutorial CNN on pixels.")
flags.DEFINE_enum("activation", "tanh", ["tanh", "relu"], "Activation of the hidden layers.")
flags.DEFINE_enum("input_scaling", "centered", ["centered", "standardized"],
                  "--features=pixels: pixels [0, 1] → [-1, 1] (data-independent), or standardized with the "
                  "published mean and std.")
flags.DEFINE_float("learning_rate", None, "SGD learning rate (default: the recipe's).")
flags.DEFINE_float("momentum", 0.9, "SGD momentum.")
flags.DEFINE_float("l2_norm_clip", 0.1, "Per-example clip bound C.")
flags.DEFINE_bool("adaptive_clip", False, "Quantile-adaptive clipping (tf_dp.clipping.AdaptiveClip, docs/algorithms.md "
                  "§12) started at C_0 = --initial_clip_factor · --l2_norm_clip.")
flags.DEFINE_float("initial_clip_factor", 1.0, "--adaptive_clip: C_0 as a multiple of --l2_norm_clip.")
flags.DEFINE_float("target_quantile", 0.5, "--adaptive_clip: γ, the share of examples meant to be unclipped.")
flags.DEFINE_float("clip_learning_rate", 0.2, "--adaptive_clip: η of C_{t+1} = C_t·exp(−η(b̃_t − γ)).")
flags.DEFINE_float("noise_multiplier", None, "A fixed σ; when set it overrides --target_epsilon.")
flags.DEFINE_float("target_epsilon", 3.0, "Calibrate σ to this ε for the planned epochs (unless --noise_multiplier).")
flags.DEFINE_float("delta", 1e-5, "δ of the (ε, δ) guarantee.")
flags.DEFINE_integer("batch_size", None, "Expected Poisson batch size L (default: the recipe's).")
flags.DEFINE_integer("epochs", None, "Epochs, ⌈N/L⌉ steps each (default: the recipe's).")
flags.DEFINE_float("ema_momentum", None, "β of the parameter average θ̄ that is evaluated and kept; 0 = no averaging "
                   "(default: the recipe's).")
flags.DEFINE_integer("ema_start_step", 0, "Optimizer step at which the average starts (θ̄ = θ before).")
flags.DEFINE_string("features_cache", None, "A .npz file of the scattering features (computed and written if absent, "
                    "read if present; no noise, key or batch in it): reruns skip the minutes of the transform.")
flags.DEFINE_integer("train_examples", None, "Use only the first N training examples (smoke tests).")
flags.DEFINE_integer("verbose", 2, "Keras' fit verbosity (2: one line per epoch, 1: a progress bar per epoch, 0: "
                     "silent); the scattering feature pass shows a progress bar unless 0.")
flags.DEFINE_enum("accountant", "rdp", ["rdp", "pld"], "Privacy accountant.")
define_seed_flags()
flags.DEFINE_bool("jit_compile", False, "XLA (measured slower on CPU; see README).")


def apply_recipe() -> None:
    """Unset hyperparameter flags take the recipe of (--dataset, --features)."""
    for name, value in RECIPES[FLAGS.dataset, FLAGS.features].items():
        if getattr(FLAGS, name) is None:
            setattr(FLAGS, name, value)
    print(f"recipe: {FLAGS.dataset}, {FLAGS.features}, lr = {FLAGS.learning_rate:g}, L = {FLAGS.batch_size}, "
          f"{FLAGS.epochs} epochs, C = {FLAGS.l2_norm_clip:g}, β = {FLAGS.ema_momentum:g}")


def input_scaling(scaling: str, dataset: str) -> keras.layers.Rescaling:
    """A fixed affine map of the [0, 1] pixels (no weights, nothing learned from the data)."""
    mean, std = (0.5, 0.5) if scaling == "centered" else PUBLISHED_PIXEL_STATISTICS[dataset]
    return keras.layers.Rescaling(1.0 / std, offset=-mean / std)


def tutorial_cnn(activation: str, scaling: keras.layers.Layer) -> tf_dp.DPModel:
    """The CNN of tensorflow-privacy's MNIST tutorial, behind a fixed input scaling."""
    inputs = keras.Input((28, 28, 1))
    x = scaling(inputs)
    x = keras.layers.Conv2D(16, 8, strides=2, padding="same", activation=activation)(x)
    x = keras.layers.MaxPooling2D(2, 1)(x)
    x = keras.layers.Conv2D(32, 4, strides=2, padding="valid", activation=activation)(x)
    x = keras.layers.MaxPooling2D(2, 1)(x)
    x = keras.layers.Dense(32, activation=activation)(keras.layers.Flatten()(x))
    return tf_dp.DPModel(inputs, keras.layers.Dense(10)(x))


def scatternet_cnn(activation: str) -> tf_dp.DPModel:
    """Tramèr & Boneh's CNN on 81 × 7 × 7 scattering features: GroupNorm (27 groups, no
    parameters, per example), 16 3×3/2 and 32 3×3 convolutions, a 32-unit dense layer."""
    inputs = keras.Input((7, 7, 81))
    x = keras.layers.GroupNormalization(27, center=False, scale=False)(inputs)
    x = keras.layers.Conv2D(16, 3, strides=2, padding="same", activation=activation)(x)
    x = keras.layers.Conv2D(32, 3, padding="same", activation=activation)(x)
    x = keras.layers.Dense(32, activation=activation)(keras.layers.Flatten()(x))
    return tf_dp.DPModel(inputs, keras.layers.Dense(10)(x))


def model_and_inputs(data, x_train):
    """The recipe's model, and its training and test inputs (scattering features, computed
    once, or the pixels)."""
    if FLAGS.features == "pixels":
        return tutorial_cnn(FLAGS.activation, input_scaling(FLAGS.input_scaling, FLAGS.dataset)), x_train, data.x_test
    if FLAGS.features_cache and os.path.exists(FLAGS.features_cache):
        with np.load(FLAGS.features_cache) as cached:
            if len(cached["train"]) == len(x_train) and len(cached["test"]) == len(data.x_test):
                print(f"scattering features read from {FLAGS.features_cache}")
                return scatternet_cnn(FLAGS.activation), cached["train"], cached["test"]
    start = time.time()
    print(f"scattering features (J = 2, L = 8) of the {len(x_train)} training and {len(data.x_test)} test images:")
    train = tf_dp.features.scattering_features(x_train, progress=FLAGS.verbose > 0)
    test = tf_dp.features.scattering_features(data.x_test, progress=FLAGS.verbose > 0)
    print(f"scattering features of {len(train) + len(test)} images: {train.shape[1:]} each, "
          f"{time.time() - start:.0f} s")
    if FLAGS.features_cache:
        np.savez(FLAGS.features_cache, train=train, test=test)
    return scatternet_cnn(FLAGS.activation), train, test


def dp_optimizer() -> tf_dp.DPSGD:
    """DP-SGD with momentum; with --ema_momentum > 0 it keeps the average θ̄ of the iterates."""
    averaging = {"use_ema": True, "ema_momentum": FLAGS.ema_momentum} if FLAGS.ema_momentum > 0 else {}
    return tf_dp.DPSGD(FLAGS.learning_rate, l2_norm_clip=clip_bound(), noise_multiplier=FLAGS.noise_multiplier,
                       momentum=FLAGS.momentum, seed=noise_seed(), **averaging)


def clip_bound():
    """C, or with --adaptive_clip ``AdaptiveClip`` from C_0 = factor·C (σ_b = L/20; docs/algorithms.md §12)."""
    if not FLAGS.adaptive_clip:
        return FLAGS.l2_norm_clip
    return tf_dp.clipping.AdaptiveClip(FLAGS.initial_clip_factor * FLAGS.l2_norm_clip,
                                       target_quantile=FLAGS.target_quantile, learning_rate=FLAGS.clip_learning_rate)


def final_clip_note(model) -> str:
    """With --adaptive_clip, the last clip bound C_T (public); else nothing."""
    if not FLAGS.adaptive_clip:
        return ""
    return f", C_0 = {clip_bound().initial:g}, C_T = {float(model.optimizer.l2_norm_clip):.4g}"


class TestSetLogs(keras.callbacks.Callback):
    """Names the per-epoch metrics of the (public) test set ``test_*`` instead of Keras'
    ``val_*``: nothing is selected or tuned on them, and there is no validation split."""

    def on_epoch_end(self, epoch, logs=None):
        for name in [k for k in (logs or {}) if k.startswith("val_")]:
            logs["test_" + name[len("val_"):]] = logs.pop(name)


def training_callbacks() -> list:
    """Parameter averaging (evaluation on θ̄, training on θ, left in the model after fit);
    the test-set metrics logged as ``test_*`` (runs before Keras' progress bar prints)."""
    averaging = tf_dp.ParameterAveraging(start_step=FLAGS.ema_start_step, swap_at_end=False)
    return ([averaging] if FLAGS.ema_momentum > 0 else []) + [TestSetLogs()]


def test_accuracy(model, x_test, y_test) -> float:
    """Test accuracy of the weights the model holds."""
    return model.evaluate(x_test, y_test, verbose=0)[1]


def final_test_accuracy(model, x_test, y_test) -> float:
    """Test accuracy of the released weights: θ̄ with averaging (the last iterate θ is printed
    for comparison), else θ."""
    if FLAGS.ema_momentum <= 0:
        return test_accuracy(model, x_test, y_test)
    print(f"last iterate (no averaging): test accuracy = {test_accuracy(model, x_test, y_test):.4f}")
    with tf_dp.averaging.averaged_weights(model):
        return test_accuracy(model, x_test, y_test)


def main(argv):
    del argv
    apply_recipe()
    warn_if_fixed_noise()
    keras.utils.set_random_seed(FLAGS.seed)
    data = LOADERS[FLAGS.dataset]()
    x_train, y_train = data.x_train[: FLAGS.train_examples], data.y_train[: FLAGS.train_examples]
    model, x_train, x_test = model_and_inputs(data, x_train)
    model.compile(
        optimizer=dp_optimizer(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        delta=FLAGS.delta,
        accountant=FLAGS.accountant,
        target_epsilon=None if FLAGS.noise_multiplier else FLAGS.target_epsilon,
        jit_compile=FLAGS.jit_compile,
    )
    start = time.time()
    model.fit(x_train, y_train, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs, callbacks=training_callbacks(),
              validation_data=(x_test, data.y_test), sampling_seed=noise_seed(),
              verbose=FLAGS.verbose)
    accuracy = final_test_accuracy(model, x_test, data.y_test)
    steps = int(model.privacy_ledger.steps.numpy())
    warn_if_fixed_noise()
    print(f"final: test accuracy = {accuracy:.4f}, epsilon = {model.get_epsilon():.3f} "
          f"(delta = {FLAGS.delta:g}, {FLAGS.accountant.upper()}, sigma = {model.optimizer.noise_multiplier:.4f}, "
          f"{steps} Poisson steps, {time.time() - start:.0f} s{final_clip_note(model)})")


if __name__ == "__main__":
    app.run(main)
