"""Sampling schemes → dp_accounting events, and ε by a named accountant (docs/algorithms.md, appendix A).

Two registries make accounting a set of plug-ins:

* ``register_event(scheme)``: how ONE ledger phase of a sampling scheme becomes a
  ``dp_event.DpEvent``. The core registers

      poisson:       SelfComposed(PoissonSampled(q, Gaussian(σ)), T)
      user_poisson:  the same event over users, q = L_u/N_u (user-level DP, §11)
      batches:       SelfComposed(Gaussian(σ), T)   (no amplification by sampling, §7.1)

  and reserves ledger codes for "cyclic_poisson" (BandMF, §10) and "raco_poisson" (RaCO-DP,
  §5), whose packages register their events themselves.
* ``register_accountant(name)``: fn(event, δ) → ε. ``tf_dp.accounting.accountant`` registers
  "rdp" and "pld" (dp_accounting).

A mechanism that dp_accounting cannot describe (RaCO-DP's joint Gaussian + Laplace step) is a
``StepEvent``: a DpEvent that states its own one-step RDP and PLD, which the built-in
accountants compose with every other event.

``epsilon(event_or_phases, delta, accountant)`` is the one ε path: the ledger, ``compute_epsilon``,
calibration, the callbacks and the CLI all end in it. The default accountant everywhere is
``DEFAULT_ACCOUNTANT = "rdp"`` (tensorflow-privacy's convention); pass ``accountant="pld"``
for the tighter PLD.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence, Union

import numpy as np
from dp_accounting import dp_event

from tf_dp import _checks

DEFAULT_ACCOUNTANT = "rdp"

# Ledger code of every scheme name (codes are written into saved models: never reuse one).
# Plug-ins with a scheme not reserved here pass ``code=`` to ``register_event``.
SCHEME_CODES = {"poisson": 1, "batches": 2, "cyclic_poisson": 3, "raco_poisson": 4, "user_poisson": 5}
# Ledgers written before the scheme table held a parameterised scheme as a "poisson" row with a
# nonzero parameter (RaCO-DP's Laplace scale, §5): the scheme such a row means.
LEGACY_PARAMETERISED_POISSON = "raco_poisson"

EventBuilder = Callable[["Phase"], dp_event.DpEvent]
_EVENTS: dict[str, EventBuilder] = {}
_WHOLE_SEGMENTS: set[str] = set()
_UNITS: dict[str, str] = {}  # scheme -> the unit one phase protects ("example" unless registered otherwise)
_ACCOUNTANTS: dict[str, Callable[[dp_event.DpEvent, float], float]] = {}


def is_segmented(scheme: str) -> bool:
    """Whether every fit of ``scheme`` is a segment of its own, accounted whole (registered
    with ``whole_segments=True``: BandMF's "cyclic_poisson", docs/algorithms.md §10.3)."""
    return scheme in _WHOLE_SEGMENTS


@dataclass(frozen=True)
class Phase:
    """A stretch of steps with one sampling scheme and one set of settings.

    Attributes:
      scheme: the sampling scheme's registered name ("poisson", "batches", ...).
      sampling_rate: q (1.0 for "batches").
      noise_multiplier: σ of the Gaussian on the clipped sum.
      num_examples: N (0 when unknown, "batches").
      expected_batch_size: L.
      steps: T, the DP steps the phase took.
      parameter: the scheme's own setting (the number of bands for "cyclic_poisson",
        the Laplace scale for "raco_poisson"); 0.0 for schemes without one.
      segment: phases with the same segment continue one sampler run (only σ differs:
        a σ changed during training opens a phase of the same segment).
    """

    scheme: str
    sampling_rate: float
    noise_multiplier: float
    num_examples: int
    expected_batch_size: float
    steps: int
    parameter: float = 0.0
    segment: int = 0

    def event(self) -> dp_event.DpEvent:
        return phase_event(self)


# ----------------------------------------------------------------------------------- schemes


def register_event(scheme: str, *, code: int | None = None, whole_segments: bool = False, unit: str = "example"):
    """Decorator: ``fn(phase) -> DpEvent`` is how phases of ``scheme`` are accounted.

    Args:
      scheme: the name the ledger records.
      code: the ledger's integer code for a scheme not in ``SCHEME_CODES`` (new, unused).
      whole_segments: account each segment once — its consecutive phases merged into one
        phase of their total steps at the SMALLEST σ among them — instead of phase by phase
        (for schemes whose steps are not independent, e.g. correlated noise within a run).
      unit: what one phase of the scheme protects, "example" or "user" (all of one user's
        examples, §11); ``privacy_unit`` reads it.

    Returns:
      The decorator (it returns ``fn`` unchanged).
    """
    if not isinstance(scheme, str) or not scheme:
        raise ValueError(f"`scheme` must be a non-empty string, got {scheme!r}.")
    if unit not in ("example", "user"):
        raise ValueError(f"`unit` must be 'example' or 'user', got {unit!r}.")
    _reserve_code(scheme, code)

    def decorator(fn: EventBuilder) -> EventBuilder:
        if scheme in _EVENTS and _EVENTS[scheme] is not fn:
            raise ValueError(f"An event for scheme {scheme!r} is already registered ({_EVENTS[scheme].__qualname__}).")
        _EVENTS[scheme] = fn
        if whole_segments:
            _WHOLE_SEGMENTS.add(scheme)
        _UNITS[scheme] = unit
        return fn

    return decorator


def _reserve_code(scheme: str, code: int | None) -> None:
    if code is None:
        if scheme not in SCHEME_CODES:
            raise ValueError(f"Scheme {scheme!r} has no ledger code: pass register_event({scheme!r}, code=...) with an "
                             f"unused integer (used: {sorted(SCHEME_CODES.values())}).")
        return
    code = _checks.positive_int("code", code)
    if SCHEME_CODES.get(scheme, code) != code or (scheme not in SCHEME_CODES and code in SCHEME_CODES.values()):
        raise ValueError(f"Ledger code {code} for scheme {scheme!r} clashes with {SCHEME_CODES}; pick an unused code.")
    SCHEME_CODES[scheme] = code


def privacy_unit(phases: Sequence["Phase"]) -> str:
    """What ε of these phases protects: "user" when every phase is user-level (§11), else
    "example". A user-level phase also protects each example (an example is part of one user),
    but an example-level phase protects a user only by group privacy over all of the user's
    examples, so a mixed ledger's ε holds per example only."""
    units = {scheme_unit(phase.scheme) for phase in phases}
    return "user" if units == {"user"} else "example"


def scheme_unit(scheme: str) -> str:
    """The unit one phase of ``scheme`` protects ("example" unless registered otherwise)."""
    return _UNITS.get(scheme, "example")


def adjacency(unit: str) -> str:
    """The neighbouring-data-set relation of ``unit`` in words (``privacy_report``)."""
    return "add/remove one user (all of the user's examples)" if unit == "user" else "add/remove one example"


def registered_schemes() -> tuple[str, ...]:
    """The sampling schemes that have a registered accounting event.

    Returns:
      The scheme names, sorted.
    """
    return tuple(sorted(_EVENTS))


def phase_event(phase: Phase, declared: EventBuilder | None = None) -> dp_event.DpEvent:
    """The DpEvent of one phase: ``NoOpDpEvent`` without steps, ``NonPrivateDpEvent`` at σ = 0
    (ε = ∞), else the event its part declared (``declared``, what ``DPMechanism.event`` passes),
    or the one registered under its scheme name (a reloaded ledger holds names only; the parts
    registered their declared events under those names: ``declare_events``).

    Args:
      phase: a ledger ``Phase`` (scheme, sampling rate, σ, steps, ...).
      declared: the event builder the running mechanism's part declares, or None.

    Returns:
      The phase's ``dp_accounting`` DpEvent.

    Raises:
      ValueError: no event is registered for the phase's sampling scheme.
    """
    if phase.steps == 0:
        return dp_event.NoOpDpEvent()
    if phase.noise_multiplier == 0:
        return dp_event.NonPrivateDpEvent()
    if declared is not None:
        return declared(phase)
    if phase.scheme not in _EVENTS:
        raise ValueError(f"No accounting event is registered for sampling scheme {phase.scheme!r} (registered: "
                         f"{list(registered_schemes())}); import the package that defines it before computing ε.")
    return _EVENTS[phase.scheme](phase)


def composed_event(phases: Sequence[Phase]) -> dp_event.DpEvent:
    """ComposedDpEvent of every phase's event, in order (docs/algorithms.md A.2); phases of a
    ``whole_segments`` scheme are first merged segment by segment.

    Args:
      phases: the ledger ``Phase`` records, in the order they ran.

    Returns:
      A ``ComposedDpEvent`` of the phases' events (``NoOpDpEvent`` if there are none).

    Raises:
      ValueError: a phase's sampling scheme has no registered event.
    """
    events = [phase_event(p) for p in _merge_segments(list(phases))]
    return dp_event.ComposedDpEvent(events) if events else dp_event.NoOpDpEvent()


def declare_events(part) -> None:
    """Registers the accounting event a part DECLARES under its ledger name, so that a reloaded
    ledger (which holds scheme names only) composes the very events the running mechanism asked
    its part for (docs/algorithms.md A.1).

    A part (a sampling scheme class) declares ``event`` (``fn(phase) -> DpEvent``, or None when
    its event is registered by name elsewhere), ``ledger_code`` (None: a code reserved in
    ``SCHEME_CODES``), ``whole_segments`` and ``unit``, and is named by ``name``.

    Args:
      part: the part's class.
    """
    builder = getattr(part, "event", None)
    if builder is not None:
        register_event(part.name, code=getattr(part, "ledger_code", None),
                       whole_segments=bool(getattr(part, "whole_segments", False)),
                       unit=getattr(part, "unit", "example"))(builder)


def declared_event(part) -> EventBuilder | None:
    """The event builder ``part`` declares, or the one registered under its ledger name.

    Args:
      part: a sampling scheme (or ``tf_dp.mechanism.FixedBatches``), class or instance.

    Returns:
      ``fn(phase) -> DpEvent``, or None if neither exists.
    """
    return getattr(part, "event", None) or _EVENTS.get(getattr(part, "ledger_scheme", None))


def _merge_segments(phases: list[Phase]) -> list[Phase]:
    """Consecutive phases of one segment of a ``whole_segments`` scheme → one phase with
    their total steps at the smallest σ (more noise on some steps is post-processing of a
    run at the smallest σ, so this bounds the run's loss)."""
    merged: list[Phase] = []
    for phase in phases:
        last = merged[-1] if merged else None
        if (phase.scheme in _WHOLE_SEGMENTS and last is not None and last.scheme == phase.scheme
                and last.segment == phase.segment):
            merged[-1] = dataclasses.replace(last, steps=last.steps + phase.steps,
                                             noise_multiplier=min(last.noise_multiplier, phase.noise_multiplier))
        else:
            merged.append(phase)
    return merged


@register_event("poisson")
def poisson_event(phase: Phase) -> dp_event.DpEvent:
    """T × PoissonSampled(q, Gaussian(σ)) (docs/algorithms.md §1)."""
    step = dp_event.PoissonSampledDpEvent(phase.sampling_rate, dp_event.GaussianDpEvent(phase.noise_multiplier))
    return dp_event.SelfComposedDpEvent(step, phase.steps)


@register_event("user_poisson", unit="user")
def user_poisson_event(phase: Phase) -> dp_event.DpEvent:
    """T × PoissonSampled(q_u, Gaussian(σ)) over users, q_u = L_u/N_u: one clip per user
    bounds every user's contribution to the sum by C (docs/algorithms.md §11)."""
    return poisson_event(phase)


@register_event("batches")
def batches_event(phase: Phase) -> dp_event.DpEvent:
    """T × Gaussian(σ): batches tf_dp did not sample, each may hold any example (§7.1)."""
    return dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(phase.noise_multiplier), phase.steps)


