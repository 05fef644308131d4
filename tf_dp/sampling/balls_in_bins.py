"""Balls-in-bins sampling: every epoch, each example is thrown into one of B = ⌈N/L⌉ bins
(docs/algorithms.md §15).

Each epoch e (steps eB, …, eB + B − 1 of the DP step counter) draws a fresh secret assignment:
every example independently and uniformly into one of the B bins. Step t trains bin (t mod B) of
epoch ⌊t/B⌋, so an example is used in exactly one step of every epoch, like shuffling, while
the bins' sizes are random (Binomial(N, 1/B), mean ≈ L), and the noisy sum is divided by the
public L, never by a bin's size ("Balls-and-Bins sampling for DP-SGD", Chua et al., AISTATS 2025;
"random allocation", Feldman & Shenfeld 2025).

Accounting (sound, unamplified): within one epoch window an example changes at most one step, and
which step is a secret mixture; each component is one Gaussian mechanism of sensitivity C composed
adaptively with steps that do not depend on it, so by convexity of the hockey-stick divergence the
window is dominated by ONE Gaussian(σ). A segment (one ``fit``: one sampler, new secret
assignments) of T steps overlaps at most ⌈(T − 1)/B⌉ + 1 windows (its first step need not start
one), so it is accounted as that many Gaussian(σ) at the segment's smallest σ. The amplification
these papers show (ε close to Poisson's) is not claimed: their bounds are Monte Carlo estimates or
need accountants dp_accounting does not have.

The assignments are secrets like the batches: drawn from the sampler's secret seed and the epoch
(or OS entropy, kept in memory for the running epoch only) and never saved.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

import numpy as np
from dp_accounting import dp_event

from tf_dp import _checks
from tf_dp.sampling.poisson import StepSampler, _uniforms, choose_physical_batch_size, chunk, stream_seed
from tf_dp.sampling.schemes import SamplingScheme, register_sampling

NAME = "balls_in_bins"
LEDGER_CODE = 6  # written into saved models: never reuse


def number_of_bins(num_examples: int, expected_batch_size: int) -> int:
    """B = ⌈N/L⌉, the steps of one epoch (each bin holds N/B ≤ L examples on average).

    Args:
      num_examples: N.
      expected_batch_size: L.

    Returns:
      The number of bins B.
    """
    return math.ceil(num_examples / expected_batch_size)


def windows_overlapped(steps: int, bins: int) -> int:
    """The most epoch windows (B consecutive steps, aligned anywhere) that T consecutive steps
    overlap: ⌈(T − 1)/B⌉ + 1 for T ≥ 1 (0 for T = 0).

    Args:
      steps: T.
      bins: B.

    Returns:
      The number of windows to account.
    """
    return 0 if steps <= 0 else -(-(steps - 1) // bins) + 1


class BallsInBinsSampler(StepSampler):
    """Batches of balls-in-bins sampling as (index chunks, mask) of static width P.

    Args:
      num_examples: N.
      expected_batch_size: L; there are B = ⌈N/L⌉ bins, one step each per epoch.
      physical_batch_size: P (None: ``choose_physical_batch_size`` for bins of size Binomial(N, 1/B)).
      seed: numpy seed of the assignments (None: fresh OS entropy); never saved.
      secure: OS entropy for each epoch's assignment (kept in memory for that epoch only).
      chunk_multiple: the number of chunks is a multiple of this (replicas).
    """

    def __init__(self, num_examples: int, expected_batch_size: int, physical_batch_size: Optional[int] = None,
                 seed: Optional[int] = None, secure: bool = False, chunk_multiple: int = 1):
        self.num_examples = _checks.positive_int("num_examples", num_examples)
        self.expected_batch_size = _checks.batch_size_for(num_examples, expected_batch_size)
        self.bins = number_of_bins(self.num_examples, self.expected_batch_size)
        if physical_batch_size is None:
            physical_batch_size = choose_physical_batch_size(self.num_examples, 1.0 / self.bins)
        self.physical_batch_size = _checks.positive_int("physical_batch_size", physical_batch_size)
        self.secure = _checks.boolean("secure", secure)
        self.seed = stream_seed(seed, secure)
        self.chunk_multiple = _checks.positive_int("chunk_multiple", chunk_multiple)
        self._epoch, self._members = None, None
        self.next_step = 0

    def _assignment(self, epoch: int) -> np.ndarray:
        """The bin of every example in ``epoch``: independent, uniform on {0, …, B − 1}."""
        if self.secure:
            return np.minimum(np.floor(_uniforms(os.urandom, self.num_examples) * self.bins).astype(np.int64),
                              self.bins - 1)
        rng = np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(epoch,)))
        return rng.integers(0, self.bins, size=self.num_examples, dtype=np.int64)

    def _bins_of(self, epoch: int) -> list:
        """Sorted example indices of every bin of ``epoch`` (cached for the running epoch)."""
        if self._epoch != epoch:
            bins = self._assignment(epoch)
            order = np.argsort(bins, kind="stable")
            bounds = np.searchsorted(bins[order], np.arange(self.bins + 1))
            self._epoch, self._members = epoch, [order[bounds[b]:bounds[b + 1]] for b in range(self.bins)]
        return self._members

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(index chunks [n, P], mask [n, P]) of step ``step``: bin (step mod B) of epoch ⌊step/B⌋.

        Args:
          step: the DP step t.

        Returns:
          The padded indices and their 0/1 mask.
        """
        epoch, position = divmod(int(step), self.bins)
        return chunk(self._bins_of(epoch)[position], self.physical_batch_size, self.chunk_multiple)

    def __repr__(self) -> str:
        return (f"BallsInBinsSampler(num_examples={self.num_examples}, expected_batch_size="
                f"{self.expected_batch_size}, bins={self.bins}, <secret assignments>)")


