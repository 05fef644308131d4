"""Seconds spent in privacy accounting, the original algorithms vs the current ones, in one process.

    python benchmarks/calibration_speed.py            # calibration, budget search, compile+fit
    python benchmarks/calibration_speed.py --pld      # also one PLD calibration (~15 s more)

Original: every ε composed from scratch in a fresh dp_accounting accountant; σ calibration
by doubling from 1 then bisection to 0.1 %; the budget's step search (doubling, then
bisection) likewise. Current: per-step RDP curves cached per (step, order) and scaled by
T; σ predicted by a secant on log ε vs log σ, then the bisection's final interval checked
exactly (tf_dp/accounting/accountant.py). Both give the same σ and step counts, which the
script checks. Caches are cleared before every timed run of the current code.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from dp_accounting import dp_event  # noqa: E402

import tf_dp  # noqa: E402
from tf_dp.accounting import accountant, ledger  # noqa: E402
from tf_dp.models import fitting  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_bool("fit", True, "Also time compile(target_epsilon=2) + fit on 512 rows × 2 epochs.")
flags.DEFINE_bool("pld", False, "Also time one PLD calibration (the original takes ~12 PLD compositions).")

CALIBRATIONS = [
    # name, target ε, N, L, epochs, δ
    ("512 rows, L=32, 2 epochs, ε=2", 2.0, 512, 32, 2, 1e-5),
    ("MNIST, L=256, 60 epochs, ε=3", 3.0, 60000, 256, 60, 1e-5),
    ("MNIST, L=1024, 30 epochs, ε=1", 1.0, 60000, 1024, 30, 1e-5),
    ("CIFAR-10, L=4096, 100 epochs, ε=8", 8.0, 50000, 4096, 100, 1e-5),
]


# -- the original algorithms -----------------------------------------------------------------

def original_calibration(target_epsilon, num_examples, batch_size, epochs=None, steps=None, delta=1e-5,
                         accountant_name="rdp", prior_event=None, **_):
    total_steps = accountant.steps_for(num_examples, batch_size, epochs, steps)

    def epsilon(sigma):
        event = accountant.dp_sgd_event(batch_size / num_examples, sigma, total_steps)
        if prior_event is not None:
            event = dp_event.ComposedDpEvent([prior_event, event])
        return accountant._epsilon_by_accountant(event, delta, accountant_name)

    high = 1.0
    while epsilon(high) > target_epsilon:
        high *= 2
    low = high / 2 if high > 1.0 else 0.0
    while high - low > 1e-3 * high:
        middle = (low + high) / 2
        low, high = (middle, high) if epsilon(middle) > target_epsilon else (low, middle)
    return high


def original_epsilon_of_event(event, delta, accountant_name="rdp"):
    return accountant._epsilon_by_accountant(event, delta, accountant_name)


# -- timing ----------------------------------------------------------------------------------

def timed(action):
    accountant._step_rdp.cache_clear()
    start = time.perf_counter()
    result = action()
    return result, time.perf_counter() - start


def report(name, original, current):
    (old_result, old_seconds), (new_result, new_seconds) = original, current
    same = "same" if old_result == new_result else f"DIFFERENT ({old_result} vs {new_result})"
    print(f"{name:44s} original {old_seconds:7.3f} s   current {new_seconds:6.3f} s   "
          f"×{old_seconds / new_seconds:5.1f}   result {same}")
    return old_seconds, new_seconds


def calibrations(accountant_name="rdp", cases=CALIBRATIONS):
    totals = np.zeros(2)
    for name, target, n, batch, epochs, delta in cases:
        kwargs = dict(epochs=epochs, delta=delta)
        totals += report(
            f"calibrate σ ({accountant_name.upper()}): {name}",
            timed(lambda: original_calibration(target, n, batch, accountant_name=accountant_name, **kwargs)),
            timed(lambda: accountant.calibrate_noise_multiplier(target, n, batch, accountant=accountant_name,
                                                                **kwargs)),
        )
    return totals


def budget_search():
    """PrivacyBudget's question: the largest T with ε(T) ≤ 2 at the calibrated σ."""
    rate, sigma = 256 / 60000, 1.0

    def search(epsilon):
        return accountant.largest_fitting(
            lambda steps: epsilon(accountant.dp_sgd_event(rate, sigma, steps), 1e-5) <= 2.0, 0, 10**8)

    return report("budget search: largest T with ε ≤ 2 (MNIST)", timed(lambda: search(original_epsilon_of_event)),
                  timed(lambda: search(accountant.epsilon_of_event)))


class AccountingClock:
    """Wraps the accounting entry points fit uses, summing the seconds spent in them."""

    def __init__(self, calibrate, epsilon_of_event):
        self.seconds = 0.0
        self._calibrate, self._epsilon = calibrate, epsilon_of_event

    def _timed(self, function):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return wrapper

    def install(self):
        fitting.calibrate_noise_multiplier = self._timed(self._calibrate)
        ledger.epsilon_of_event = self._timed(self._epsilon)


def fit_once(clock):
    """compile(target_epsilon=2) + fit on 512 rows × 2 epochs (L = 32, T = 32 steps)."""
    clock.install()
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(512, 20)).astype("float32"), rng.integers(0, 2, 512)
    inputs = keras.Input((20,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(2)(keras.layers.Dense(32, activation="tanh")(inputs)))
    model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, seed=0), target_epsilon=2.0,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    start = time.perf_counter()
    model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    total = time.perf_counter() - start
    return (round(model.optimizer.noise_multiplier, 9), int(model.privacy_ledger.steps.numpy())), clock.seconds, total


def compile_and_fit():
    calibrate, epsilon = fitting.calibrate_noise_multiplier, ledger.epsilon_of_event
    try:
        fit_once(AccountingClock(calibrate, epsilon))  # warm up TF (tracing) outside the comparison
        old_result, old_accounting, old_total = fit_once(AccountingClock(original_calibration,
                                                                         original_epsilon_of_event))
        accountant._step_rdp.cache_clear()
        new_result, new_accounting, new_total = fit_once(AccountingClock(calibrate, epsilon))
    finally:
        fitting.calibrate_noise_multiplier, ledger.epsilon_of_event = calibrate, epsilon
    report("compile(target_epsilon=2)+fit: accounting", (old_result, old_accounting), (new_result, new_accounting))
    print(f"{'compile(target_epsilon=2)+fit: whole fit':44s} original {old_total:7.3f} s   current {new_total:6.3f} s")


def main(_):
    logging.set_verbosity(logging.ERROR)
    totals = calibrations()
    totals += budget_search()
    print(f"{'RDP calibrations + budget search, total':44s} original {totals[0]:7.3f} s   current {totals[1]:6.3f} s"
          f"   ×{totals[0] / totals[1]:5.1f}")
    if FLAGS.fit:
        compile_and_fit()
    if FLAGS.pld:
        calibrations("pld", CALIBRATIONS[:1])


if __name__ == "__main__":
    app.run(main)
