"""The per-trial mechanism a search declares BEFORE its first trial (docs/algorithms.md §14).

The selection bound holds only if one RDP curve bounds EVERY trial. ``TrialBound`` fixes it
up front — the pointwise maximum over the candidate configurations' RDP curves — and
``check`` refuses a trial whose ledger's curve exceeds it at any order.
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

import numpy as np
from dp_accounting import dp_event

from tf_dp import _checks
from tf_dp.accounting.accountant import dp_sgd_event
from tf_dp.tuning.selection import ORDERS, _orders, fit_steps, trial_rdp

_SLACK = 1e-9  # relative: a trial equal to a candidate passes despite float round-off


def _float32_at_most(value: float) -> float:
    """The largest float32 <= ``value``: the σ a tf_dp optimizer (float32) can run for it."""
    rounded = np.float32(value)
    if float(rounded) > value:
        rounded = np.nextafter(rounded, np.float32(-np.inf))
    return float(rounded)


def _poisson_steps(event: dp_event.DpEvent):
    """(q, σ, T) when ``event`` is T Poisson-sampled Gaussian steps (one ledger phase), else None."""
    while isinstance(event, dp_event.ComposedDpEvent) and len(event.events) == 1:
        event = event.events[0]
    count = 1
    if isinstance(event, dp_event.SelfComposedDpEvent):
        count, event = event.count, event.event
    if isinstance(event, dp_event.PoissonSampledDpEvent) and type(event.event) is dp_event.GaussianDpEvent:
        return event.sampling_probability, event.event.noise_multiplier, count
    return None


class TrialOutsideBound(ValueError):
    """A trial's ledger spends more, at some RDP order, than the declared per-trial bound."""


def _choices(name: str, value) -> list:
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not values:
        raise ValueError(f"`{name}` must hold at least one value.")
    return values


def _hyperparameter(space: dict, argument: str, name: str):
    if name not in space:
        raise ValueError(f"`{argument}`={name!r} names no hyperparameter of the search space ({sorted(space)}).")
    return space[name]


def _values(space: dict, argument: str, setting, worst) -> list:
    """``setting`` itself, or every value of its discrete hyperparameter, or the ``worst`` end
    (min / max) of its continuous range (``worst=None``: a range is refused)."""
    if not isinstance(setting, str):
        return _choices(argument, setting)
    if setting not in space:
        raise ValueError(f"`{argument}`={setting!r} names no hyperparameter of the search space ({sorted(space)}).")
    hp = space[setting]
    if not hasattr(hp, "min_value"):  # Choice, Fixed, Boolean
        return list(hp.values)
    step = getattr(hp, "step", None)
    if type(hp).__name__ == "Int" and step and getattr(hp, "sampling", "linear") == "linear":
        return list(range(hp.min_value, hp.max_value + 1, step))
    if worst is None:
        raise ValueError(f"`{argument}`={setting!r} is a {type(hp).__name__} range whose values cannot all be "
                         "listed: declare it with hp.Choice (or hp.Int with a linear step).")
    return [hp.min_value if worst is min else hp.max_value]