@register_sampling(NAME)
@dataclasses.dataclass(frozen=True)
class BallsInBinsSampling(SamplingScheme):
    """Balls-in-bins sampling (``fit(..., sampling="balls_in_bins")``, docs/algorithms.md §15): the
    ledger records q = L/N and parameter B = ⌈N/L⌉, and every ``fit`` is a new segment (a new
    sampler, new secret assignments), accounted whole.

    Attributes:
      num_units: N.
      expected_batch_size: L.
    """

    ledger_code = LEDGER_CODE
    whole_segments = True

    @staticmethod
    def event(phase) -> dp_event.DpEvent:
        """The event this scheme declares for a phase (``balls_in_bins_event``).

        Args:
          phase: a ledger phase of scheme "balls_in_bins".

        Returns:
          The dp_accounting event.
        """
        return balls_in_bins_event(phase)

    @property
    def ledger_parameter(self) -> float:
        """B, the number of bins (the steps of one epoch)."""
        return float(number_of_bins(self.num_units, self.expected_batch_size))

    @property
    def new_segment(self) -> bool:
        """True: each ``fit`` draws new assignments, so its steps are a segment of their own."""
        return True

    def sampler(self, physical_batch_size, seed, secure, chunk_multiple=1):
        """The ``BallsInBinsSampler`` of this scheme.

        Args:
          physical_batch_size: P, or None to choose it.
          seed: the secret sampling seed (None: OS entropy).
          secure: draw the assignments from OS entropy.
          chunk_multiple: the number of chunks is a multiple of this.

        Returns:
          The sampler.
        """
        return BallsInBinsSampler(self.num_units, self.expected_batch_size, physical_batch_size, seed,
                                  secure=secure, chunk_multiple=chunk_multiple)


def balls_in_bins_event(phase) -> dp_event.DpEvent:
    """A segment of T steps with B = ``phase.parameter`` bins: ⌈(T − 1)/B⌉ + 1 × Gaussian(σ)
    (one unamplified Gaussian per epoch window it overlaps, docs/algorithms.md §15).

    Args:
      phase: a ledger phase of scheme "balls_in_bins" (a whole segment, merged at its smallest σ);
        B = ⌈N/L⌉ of the phase when its parameter is 0 (``compute_epsilon`` without ``parameter``).

    Returns:
      The dp_accounting event.
    """
    bins = int(phase.parameter) or number_of_bins(phase.num_examples, int(phase.expected_batch_size))
    windows = windows_overlapped(phase.steps, bins)
    return dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(phase.noise_multiplier), windows)