# ---------------------------------------------------------------- mechanisms of plug-ins


class StepEvent(dp_event.DpEvent):
    """ONE step of a mechanism dp_accounting has no event for; the plug-in states its privacy.

    Subclasses are frozen attrs classes (like dp_accounting's events) and define:

    * ``rdp_orders``: the RDP orders at which ``rdp`` is a valid bound;
    * ``rdp(orders) -> np.ndarray``: the step's RDP at those orders;
    * ``pld(value_discretization_interval) -> PrivacyLossDistribution``: a pessimistic PLD.

    The built-in accountants compose them with dp_accounting's own events: under RDP at the
    orders every StepEvent of the composition supports, under PLD by composing PLDs.
    """

    rdp_orders: tuple = ()

    def rdp(self, orders) -> np.ndarray:
        raise NotImplementedError(f"{type(self).__name__} must define rdp(orders).")

    def pld(self, value_discretization_interval: float):
        raise NotImplementedError(f"{type(self).__name__} must define pld(value_discretization_interval).")


def step_events(event: dp_event.DpEvent) -> list[StepEvent]:
    """The StepEvents inside ``event`` (through Composed / SelfComposed events)."""
    if isinstance(event, StepEvent):
        return [event]
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return step_events(event.event)
    if isinstance(event, dp_event.ComposedDpEvent):
        return [inner for e in event.events for inner in step_events(e)]
    return []