class TrialBound:
    """The RDP curve every trial must stay under: the pointwise max over ``candidates``.

    Args:
      candidates: the dp_accounting events of the TRAINING of every configuration the
        search may run (``dp_sgd`` builds them for DP-SGD choices).
      orders: RDP orders (> 1, increasing).
      description: what the candidates are, for ``privacy.json``.
    """

    def __init__(self, candidates: Sequence[dp_event.DpEvent], orders: Sequence[float] = ORDERS,
                 description: Optional[dict] = None):
        candidates = list(candidates)
        if not candidates:
            raise ValueError("`candidates` must hold the event of at least one configuration.")
        self.orders = tuple(float(a) for a in _orders(orders))
        self.curve = np.max([trial_rdp(event, self.orders) for event in candidates], axis=0)
        self._dominating = [steps for steps in map(_poisson_steps, candidates) if steps is not None]
        self._description = description or {"candidates": [repr(event) for event in candidates]}

    @classmethod
    def dp_sgd(cls, num_examples: int, noise_multiplier, batch_size, epochs=None, steps=None,
               orders: Sequence[float] = ORDERS) -> "TrialBound":
        """Every combination of the given choices (a value or a list of values each) of
        Poisson-sampled DP-SGD at q = batch_size/num_examples (``compute_epsilon``'s event).

        Args:
          num_examples: N of every trial's training set.
          noise_multiplier: σ or the list of σ the search may use (each taken as the largest
            float32 at most σ: the σ a tf_dp optimizer runs and its ledger records).
          batch_size: L or the list of L.
          epochs, steps: exactly one, a value or a list (T = epochs·⌈N/L⌉, as ``fit`` runs
            them, or steps).
          orders: RDP orders.

        Returns:
          The bound over the Cartesian product of the choices.
        """
        num_examples = _checks.positive_int("num_examples", num_examples)
        sigmas = [_float32_at_most(_checks.positive("noise_multiplier", s))
                  for s in _choices("noise_multiplier", noise_multiplier)]
        batches = [_checks.batch_size_for(num_examples, b) for b in _choices("batch_size", batch_size)]
        if (epochs is None) == (steps is None):
            raise ValueError("Pass exactly one of `epochs` or `steps`.")
        lengths = _choices("epochs" if steps is None else "steps", epochs if steps is None else steps)
        events = []
        for sigma, batch, length in itertools.product(sigmas, batches, lengths):
            total = fit_steps(num_examples, batch, length, None) if steps is None else fit_steps(
                num_examples, batch, None, length)
            events.append(dp_sgd_event(batch / num_examples, sigma, total))
        description = {"mechanism": "dp_sgd_poisson", "num_examples": num_examples, "noise_multiplier": sigmas,
                       "batch_size": batches, ("epochs" if steps is None else "steps"): lengths}
        return cls(events, orders, description)

    @classmethod
    def from_search_space(cls, hyperparameters, num_examples: int, noise_multiplier, batch_size, epochs=None,
                          steps=None, orders: Sequence[float] = ORDERS) -> "TrialBound":
        """The bound over every DP-SGD configuration a KerasTuner search space can produce.

        Each setting is a number, or the name of a hyperparameter of ``hyperparameters`` (a
        ``keras_tuner.HyperParameters``). Discrete hyperparameters (Choice, Fixed, an Int with a
        linear step) contribute every value: the bound is the max over their product. A
        continuous range counts by its worst end — σ's smallest value, the largest epochs
        (steps): RDP of Poisson-sampled Gaussian steps falls as σ grows and grows with the steps.
        (``check`` accepts every σ above it by post-processing.) A batch size changes both q and
        the steps of an epoch, so it must be discrete.

        Args:
          hyperparameters: the search space.
          num_examples: N.
          noise_multiplier, batch_size, epochs, steps: numbers or hyperparameter names
            (exactly one of epochs, steps).
          orders: RDP orders.

        Returns:
          ``TrialBound.dp_sgd`` over the product of the settings' values.
        """
        space = {hp.name: hp for hp in getattr(hyperparameters, "space", [])}
        sigma = _values(space, "noise_multiplier", noise_multiplier, min)
        batches = _values(space, "batch_size", batch_size, None)
        if (epochs is None) == (steps is None):
            raise ValueError("Pass exactly one of `epochs` or `steps`.")
        length = _values(space, "epochs" if steps is None else "steps", epochs if steps is None else steps, max)
        bound = cls.dp_sgd(num_examples, sigma, batches, epochs=None if steps is not None else length,
                           steps=length if steps is not None else None, orders=orders)
        bound._description["from_search_space"] = {"noise_multiplier": noise_multiplier, "batch_size": batch_size,
                                                   ("epochs" if steps is None else "steps"): epochs or steps}
        return bound

    def describe(self) -> dict:
        return dict(self._description)

    def _dominated(self, event: dp_event.DpEvent) -> bool:
        steps = _poisson_steps(event)
        if steps is None:
            return False
        rate, sigma, count = steps
        return any(rate == q and sigma >= s and count <= t for q, s, t in self._dominating)

    def check(self, event: dp_event.DpEvent, what: str = "the trial") -> np.ndarray:
        """The RDP curve of ``event``, or ``TrialOutsideBound`` if it exceeds the bound anywhere.

        A trial of T' Poisson-sampled Gaussian steps at (q, σ') is also within the bound when a
        candidate has the same q, σ <= σ' and T >= T': the trial is then a post-processing of the
        candidate (more noise added, fewer steps released), so its RDP is no larger at any
        order, even where dp_accounting's series for fractional orders gives up (∞) for σ' only.

        Args:
          event: a trial's training event (its ledger's ``event()``).
          what: how the error names the trial (its configuration).

        Returns:
          The trial's curve at ``orders``.
        """
        curve = trial_rdp(event, self.orders)
        excess = curve > self.curve * (1 + _SLACK) + 1e-300
        if np.any(excess) and not self._dominated(event):
            index = int(np.argmax(excess))
            raise TrialOutsideBound(
                f"Refused: {what} spends RDP {curve[index]:.6g} at order {self.orders[index]:g}, more than the "
                f"declared per-trial bound `trial_bound` ({self.curve[index]:.6g}; {self.describe()}). Its "
                "noise_multiplier is smaller, or its sampling rate (batch_size/N) or number of steps (epochs) larger, "
                "than every declared candidate allows: the selection's ε would not hold, so nothing is released. "
                "Declare a trial_bound that covers every configuration of the search space.")
        return curve
