"""The "rdp" and "pld" accountants (Google's ``dp_accounting``, what tensorflow-privacy wraps),
``compute_epsilon`` and σ calibration (docs/algorithms.md, appendix A).

Each phase becomes a dp_accounting event by its scheme (``tf_dp.accounting.events``); events
compose. RDP is the default everywhere (tensorflow-privacy's convention), PLD is tighter.
Known answer (docs/algorithms.md §1): N=60000, L=256, σ=1.1, 60 epochs, δ=1e-5 → RDP 2.597,
PLD 2.382.

Speed without changing a single result:

* RDP composes additively, so ε of any composition of Poisson-sampled Gaussian steps is

      ε = min_α conv_δ(α, Σ_k T_k · RDP_α(q_k, σ_k)),

  and the per-step RDP_α(q, σ) — computed by dp_accounting's RDP accountant for ONE step,
  the expensive part — is cached per (step, order). ε for any step count, ledger or budget
  search then costs one sum and one conversion; the numbers are dp_accounting's bit for bit.
* σ calibration predicts σ* with a secant on log ε against log σ (nearly a straight line),
  replays the original bisection against the prediction, and then checks the two ends of
  the bisection's final interval exactly; only if a check fails does it bisect as before.
  The answer is the original bisection's, with ~2 full evaluations instead of ~12.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Callable, Optional

import numpy as np

from absl import logging as absl_logging
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from dp_accounting.pld import privacy_loss_distribution

from tf_dp import _checks
from tf_dp.accounting.events import (
    DEFAULT_ACCOUNTANT,
    Phase,
    StepEvent,
    check_accountant,
    epsilon,
    phase_event,
    register_accountant,
    step_events,
)

ACCOUNTANTS = ("rdp", "pld")  # the built-in accountants (plug-ins may register more)
# tensorflow-privacy's RDP orders, so ε matches its `compute_dp_sgd_privacy`.
RDP_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512]
PLD_DISCRETIZATION = 1e-4
LARGEST_NOISE_MULTIPLIER = 2.0**13  # σ calibration doubles σ from 1 up to here, then gives up


def _accountant(name: str):
    _checks.one_of("accountant", name, ACCOUNTANTS)
    if name == "rdp":
        return rdp_privacy_accountant.RdpAccountant(RDP_ORDERS)
    return pld_privacy_accountant.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)


def epsilon_of_event(event: dp_event.DpEvent, delta: float, accountant: str = DEFAULT_ACCOUNTANT) -> float:
    """ε at ``delta`` of any ``dp_accounting`` event (``tf_dp.accounting.events.epsilon``).

    Args:
      event: a ``dp_accounting`` DpEvent.
      delta: δ in (0, 1).
      accountant: a registered accountant ("rdp" default, "pld").

    Returns:
      ε at ``delta``.

    Raises:
      TypeError: ``event`` is not a DpEvent.
      ValueError: ``delta`` or ``accountant`` is invalid.
    """
    if not isinstance(event, dp_event.DpEvent):
        raise TypeError(f"`event` must be a dp_accounting DpEvent, got {type(event).__name__}.")
    return epsilon(event, delta, accountant)


@register_accountant("rdp")
def rdp_epsilon(event: dp_event.DpEvent, delta: float) -> float:
    """ε = min_α rdp_α + log(1 − 1/α) − log(δα)/(α − 1) (dp_accounting's conversion) of the
    event's RDP: from cached per-step RDP curves at ``RDP_ORDERS`` when the event is built of
    (Poisson-sampled) Gaussian steps; at the orders every ``StepEvent`` supports when it holds
    plug-in steps; else by composing the event in a fresh dp_accounting RdpAccountant."""
    rdp = rdp_of_event(event)
    if rdp is not None:
        return _epsilon_from_rdp(rdp, delta)[0]
    plugins = step_events(event)
    if plugins:
        orders = tuple(a for a in RDP_ORDERS if all(a in set(p.rdp_orders) for p in plugins))
        if not orders:
            raise ValueError("The plug-in steps of this event share no RDP order with RDP_ORDERS: "
                             "use accountant='pld'.")
        total = np.zeros(len(orders), dtype=np.float64)
        _add_rdp(total, event, 1, orders, plugins=True)
        return _epsilon_from_rdp(total, delta, orders)[0]
    return _epsilon_by_accountant(event, delta, "rdp")


@register_accountant("pld")
def pld_epsilon(event: dp_event.DpEvent, delta: float) -> float:
    """ε at δ of the event's privacy loss distribution (value discretization 1e-4): dp_accounting's
    PLDAccountant, or — when the event holds plug-in ``StepEvent``s — each step's PLD
    (``StepEvent.pld``, dp_accounting's ``from_gaussian_mechanism`` / ``from_laplace_mechanism``
    otherwise) self-composed and composed in the event's order."""
    if not step_events(event):
        return _epsilon_by_accountant(event, delta, "pld")
    try:
        pld = _pld_of(event)
    except _NotPrivate:
        return math.inf
    return 0.0 if pld is None else float(pld.get_epsilon_for_delta(delta))


def _epsilon_by_accountant(event: dp_event.DpEvent, delta: float, accountant: str) -> float:
    """ε composed by a fresh dp_accounting accountant (the reference the fast path equals)."""
    engine = _accountant(accountant)
    with _quiet_absl():
        engine.compose(event)
        return float(engine.get_epsilon(delta))


class _NotPrivate(Exception):
    """A NonPrivateDpEvent inside a composition: ε = ∞."""


def _pld_of(event: dp_event.DpEvent):
    """The PLD of ``event`` (None: no privacy loss), composed as the events are nested."""
    if isinstance(event, dp_event.NoOpDpEvent):
        return None
    if isinstance(event, dp_event.NonPrivateDpEvent):
        raise _NotPrivate()
    if isinstance(event, dp_event.SelfComposedDpEvent):
        inner = _pld_of(event.event)
        return None if inner is None or event.count == 0 else inner.self_compose(event.count)
    if isinstance(event, dp_event.ComposedDpEvent):
        composed = None
        for part in event.events:
            pld = _pld_of(part)
            if pld is not None:
                composed = pld if composed is None else composed.compose(pld)
        return composed
    return _step_pld(event)


def _step_pld(event: dp_event.DpEvent):
    """The PLD of one step: a plug-in's own, or dp_accounting's for its Gaussian / Laplace steps."""
    if isinstance(event, StepEvent):
        return event.pld(PLD_DISCRETIZATION)
    rate, inner = (event.sampling_probability, event.event) if isinstance(event, dp_event.PoissonSampledDpEvent) \
        else (1.0, event)
    if type(inner) is dp_event.GaussianDpEvent:
        return privacy_loss_distribution.from_gaussian_mechanism(
            inner.noise_multiplier, sampling_prob=rate, value_discretization_interval=PLD_DISCRETIZATION)
    if type(inner) is dp_event.LaplaceDpEvent:
        return privacy_loss_distribution.from_laplace_mechanism(
            inner.parameter, sampling_prob=rate, value_discretization_interval=PLD_DISCRETIZATION)
    raise ValueError(f"{type(event).__name__} cannot be composed with plug-in steps under PLD "
                     "(supported: Gaussian and Laplace steps, Poisson-sampled or not).")


# -- RDP curves: one step's RDP per order, reused for every step count ---------------------

def rdp_of_event(event: dp_event.DpEvent, orders=RDP_ORDERS) -> Optional[np.ndarray]:
    """RDP at ``orders`` of ``event``, composed exactly as dp_accounting's ``RdpAccountant``
    does — Σ over its steps of count × per-step RDP, in the event's order — from cached
    per-step values. None if the event holds anything but (Poisson-sampled) Gaussian steps."""
    total = np.zeros(len(orders), dtype=np.float64)
    return total if _add_rdp(total, event, 1, tuple(float(a) for a in orders)) else None


def _add_rdp(total: np.ndarray, event: dp_event.DpEvent, count: int, orders: tuple, plugins: bool = False) -> bool:
    """total += RDP of ``count`` × ``event``; False if a step is not a (Poisson-sampled)
    Gaussian (with ``plugins``: a plug-in step adds its own RDP, any other step dp_accounting's)."""
    if isinstance(event, dp_event.NoOpDpEvent):
        return True
    if isinstance(event, dp_event.NonPrivateDpEvent):
        total += np.inf
        return True
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return _add_rdp(total, event.event, event.count * count, orders, plugins)
    if isinstance(event, dp_event.ComposedDpEvent):
        return all(_add_rdp(total, e, count, orders, plugins) for e in event.events)
    if plugins and isinstance(event, StepEvent):
        total += count * np.asarray(event.rdp(np.array(orders)), dtype=np.float64)
        return True
    if plugins or _is_gaussian_step(event):
        total += count * np.array([_step_rdp(event, order) for order in orders])
        return True
    return False


def _is_gaussian_step(event: dp_event.DpEvent) -> bool:
    if isinstance(event, dp_event.PoissonSampledDpEvent):
        event = event.event
    return type(event) is dp_event.GaussianDpEvent


@functools.lru_cache(maxsize=1 << 16)
def _step_rdp(step: dp_event.DpEvent, order: float) -> float:
    """RDP at ``order`` of ONE (Poisson-sampled) Gaussian step, by dp_accounting."""
    engine = rdp_privacy_accountant.RdpAccountant([order])
    with _quiet_absl():
        engine.compose(step)
    return float(engine.rdp[0])


def _epsilon_from_rdp(rdp: np.ndarray, delta: float, orders=RDP_ORDERS) -> tuple:
    """(ε, best order) at δ from an RDP curve: dp_accounting's conversion,
    ε = min_α rdp_α + log(1 − 1/α) − log(δα)/(α − 1)."""
    with _quiet_absl():
        epsilon, order = rdp_privacy_accountant.compute_epsilon(np.array(orders, dtype=np.float64), rdp, delta)
    return float(epsilon), float(order)


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
    """T = ⌈epochs · N / L⌉, or ``steps`` if given (exactly one of the two).

    Args:
      num_examples: N, the dataset size.
      batch_size: L, the expected batch size.
      epochs: passes over the data (positive), or None when ``steps`` is given.
      steps: the number of steps (positive int), or None when ``epochs`` is given.

    Returns:
      The number of steps T.

    Raises:
      ValueError: both or neither of ``epochs`` and ``steps`` are given, or one is not positive.
    """
    if (epochs is None) == (steps is None):
        raise ValueError("Pass exactly one of `epochs` or `steps`.")
    if steps is not None:
        return _checks.positive_int("steps", steps)
    epochs = _checks.positive("epochs", epochs)
    return int(math.ceil(epochs * num_examples / batch_size))


def dp_sgd_event(sampling_rate: float, noise_multiplier: float, steps: int) -> dp_event.DpEvent:
    """T Poisson-subsampled Gaussian steps (the "poisson" scheme's event); σ = 0 is non-private (ε = ∞).

    Args:
      sampling_rate: q, the Poisson sampling rate of each step.
      noise_multiplier: σ, the Gaussian noise's standard deviation over the clipping norm.
      steps: T, the number of steps.

    Returns:
      The DpEvent of the T steps.
    """
    return phase_event(Phase("poisson", sampling_rate, noise_multiplier, 0, 0.0, steps))


def _check_problem(num_examples, batch_size, noise_multiplier=None):
    num_examples = _checks.positive_int("num_examples", num_examples)
    batch_size = _checks.batch_size_for(num_examples, batch_size)
    if noise_multiplier is not None:
        noise_multiplier = _checks.non_negative("noise_multiplier", noise_multiplier)
    return num_examples, batch_size, noise_multiplier


def _planned_phase(scheme: str, num_examples: int, batch_size: int, noise_multiplier: float, steps: int,
                   parameter: float) -> Phase:
    """The phase T steps of ``scheme`` at q = L/N would record ("batches": q = 1)."""
    _checks.real("parameter", parameter)
    rate = 1.0 if scheme == "batches" else batch_size / num_examples
    return Phase(scheme, rate, noise_multiplier, num_examples, float(batch_size), steps, float(parameter))


def compute_epsilon(
    num_examples: int,
    batch_size: int,
    noise_multiplier: float,
    epochs: Optional[float] = None,
    steps: Optional[int] = None,
    delta: float = 1e-5,
    accountant: str = DEFAULT_ACCOUNTANT,
    scheme: str = "poisson",
    parameter: float = 0.0,
) -> float:
    """ε of T steps of ``scheme`` (default Poisson sampling at q = batch_size / num_examples).

    Args:
      num_examples: N.
      batch_size: the expected batch size L.
      noise_multiplier: σ (0: not private, ε = ∞).
      epochs, steps: exactly one; T = ⌈epochs · N / L⌉ or ``steps``.
      delta: δ.
      accountant: "rdp" (default) or "pld".
      scheme: a registered sampling scheme (``tf_dp.accounting.events``).
      parameter: the scheme's parameter (Phase.parameter), 0.0 for "poisson".

    Returns:
      ε of ``events.epsilon`` for the phase those steps would record.
    """
    num_examples, batch_size, noise_multiplier = _check_problem(num_examples, batch_size, noise_multiplier)
    total_steps = steps_for(num_examples, batch_size, epochs, steps)
    phase = _planned_phase(scheme, num_examples, batch_size, noise_multiplier, total_steps, parameter)
    return epsilon([phase], delta, accountant)


def calibrate_noise_multiplier(
    target_epsilon: float,
    num_examples: int,
    batch_size: int,
    epochs: Optional[float] = None,
    steps: Optional[int] = None,
    delta: float = 1e-5,
    accountant: str = DEFAULT_ACCOUNTANT,
    prior_event: Optional[dp_event.DpEvent] = None,
    scheme: str = "poisson",
    parameter: float = 0.0,
) -> float:
    """Smallest σ (to 0.1 % relative) whose ε, composed after ``prior_event``, is ≤ target,
    for T steps of ``scheme`` (arguments as in ``compute_epsilon``; the search is
    ``calibrate_sigma``).

    Raises ``ValueError`` if the target is unreachable (e.g. ``prior_event`` already spent it).

    Args:
      target_epsilon: the ε to reach (positive).
      num_examples: N, the dataset size.
      batch_size: L, the expected batch size.
      epochs: passes over the data, or None when ``steps`` is given.
      steps: T, the number of steps, or None when ``epochs`` is given.
      delta: δ in (0, 1).
      accountant: a registered accountant ("rdp" default, "pld").
      prior_event: a DpEvent already spent before this training, or None.
      scheme: the sampling scheme ("poisson" default).
      parameter: the scheme's extra parameter (e.g. RaCO-DP's Laplace scale).

    Returns:
      The noise multiplier σ.

    Raises:
      ValueError: an argument is out of range, or the target is unreachable.
    """
    target_epsilon = _checks.positive("target_epsilon", target_epsilon)
    num_examples, batch_size, _ = _check_problem(num_examples, batch_size)
    total_steps = steps_for(num_examples, batch_size, epochs, steps)
    _planned_phase(scheme, num_examples, batch_size, 1.0, total_steps, parameter)  # checks the arguments

    def event(sigma: float) -> dp_event.DpEvent:
        training = phase_event(_planned_phase(scheme, num_examples, batch_size, sigma, total_steps, parameter))
        return training if prior_event is None else dp_event.ComposedDpEvent([prior_event, training])

    return calibrate_sigma(event, target_epsilon, delta, accountant)


def calibrate_sigma(event: Callable[[float], dp_event.DpEvent], target_epsilon: float, delta: float,
                    accountant: str = DEFAULT_ACCOUNTANT) -> float:
    """Smallest σ on the grid of the doubling-from-1-then-bisection search (to 0.1 % relative,
    up to ``LARGEST_NOISE_MULTIPLIER``) with ε(event(σ)) ≤ target, for ε decreasing in σ
    (docs/algorithms.md A.4).

    Args:
      event: σ ↦ the DpEvent whose ε must meet the target.
      target_epsilon, delta, accountant: the budget and its accountant.

    Returns:
      σ. Raises ``ValueError`` if even ``LARGEST_NOISE_MULTIPLIER`` exceeds the target.
    """
    target_epsilon = _checks.positive("target_epsilon", target_epsilon)
    delta = _checks.delta(delta)
    accountant = check_accountant(accountant)

    def epsilon_at(sigma: float) -> float:
        return epsilon(event(sigma), delta, accountant)

    if accountant not in ACCOUNTANTS or rdp_of_event(event(1.0), orders=()) is None:
        return _smallest_sigma_within(epsilon_at, target_epsilon)  # not RDP curves: search on ε itself
    rdp = _LocalRdpEpsilon(event, delta)
    estimate, slope = _log_log_root(rdp, target_epsilon, start=1.0, tolerance=1e-7)
    if estimate is None:  # no finite root (e.g. a prior event already spent the budget)
        return _bisect_sigma(_BudgetCheck(epsilon_at, target_epsilon).exceeds, target_epsilon, 1e-3)[1]
    if accountant == "rdp":
        return _smallest_sigma_within(epsilon_at, target_epsilon, estimate=estimate,
                                      fits=lambda sigma: rdp(sigma) <= target_epsilon)
    # PLD: no curve to reuse, but the RDP answer and slope start the secant close by.
    return _smallest_sigma_within(epsilon_at, target_epsilon, start=estimate, slope=slope)


class _LocalRdpEpsilon:
    """ε(σ) from the RDP orders around the best order found so far: a cheap upper bound
    that equals ε wherever the best order lies inside the window.

    The first call looks at every (2·``half_width`` + 1)-th order; later calls use
    ±``half_width`` orders around the last best one, sliding the window while its best order
    sits on an edge. Each value is a minimum over orders of dp_accounting's per-order bound,
    so ε_window(σ) ≤ target proves ε(σ) ≤ target exactly.
    """

    def __init__(self, event: Callable[[float], dp_event.DpEvent], delta: float, half_width: int = 3):
        self._event, self._delta, self._half_width = event, delta, half_width
        self._best = None  # index in RDP_ORDERS of the last best order

    def __call__(self, sigma: float) -> float:
        while True:
            window = self._window()
            orders = [RDP_ORDERS[i] for i in window]
            epsilon, order = _epsilon_from_rdp(rdp_of_event(self._event(sigma), orders), self._delta, orders)
            best = window[orders.index(order)] if math.isfinite(epsilon) else self._best
            on_edge = best in (window[0], window[-1]) and best not in (0, len(RDP_ORDERS) - 1)
            moved, self._best = best != self._best, best
            if self._best is None or not (on_edge and moved):
                return epsilon

    def _window(self) -> list:
        if self._best is None:  # a sparse first look over the whole range
            return sorted(set(range(0, len(RDP_ORDERS), 2 * self._half_width + 1)) | {len(RDP_ORDERS) - 1})
        low = max(self._best - self._half_width, 0)
        return list(range(low, min(self._best + self._half_width, len(RDP_ORDERS) - 1) + 1))


def _log_log_root(epsilon: Callable[[float], float], target: float, start: float, slope: float = -1.0,
                  tolerance: float = 1e-4, max_evaluations: int = 20) -> tuple:
    """(σ̂, slope) with ε(σ̂) ≈ target, by the secant method on y = log(ε/target) against
    x = log σ, where DP-SGD's ε is nearly a straight line (ε ∝ σ^s, s ≈ −1 to −2):

        x_{k+1} = x_k − y_k / s_k,   s_k = (y_k − y_{k−1}) / (x_k − x_{k−1})   (s_0 = ``slope``).

    Steps are capped at a factor 4 in σ (doubling while ε = ∞). Returns the prediction once
    a step is below ``tolerance`` (relative); (None, slope) if that does not happen, or if ε
    still exceeds the target beyond twice the largest σ the bisection tries."""
    x, y = math.log(start), _log_ratio(epsilon(start), target)
    for _ in range(max_evaluations):
        if y > 0 and x > math.log(2 * LARGEST_NOISE_MULTIPLIER):
            break  # ε still above the target where the bisection gives up
        step = _secant_step(y, slope)
        if abs(step) < tolerance:
            return math.exp(x + step), slope
        x_next = x + step
        y_next = _log_ratio(epsilon(math.exp(x_next)), target)
        if math.isfinite(y) and math.isfinite(y_next) and (y_next - y) / step < 0:
            slope = (y_next - y) / step
        x, y = x_next, y_next
    return None, slope


def _log_ratio(epsilon: float, target: float) -> float:
    if epsilon <= 0:
        return -math.inf
    return math.log(epsilon / target)


def _secant_step(y: float, slope: float, largest: float = math.log(4)) -> float:
    if math.isinf(y):
        return math.log(2) if y > 0 else -math.log(2)
    return min(max(-y / slope, -largest), largest)


class _BudgetCheck:
    """Whether ε(σ) > target, each σ decided once: by ``fits`` when that proves ε(σ) ≤ target
    cheaply, else by ε(σ) itself (memoized, shared with the secant search)."""

    def __init__(self, epsilon: Callable[[float], float], target: float, fits: Optional[Callable] = None):
        self._epsilon, self._target, self._fits = epsilon, target, fits
        self._values, self._decisions = {}, {}

    def epsilon(self, sigma: float) -> float:
        if sigma not in self._values:
            self._values[sigma] = self._epsilon(sigma)
        return self._values[sigma]

    def exceeds(self, sigma: float) -> bool:
        if sigma not in self._decisions:
            proven_within = self._fits is not None and self._fits(sigma)
            self._decisions[sigma] = not proven_within and self.epsilon(sigma) > self._target
        return self._decisions[sigma]


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


def _smallest_sigma_within(epsilon: Callable[[float], float], target: float, relative_tolerance: float = 1e-3,
                           estimate: Optional[float] = None, fits: Optional[Callable[[float], bool]] = None,
                           start: float = 1.0, slope: float = -1.0) -> float:
    """The σ of ``_bisect_sigma`` (doubling from 1, then bisection to ``relative_tolerance``)
    for ε decreasing in σ, found with few evaluations of ε:

    1. σ̂ ≈ σ* from ``estimate``, else by the secant search on ε itself from ``start``;
    2. the bisection replayed against σ̂ (σ < σ̂ ⇒ "exceeds") gives its final interval
       (low, high];
    3. if ε(low) > target and ε(high) ≤ target, every step of the real bisection — which
       only ever compares points outside (low, high) — decides as the replay did: return high.
       Otherwise predict once more from the failed end, and then bisect for real, reusing
       every ε already computed.

    ``fits(σ)`` may prove ε(σ) ≤ target cheaply (an RDP bound on a few orders).
    """
    check = _BudgetCheck(epsilon, target, fits)
    if estimate is None:
        estimate, slope = _log_log_root(check.epsilon, target, start, slope, tolerance=3e-4)
    for _ in range(2):  # a second prediction restarts from the end of the interval that failed
        if estimate is None or not 0 < estimate <= LARGEST_NOISE_MULTIPLIER:
            break
        low, high = _bisect_sigma(lambda sigma: sigma < estimate, target, relative_tolerance)
        low_exceeds = low == 0 or check.exceeds(low)
        if low_exceeds and not check.exceeds(high):
            return high
        estimate, slope = _log_log_root(check.epsilon, target, high if low_exceeds else low, slope, tolerance=3e-4)
    return _bisect_sigma(check.exceeds, target, relative_tolerance)[1]



def _bisect_sigma(exceeds: Callable[[float], bool], target: float, relative_tolerance: float) -> tuple:
    """The original search: double σ from 1 until ε(σ) ≤ target, then bisect until the
    interval (low, high] is within ``relative_tolerance`` of high. Returns (low, high)."""
    high = 1.0
    while exceeds(high):
        high *= 2
        if high > LARGEST_NOISE_MULTIPLIER:
            raise ValueError(
                f"target_epsilon={target} is unreachable: even noise_multiplier={LARGEST_NOISE_MULTIPLIER:g} exceeds "
                "it (was the budget already spent by earlier training?). Raise target_epsilon."
            )
    low = high / 2 if high > 1.0 else 0.0
    while high - low > relative_tolerance * high:
        middle = (low + high) / 2
        if exceeds(middle):
            low = middle
        else:
            high = middle
    return low, high
