"""Sampling schemes: which batches ``fit`` draws, and what the ledger records of them.

A scheme is one part of the DP mechanism (docs/design.md). ``fit`` asks ``scheme_for_fit`` for
the scheme its inputs and the optimizer's privatizer need — Poisson sampling of examples
(docs/algorithms.md §1), cyclic Poisson sampling for banded-MF noise (§10), Poisson sampling
of users (§11) — and then only talks to the scheme: it builds the sampler that draws each
step's batch, states the unit the ledger counts (N examples or N users), the rate q and the
scheme's ledger parameter, and says whether each ``fit`` starts a new accounting segment.
The scheme DECLARES its accounting event (``event``, with ``ledger_code``, ``whole_segments``
and ``unit``): the running mechanism asks it (``tf_dp.mechanism.DPMechanism.event``), and
``register_sampling`` registers it with the accountant under the scheme's name, which is all a
reloaded ledger holds (``tf_dp.accounting.events.declare_events``).

Add a scheme: subclass ``SamplingScheme``, decorate it with ``@register_sampling("name")``,
give its sampler the interface of ``tf_dp.sampling.PoissonSampler`` (``physical_batch_size``,
``batch(step) -> (indices, mask)``, a function of a secret seed and the step only), declare
its event (``event = staticmethod(fn)``, and ``ledger_code`` if its name is new), and test
its batches' distribution and its ε against dp_accounting.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from tf_dp import _checks
from tf_dp.accounting import events
from tf_dp.sampling.poisson import PoissonSampler

SAMPLING_SCHEMES: dict = {}


def register_sampling(name: str):
    """Class decorator: registers a SamplingScheme under ``name`` (also its ledger scheme), and
    the accounting event it declares under that name (``events.declare_events``)."""
    def register(cls):
        if name in SAMPLING_SCHEMES and SAMPLING_SCHEMES[name] is not cls:
            raise ValueError(f"A sampling scheme named {name!r} is already registered.")
        cls.name = name
        events.declare_events(cls)
        SAMPLING_SCHEMES[name] = cls
        return cls
    return register


@dataclasses.dataclass(frozen=True)
class SamplingScheme:
    """Base: Poisson-type sampling of ``num_units`` units with ``expected_batch_size`` L per step.

    Attributes:
      num_units: N, what one privacy unit is counted over (examples; users for user-level DP).
      expected_batch_size: L, the expected number of units per step (the noisy sum's divisor).
    """

    num_units: int
    expected_batch_size: int
    name = "base"
    #: ``fn(phase) -> DpEvent``, the event of one ledger phase of this scheme (a staticmethod),
    #: or None when a plug-in registers it by name (``tf_dp.accounting.register_event``).
    event = None
    ledger_code = None  # the ledger's code of a name not reserved in events.SCHEME_CODES
    whole_segments = False  # each segment accounted whole, at its smallest σ (events.register_event)
    unit = "example"  # what one phase protects: "example" or "user"

    @property
    def sampling_rate(self) -> float:
        """q recorded in the ledger (the probability that a unit joins a step it may join)."""
        return self.expected_batch_size / self.num_units

    @property
    def ledger_scheme(self) -> str:
        """The scheme the ledger records (and the accountant composes) for this sampling."""
        return self.name

    @property
    def ledger_parameter(self) -> float:
        """The scheme's parameter in the ledger's phase row (0: none)."""
        return 0.0

    @property
    def new_segment(self) -> bool:
        """Whether each ``fit`` call starts a new accounting segment even at equal settings."""
        return False

    @property
    def views(self) -> int:
        """Examples each sampled unit contributes, averaged before clipping (1: one example)."""
        return 1

    def sampler(self, physical_batch_size: Optional[int], seed: Optional[int], secure: bool,
                chunk_multiple: int = 1):
        raise NotImplementedError


@register_sampling("poisson")
@dataclasses.dataclass(frozen=True)
class PoissonSampling(SamplingScheme):
    """Every example joins each step independently with q = L/N (docs/algorithms.md §1 step 1)."""

    event = staticmethod(events.poisson_event)

    def sampler(self, physical_batch_size, seed, secure, chunk_multiple=1):
        return PoissonSampler(self.num_units, self.expected_batch_size, physical_batch_size, seed, secure=secure,
                              chunk_multiple=chunk_multiple)


def scheme_for_fit(privatizer, num_examples: int, batch_size: int, sampling=None, **fit_arguments) -> SamplingScheme:
    """The scheme ``fit`` samples with: the one the privatizer requires (BandMF: cyclic
    Poisson), or the one ``fit_arguments`` select (``user_ids``: user-level Poisson), else
    Poisson sampling of examples. Schemes that cannot be combined are refused.

    Args:
      privatizer: the optimizer's ``tf_dp.noise.Privatizer``.
      num_examples: the number of training examples N.
      batch_size: ``fit``'s batch_size (expected units per step).
      sampling: the name of a registered scheme (``fit(..., sampling="balls_in_bins")``), or a
        plug-in's own scheme: ``sampling(num_examples, batch_size)`` returns it (RaCO-DP passes
        its joint Gaussian + Laplace scheme); None chooses as above.
      **fit_arguments: fit's sampling arguments that are not None (e.g. user_ids,
        examples_per_user); each registered scheme names those it takes in ``FIT_ARGUMENTS``.
    """
    required = getattr(privatizer, "required_sampling", None)
    given = {name: value for name, value in fit_arguments.items() if value is not None}
    if sampling is not None and not isinstance(sampling, str):
        if given or required:
            raise ValueError(f"This model samples with its own scheme; it cannot be combined with "
                             f"{sorted(given) or privatizer}.")
        return sampling(num_examples, _checks.positive_int("batch_size", batch_size))
    if sampling is not None:
        registered_scheme(sampling)
        chosen = [sampling]
    else:
        chosen = [name for name, cls in SAMPLING_SCHEMES.items() if given and set(given) & set(_fit_arguments(cls))]
    if required and chosen and required not in chosen:
        raise ValueError(f"noise={privatizer!r} needs {required!r} sampling, which cannot be combined with "
                         f"{sorted(given) or f'sampling={sampling!r}'} (the {chosen[0]!r} scheme). Drop one of them.")
    name = required or (chosen[0] if chosen else "poisson")
    if name not in SAMPLING_SCHEMES:
        raise ValueError(f"noise={privatizer!r} needs the sampling scheme {name!r}, which is not registered "
                         f"(registered: {sorted(SAMPLING_SCHEMES)}): import the module that defines it.")
    cls = SAMPLING_SCHEMES[name]
    unused = set(given) - set(_fit_arguments(cls))
    if unused:
        raise ValueError(f"fit() arguments {sorted(unused)} do not apply to {name!r} sampling.")
    arguments = {**(privatizer.sampling_arguments() if required else {}), **given}
    batch_size = _checks.positive_int("batch_size", batch_size)
    return cls.for_fit(num_examples, batch_size, **arguments) if hasattr(cls, "for_fit") \
        else cls(num_examples, batch_size, **arguments)


def registered_scheme(name: str):
    """The sampling scheme class registered as ``name`` (``register_sampling``).

    Args:
      name: a registered scheme's name, e.g. "poisson".

    Returns:
      The ``SamplingScheme`` subclass; calling it with (N, L) gives the scheme.

    Raises:
      ValueError: no scheme of that name is registered.
    """
    if name not in SAMPLING_SCHEMES:
        raise ValueError(f"sampling={name!r} is not a registered sampling scheme (registered: "
                         f"{sorted(SAMPLING_SCHEMES)}): import the module that defines it.")
    return SAMPLING_SCHEMES[name]


def _fit_arguments(cls) -> tuple:
    return tuple(getattr(cls, "FIT_ARGUMENTS", ()))
