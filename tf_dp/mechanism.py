"""The DP mechanism of one ``fit`` / ``train_on_batch``, as one frozen object (docs/design.md).

``DPMechanism.of(optimizer, scheme)`` gathers the parts that decide privacy — the sampling scheme,
the privatizer, the clipping policy and the clip bound — checks in one place that they can be
combined, and answers what the model and the accountant ask by asking its parts: the ledger
phase it opens (``ledger_arguments``, ``new_segment``), the divisor explicit batches declare
(``declared_batch_size``), whether a segment is accounted whole (``accounted_whole``) and the
dp_accounting event of a phase (``event``). The model holds no branch on which mechanism runs;
a new sampling scheme or privatizer answers through its own attributes.

Explicit batches (a batched dataset, ``train_on_batch``), which tf_dp does not sample, are the
scheme ``FixedBatches`` (ledger scheme "batches", docs/algorithms.md §7.1).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from dp_accounting import dp_event

from tf_dp.accounting import events


@dataclasses.dataclass(frozen=True)
class FixedBatches:
    """Batches given by the caller, each step accounted as a Gaussian without amplification
    and divided by the declared L (docs/algorithms.md §7).

    Attributes:
      expected_batch_size: the declared L, a public constant.
    """

    expected_batch_size: float
    ledger_scheme = "batches"
    sampling_rate = 1.0
    num_units = 0
    ledger_parameter = 0.0
    new_segment = False
    description = "explicit batches (train_on_batch, a batched dataset)"
    event = staticmethod(events.batches_event)  # T × Gaussian(σ), no amplification (§7.1)
    whole_segments = False

    @property
    def declared_batch_size(self) -> float:
        """L, which the step divides explicit batches' noisy sums by."""
        return float(self.expected_batch_size)


@dataclasses.dataclass(frozen=True)
class DPMechanism:
    """The parts of one run's DP mechanism, checked together once.

    Attributes:
      scheme: the sampling scheme (``tf_dp.sampling.schemes.SamplingScheme``) or ``FixedBatches``.
      privatizer: the optimizer's ``tf_dp.noise.Privatizer`` (None: the optimizer has none).
      clipping: the optimizer's clipping policy (None: the optimizer has none).
      clip_bound: the optimizer's adaptive bound (``tf_dp.clipping.AdaptiveClip``), or None for
        the constant C the optimizer holds in its variable.
    """

    scheme: Any
    privatizer: Any = None
    clipping: Any = None
    clip_bound: Any = None

    @classmethod
    def of(cls, optimizer, scheme) -> "DPMechanism":
        """The mechanism of ``optimizer``'s parts sampling with ``scheme``, checked (``check``).

        Args:
          optimizer: the model's ``tf_dp.DPOptimizer``.
          scheme: the run's sampling scheme, or ``FixedBatches(L)``.

        Returns:
          The checked ``DPMechanism``.
        """
        mechanism = cls(scheme, getattr(optimizer, "privatizer", None), getattr(optimizer, "clipping", None),
                        getattr(optimizer, "adaptive_clip", None))
        mechanism.check()
        return mechanism

    def check(self) -> None:
        """Refuses parts that cannot be combined: a privatizer whose account needs a sampling
        scheme (``required_sampling``, BandMF's "cyclic_poisson") with any other scheme.

        Raises:
          ValueError: naming the parts and what to change.
        """
        required = getattr(self.privatizer, "required_sampling", None)
        if required and self.scheme.ledger_scheme != required:
            what = getattr(self.scheme, "description", f"{self.scheme.ledger_scheme!r} sampling")
            raise ValueError(f"noise={self.privatizer!r} needs {required!r} sampling, which tf_dp draws itself: "
                             f"{what} cannot be accounted for it. Pass arrays or an unbatched source to fit(), or "
                             "use the default Gaussian noise.")

    def ledger_arguments(self) -> tuple:
        """(scheme, q, N, L, parameter) of the ledger phase this mechanism runs in."""
        scheme = self.scheme
        return (scheme.ledger_scheme, scheme.sampling_rate, scheme.num_units, scheme.expected_batch_size,
                scheme.ledger_parameter)

    @property
    def new_segment(self) -> bool:
        """Whether each run starts a new accounting segment (the scheme says)."""
        return bool(self.scheme.new_segment)

    @property
    def declared_batch_size(self) -> Optional[float]:
        """The L explicit batches declare (None: the sampled batches carry their L)."""
        return getattr(self.scheme, "declared_batch_size", None)

    @property
    def accounted_whole(self) -> bool:
        """Whether a segment of this scheme is accounted whole, by its steps' positions (a
        restored ledger then continues as a new segment, and a blocked step stops training)."""
        if getattr(self.scheme, "event", None) is not None:  # the part declares it
            return bool(getattr(self.scheme, "whole_segments", False))
        return events.is_segmented(self.scheme.ledger_scheme)

    def event(self, phase: events.Phase) -> dp_event.DpEvent:
        """The dp_accounting event of a ledger phase this mechanism ran, asked of its sampling
        part (the event the scheme declares; the one registered under its name for a plug-in
        that registers by name). The part registered the same builder under its ledger name, so
        a reloaded ledger composes the same event (``events.declare_events``).

        Args:
          phase: a ``tf_dp.accounting.Phase`` of this mechanism's ledger scheme.

        Returns:
          The phase's event.

        Raises:
          ValueError: the phase is of another scheme.
        """
        if phase.scheme != self.scheme.ledger_scheme:
            raise ValueError(f"A phase of {phase.scheme!r} is not one of this mechanism's "
                             f"({self.scheme.ledger_scheme!r}).")
        return events.phase_event(phase, getattr(self.scheme, "event", None))
