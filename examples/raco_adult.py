"""RaCO-DP on UCI Adult: demographic parity (sex) under differential privacy.

Logistic regression (or a small MLP) trained by RateConstrainedModel with the privacy
settings of the RaCO-DP paper's code: Poisson batch 4096, σ = 4, Laplace histogram scale 2
(b = 0.5), C = 3, δ = 1e-4; the number of steps is the largest whose joint (Gaussian +
Laplace) ε meets --epsilon (18 at ε = 1). The paper code's step sizes (primal 0.05, dual
0.15, temperature 2) barely move a DP-SGD model that averages by L in 18 steps here
(test accuracy 0.763, λ stays 0); the defaults below (primal 1.0, dual 5.0, temperature 1)
were chosen on the TRAINING split and reach the paper's operating point.

    python examples/raco_adult.py --epsilon=1 --max_gap=0.15

The Gaussian and Laplace noise and the Poisson batches come from fresh OS entropy;
``--noise_seed`` reproduces a run bit for bit but voids the guarantee (examples/_seeds.py).

The last line is exactly: test_accuracy=<float> test_gap=<float> epsilon=<float>
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

import tf_dp  # noqa: E402
from tf_dp import raco  # noqa: E402
from _seeds import define_seed_flags, noise_seed, warn_if_fixed_noise  # noqa: E402
from tf_dp.data import load_adult  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_float("epsilon", 1.0, "Target ε of the whole run (joint Gaussian + Laplace accounting).")
flags.DEFINE_float("max_gap", 0.15, "Demographic-parity gap γ.")
define_seed_flags()
flags.DEFINE_float("delta", 1e-4, "δ.")
flags.DEFINE_integer("batch_size", 4096, "Expected Poisson batch size.")
flags.DEFINE_float("noise_multiplier", 4.0, "σ of the gradient noise.")
flags.DEFINE_float("histogram_noise", 2.0, "Laplace scale 1/b of the histogram noise.")
flags.DEFINE_float("l2_norm_clip", 3.0, "C.")
flags.DEFINE_float("learning_rate", 1.0, "Primal learning rate (DP-SGD).")
flags.DEFINE_float("dual_learning_rate", 5.0, "Dual learning rate η_λ.")
flags.DEFINE_float("temperature", 1.0, "Softmax temperature of the histogram.")
flags.DEFINE_enum("model", "logistic", ["logistic", "mlp"], "Model.")
flags.DEFINE_integer("max_steps", None, "Cap on the number of steps (smoke tests).")
flags.DEFINE_bool("constrained", True, "False trains unconstrained DP-SGD with the same budget (baseline).")


def demographic_parity_gap(model, x, groups) -> float:
    predicted = model.predict(x, verbose=0).argmax(axis=1)
    return float(abs(predicted[groups == 0].mean() - predicted[groups == 1].mean()))


def build(num_features: int) -> raco.RateConstrainedModel:
    inputs = keras.Input((num_features,))
    hidden = inputs if FLAGS.model == "logistic" else keras.layers.Dense(32, activation="relu")(inputs)
    return raco.RateConstrainedModel(inputs, keras.layers.Dense(2, activation="softmax")(hidden))


def main(argv):
    del argv
    warn_if_fixed_noise()
    keras.utils.set_random_seed(FLAGS.seed)
    data = load_adult()
    n = len(data.y_train)
    steps = raco.calibrate_steps(FLAGS.epsilon, n, FLAGS.batch_size, FLAGS.noise_multiplier, FLAGS.histogram_noise,
                                 delta=FLAGS.delta, accountant="pld")
    steps = min(steps, FLAGS.max_steps or steps)
    model = build(data.x_train.shape[1])
    model.compile(
        optimizer=tf_dp.DPSGD(FLAGS.learning_rate, l2_norm_clip=FLAGS.l2_norm_clip,
                              noise_multiplier=FLAGS.noise_multiplier, seed=noise_seed()),
        loss="sparse_categorical_crossentropy", metrics=["accuracy"], delta=FLAGS.delta, accountant="pld",
        constraints=[raco.DemographicParity(FLAGS.max_gap if FLAGS.constrained else 1.0)], num_groups=2,
        histogram_noise=FLAGS.histogram_noise, dual_learning_rate=FLAGS.dual_learning_rate,
        histogram_temperature=FLAGS.temperature,
    )
    model.fit(data.x_train, data.y_train, groups=data.sensitive_train, batch_size=FLAGS.batch_size, epochs=1,
              steps_per_epoch=steps, sampling_seed=noise_seed(), verbose=2)
    accuracy = model.evaluate(data.x_test, data.y_test, verbose=0)[1]
    gap = demographic_parity_gap(model, data.x_test, data.sensitive_test)
    print(f"steps={steps} lambda={np.round(model.multipliers.numpy(), 4).tolist()}")
    warn_if_fixed_noise()
    print(f"test_accuracy={accuracy:.4f} test_gap={gap:.4f} epsilon={model.get_epsilon():.4f}")


if __name__ == "__main__":
    app.run(main)
