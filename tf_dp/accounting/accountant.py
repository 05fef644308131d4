"""ε of DP-SGD from Google's ``dp_accounting`` (what tensorflow-privacy wraps).

Each Poisson-sampled step is ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))``; steps
compose. RDP is the default (tensorflow-privacy's convention), PLD is tighter.
Known answer (ALGORITHMS §1): N=60000, L=256, σ=1.1, 60 epochs, δ=1e-5 → RDP 2.597,
PLD 2.382.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Optional

from absl import logging as absl_logging
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from tf_dp import _checks

ACCOUNTANTS = ("rdp", "pld")
# tensorflow-privacy's RDP orders, so ε matches its `compute_dp_sgd_privacy`.
RDP_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512]
PLD_DISCRETIZATION = 1e-4


def _accountant(name: str):
    _checks.one_of("accountant", name, ACCOUNTANTS)
    if name == "rdp":
        return rdp_privacy_accountant.RdpAccountant(RDP_ORDERS)
    return pld_privacy_accountant.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)


def epsilon_of_event(event: dp_event.DpEvent, delta: float, accountant: str = "rdp") -> float:
    """ε at ``delta`` of any ``dp_accounting`` event."""
    delta = _checks.delta(delta)
    engine = _accountant(accountant)
    with _quiet_absl():
        engine.compose(event)
        return float(engine.get_epsilon(delta))


@contextlib.contextmanager
def _quiet_absl():
    """dp_accounting logs a warning for each fractional RDP order it drops as
    non-convergent (a harmless exclusion); keep `fit` output readable."""
    previous = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)
    try:
        yield
    finally:
        absl_logging.set_verbosity(previous)


def steps_for(num_examples: int, batch_size: int, epochs: Optional[float], steps: Optional[int]) -> int:
    """T = ⌈epochs · N / L⌉, or ``steps`` if given (exactly one of the two)."""
    if (epochs is None) == (steps is None):
        raise ValueError("Pass exactly one of `epochs` or `steps`.")
    if steps is not None:
        return _checks.positive_int("steps", steps)
    epochs = _checks.positive("epochs", epochs)
    return int(math.ceil(epochs * num_examples / batch_size))


def dp_sgd_event(sampling_rate: float, noise_multiplier: float, steps: int) -> dp_event.DpEvent:
    """T Poisson-subsampled Gaussian steps; σ = 0 is non-private (ε = ∞)."""
    if noise_multiplier == 0:
        return dp_event.NonPrivateDpEvent()
    step = dp_event.PoissonSampledDpEvent(sampling_rate, dp_event.GaussianDpEvent(noise_multiplier))
    return dp_event.SelfComposedDpEvent(step, steps)


def _check_problem(num_examples, batch_size, noise_multiplier=None):
    num_examples = _checks.positive_int("num_examples", num_examples)
    batch_size = _checks.batch_size_for(num_examples, batch_size)
    if noise_multiplier is not None:
        noise_multiplier = _checks.non_negative("noise_multiplier", noise_multiplier)
    return num_examples, batch_size, noise_multiplier


def compute_epsilon(
    num_examples: int,
    batch_size: int,
    noise_multiplier: float,
    epochs: Optional[float] = None,
    steps: Optional[int] = None,
    delta: float = 1e-5,
    accountant: str = "rdp",
) -> float:
    """ε of DP-SGD with Poisson sampling at rate q = batch_size / num_examples for T steps."""
    num_examples, batch_size, noise_multiplier = _check_problem(num_examples, batch_size, noise_multiplier)
    total_steps = steps_for(num_examples, batch_size, epochs, steps)
    event = dp_sgd_event(batch_size / num_examples, noise_multiplier, total_steps)
    return epsilon_of_event(event, delta, accountant)


def calibrate_noise_multiplier(
    target_epsilon: float,
    num_examples: int,
    batch_size: int,
    epochs: Optional[float] = None,
    steps: Optional[int] = None,
    delta: float = 1e-5,
    accountant: str = "rdp",
    prior_event: Optional[dp_event.DpEvent] = None,
) -> float:
    """Smallest σ (to 0.1 % relative) whose ε, composed after ``prior_event``, is ≤ target.

    Raises ``ValueError`` if the target is unreachable (e.g. ``prior_event`` already spent it).
    """
    target_epsilon = _checks.positive("target_epsilon", target_epsilon)
    num_examples, batch_size, _ = _check_problem(num_examples, batch_size)
    total_steps = steps_for(num_examples, batch_size, epochs, steps)
    rate = batch_size / num_examples

    def epsilon(sigma: float) -> float:
        event = dp_sgd_event(rate, sigma, total_steps)
        if prior_event is not None:
            event = dp_event.ComposedDpEvent([prior_event, event])
        return epsilon_of_event(event, delta, accountant)

    return _smallest_sigma_within(epsilon, target_epsilon)


def largest_fitting(fits: Callable[[int], bool], lowest: int, highest: int) -> int:
    """Largest n in [lowest, highest] with ``fits(n)``, for a predicate that holds up to some
    n and fails after (ε ≤ budget as steps grow); ``fits(lowest)`` must hold. Doubling, then
    bisection: O(log n) accountant calls."""
    good, bad = lowest, max(2 * lowest, lowest + 1)
    while bad <= highest and fits(bad):
        good, bad = bad, 2 * bad
    bad = min(bad, highest + 1)
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good


def _smallest_sigma_within(epsilon, target: float, relative_tolerance: float = 1e-3) -> float:
    high = 1.0
    while epsilon(high) > target:
        high *= 2
        if high > 1e4:
            raise ValueError(
                f"target_epsilon={target} is unreachable: even noise_multiplier=1e4 exceeds it "
                "(was the budget already spent by earlier training?). Raise target_epsilon."
            )
    low = high / 2 if high > 1.0 else 0.0
    while high - low > relative_tolerance * high:
        middle = (low + high) / 2
        if epsilon(middle) > target:
            low = middle
        else:
            high = middle
    return high
