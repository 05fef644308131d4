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


class TrialOutsideBound(ValueError):
    """A trial's ledger spends more, at some RDP order, than the declared per-trial bound."""


def _choices(name: str, value) -> list:
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not values:
        raise ValueError(f"`{name}` must hold at least one value.")
    return values


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
        self._description = description or {"candidates": [repr(event) for event in candidates]}

    @classmethod
    def dp_sgd(cls, num_examples: int, noise_multiplier, batch_size, epochs=None, steps=None,
               orders: Sequence[float] = ORDERS) -> "TrialBound":
        """Every combination of the given choices (a value or a list of values each) of
        Poisson-sampled DP-SGD at q = batch_size/num_examples (``compute_epsilon``'s event).

        Args:
          num_examples: N of every trial's training set.
          noise_multiplier: σ or the list of σ the search may use.
          batch_size: L or the list of L.
          epochs, steps: exactly one, a value or a list (T = epochs·⌈N/L⌉, as ``fit`` runs
            them, or steps).
          orders: RDP orders.

        Returns:
          The bound over the Cartesian product of the choices.
        """
        num_examples = _checks.positive_int("num_examples", num_examples)
        sigmas = [_checks.positive("noise_multiplier", s) for s in _choices("noise_multiplier", noise_multiplier)]
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

    def describe(self) -> dict:
        return dict(self._description)

    def check(self, event: dp_event.DpEvent, what: str = "the trial") -> np.ndarray:
        """The RDP curve of ``event``, or ``TrialOutsideBound`` if it exceeds the bound anywhere.

        Args:
          event: a trial's training event (its ledger's ``event()``).
          what: how the error names the trial (its configuration).

        Returns:
          The trial's curve at ``orders``.
        """
        curve = trial_rdp(event, self.orders)
        excess = curve > self.curve * (1 + _SLACK) + 1e-300
        if np.any(excess):
            index = int(np.argmax(excess))
            raise TrialOutsideBound(
                f"Refused: {what} spends RDP {curve[index]:.6g} at order {self.orders[index]:g}, more than the "
                f"declared per-trial bound `trial_bound` ({self.curve[index]:.6g}; {self.describe()}). Its "
                "noise_multiplier is smaller, or its sampling rate (batch_size/N) or number of steps (epochs) larger, "
                "than every declared candidate allows: the selection's ε would not hold, so nothing is released. "
                "Declare a trial_bound that covers every configuration of the search space.")
        return curve
