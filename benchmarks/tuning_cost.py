"""What private hyperparameter tuning costs (docs/guides/tuning.md): ε of one run vs ε of a private
random search whose every trial is the main job's run (examples/mnist_dpsgd.py's recipe: MNIST,
N = 60000, Poisson L = 1024, 40 epochs of ⌈N/L⌉ = 59 steps as fit runs them, σ calibrated to
ε = 3 at δ = 1e-5), for E[K] = 5, 10, 20 trials; and the σ every trial needs for the SEARCH to
stay at ε = 3; last row, a FIXED number of runs composed (what a best-of-K over fixed runs
honestly costs). Accounting only (seconds).

    python benchmarks/tuning_cost.py
    python benchmarks/tuning_cost.py --target_epsilon=1
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

from dp_accounting import dp_event  # noqa: E402

from tf_dp.accounting import calibrate_noise_multiplier, calibrate_sigma, dp_sgd_event, epsilon  # noqa: E402
from tf_dp.tuning import (PoissonTrials, TruncatedNegativeBinomial, fit_steps, one_trial_epsilon,  # noqa: E402
                          trial_rdp, tuning_epsilon)
from tf_dp.tuning import calibrate_noise_multiplier as calibrate_search_sigma  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_float("target_epsilon", 3.0, "ε of one run of the main job (its σ is calibrated to it).")
flags.DEFINE_integer("num_examples", 60000, "N (MNIST's training set).")
flags.DEFINE_integer("batch_size", 1024, "Expected Poisson batch size L (the main job's recipe).")
flags.DEFINE_integer("epochs", 40, "Epochs (the main job's recipe).")
flags.DEFINE_float("delta", 1e-5, "δ.")
flags.DEFINE_list("means", ["5", "10", "20"], "E[K], the mean numbers of trials.")

FAMILIES = [
    ("logarithmic (η = 0)", lambda mean: TruncatedNegativeBinomial.with_mean(0.0, mean)),
    ("neg. binomial η = 0.5", lambda mean: TruncatedNegativeBinomial.with_mean(0.5, mean)),
    ("geometric (η = 1)", lambda mean: TruncatedNegativeBinomial.with_mean(1.0, mean)),
    ("Poisson", PoissonTrials),
]


def main(argv):
    del argv
    n, batch, epochs, delta = FLAGS.num_examples, FLAGS.batch_size, FLAGS.epochs, FLAGS.delta
    steps = fit_steps(n, batch, epochs)  # what fit runs (and compile(target_epsilon) calibrates for)
    sigma = calibrate_noise_multiplier(FLAGS.target_epsilon, n, batch, steps=steps, delta=delta)
    rdp = trial_rdp(dp_sgd_event(batch / n, sigma, steps))
    print(f"one run: N = {n}, L = {batch}, {epochs} epochs ({steps} steps), sigma = {sigma:.4f}: "
          f"epsilon = {one_trial_epsilon(rdp, delta):.3f} at delta = {delta:g} (RDP)")
    means = [float(m) for m in FLAGS.means]
    print("| K ~ | " + " | ".join(f"E[K] = {m:g}: ε of the search | σ for ε = {FLAGS.target_epsilon:g}"
                                     for m in means) + " |")
    print("|---|" + "---|---|" * len(means))
    for name, family in FAMILIES:
        cells = []
        for mean in means:
            distribution = family(mean)
            search_sigma = calibrate_search_sigma(FLAGS.target_epsilon, distribution, n, batch, steps=steps,
                                                  delta=delta)
            cells.append(f"{tuning_epsilon(rdp, delta, distribution):.2f} | {search_sigma:.3f}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    cells = []
    for mean in means:  # the honest alternative: a FIXED K = E[K] runs, composed
        def runs(noise, count=int(mean)):
            return dp_event.SelfComposedDpEvent(dp_sgd_event(batch / n, noise, steps), count)

        cells.append(f"{epsilon(runs(sigma), delta):.2f} | {calibrate_sigma(runs, FLAGS.target_epsilon, delta):.3f}")
    print("| fixed K = E[K], composed | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    app.run(main)