# ------------------------------------------------------------------------------ accountants


def register_accountant(name: str):
    """Decorator: ``fn(event, delta) -> ε`` is the accountant ``name``.

    Args:
      name: the accountant's name (a non-empty string), as passed to ``accountant=``.

    Returns:
      A decorator that registers ``fn`` and returns it unchanged.

    Raises:
      ValueError: ``name`` is not a non-empty string.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"`name` must be a non-empty string, got {name!r}.")

    def decorator(fn: Callable[[dp_event.DpEvent, float], float]):
        _ACCOUNTANTS[name] = fn
        return fn

    return decorator


def accountant_names() -> tuple[str, ...]:
    """The registered accountants' names ("rdp", "pld", ...).

    Returns:
      The names, in registration order.
    """
    return tuple(_ACCOUNTANTS)


def check_accountant(name) -> str:
    """``name`` if it is a registered accountant, else a ValueError naming the choices."""
    return _checks.one_of("accountant", name, accountant_names())


def epsilon(event_or_phases: Union[dp_event.DpEvent, Iterable[Phase]], delta: float,
            accountant: str = DEFAULT_ACCOUNTANT) -> float:
    """ε at δ of a DpEvent, or of ledger phases composed (``composed_event``).

    Args:
      event_or_phases: a ``dp_event.DpEvent`` or a sequence of ``Phase``.
      delta: δ in (0, 1).
      accountant: a registered accountant ("rdp" default, "pld").

    Returns:
      ε (0.0 for phases without a step; ∞ if any step was not private).
    """
    delta = _checks.delta(delta)
    accountant = check_accountant(accountant)
    if isinstance(event_or_phases, dp_event.DpEvent):
        event = event_or_phases
    else:
        phases = list(event_or_phases)
        if not all(isinstance(p, Phase) for p in phases):
            raise TypeError("`event_or_phases` must be a dp_accounting DpEvent or a sequence of "
                            "tf_dp.accounting.Phase.")
        if not any(p.steps for p in phases):
            return 0.0
        event = composed_event(phases)
    return float(_ACCOUNTANTS[accountant](event, delta))
