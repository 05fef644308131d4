"""Cyclic Poisson sampling for banded matrix-factorization noise (docs/algorithms.md §10).

Every example is assigned once, independently and uniformly, to one of b groups; step t
Poisson-samples group (t mod b) only, each member joining with probability q_b = b·L/N (expected
batch L). So an example can take part only in steps b apart — the band's columns of one example
never overlap — and a run of T steps is accounted as ⌈T/b⌉ Poisson-sampled Gaussian steps at rate
q_b (``tf_dp.accounting.bandmf.bandmf_event``).

The group assignment is a secret like the batches (amplification assumes nobody knows who was
sampled): it is drawn from the sampler's secret seed (or OS entropy) and never saved. Batch t is a
function of (seed, t) alone, laid out like ``PoissonSampler``'s: [chunks, P] indices and a mask.
``CyclicPoissonSampling`` is the scheme ``fit`` picks for a privatizer with
``required_sampling = "cyclic_poisson"`` (``tf_dp.noise.BandMF``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import numpy as np

from tf_dp import _checks, streams
from tf_dp.accounting.bandmf import cyclic_poisson_phase_event
from tf_dp.sampling.poisson import StepSampler, _uniforms, choose_physical_batch_size, chunk, stream_seed
from tf_dp.sampling.schemes import SamplingScheme, register_sampling

_GROUP_STREAM = streams.CYCLIC_GROUPS.code  # SeedSequence spawn keys (tf_dp.streams): (0,) the groups,
_STEP_STREAM = streams.CYCLIC_STEPS.code  # (1, t) the batch of step t


def group_sampling_rate(num_examples: int, expected_batch_size: int, num_bands: int) -> float:
    """q_b = b·L/N, the Poisson rate within the sampled group (docs/algorithms.md §10).

    Raises:
      ValueError: if q_b > 1 (the groups are too small for batches of L).
    """
    rate = num_bands * expected_batch_size / num_examples
    if rate > 1:
        raise ValueError(
            f"Cyclic Poisson sampling with num_bands={num_bands} and batch_size={expected_batch_size} over "
            f"{num_examples} examples needs a rate b·L/N = {rate:.4g} > 1 within each group of ≈N/b examples. "
            f"Use batch_size ≤ {num_examples // num_bands} or num_bands ≤ {num_examples // expected_batch_size}.")
    return rate


def assign_groups(rng, num_examples: int, num_bands: int) -> np.ndarray:
    """Group of every example, independent and uniform on {0, …, b − 1}. ``rng`` is a numpy
    Generator or ``os.urandom`` (53-bit uniforms, ⌊U·b⌋)."""
    if isinstance(rng, np.random.Generator):
        return rng.integers(0, num_bands, size=num_examples, dtype=np.int64)
    return np.minimum(np.floor(_uniforms(rng, num_examples) * num_bands).astype(np.int64), num_bands - 1)


class CyclicPoissonSampler(StepSampler):
    """Endless stream of cyclic Poisson batches as (index chunks, mask) of static width P.

    Args:
      num_examples: N.
      expected_batch_size: L; within group (t mod b) each example joins step t with q_b = b·L/N.
      num_bands: b, the number of groups (BandMF's bands).
      physical_batch_size: P (None: ``choose_physical_batch_size`` for a group of N/b at q_b).
      seed: numpy seed of the group assignment and the batches (None: fresh OS entropy); never saved.
      secure: OS entropy for the group assignment (drawn once per sampler) and every step's uniforms.
      chunk_multiple: the number of chunks is a multiple of this (replicas).
    """

    def __init__(self, num_examples: int, expected_batch_size: int, num_bands: int,
                 physical_batch_size: Optional[int] = None, seed: Optional[int] = None, secure: bool = False,
                 chunk_multiple: int = 1):
        self.num_examples = _checks.positive_int("num_examples", num_examples)
        self.expected_batch_size = _checks.batch_size_for(num_examples, expected_batch_size)
        self.num_bands = _checks.positive_int("num_bands", num_bands)
        self.sampling_rate = group_sampling_rate(self.num_examples, self.expected_batch_size, self.num_bands)
        if physical_batch_size is None:
            group_size = max(1, round(self.num_examples / self.num_bands))
            physical_batch_size = choose_physical_batch_size(group_size, min(1.0, self.sampling_rate))
        self.physical_batch_size = _checks.positive_int("physical_batch_size", physical_batch_size)
        self.secure = _checks.boolean("secure", secure)
        self.seed = stream_seed(seed, secure)
        self.chunk_multiple = _checks.positive_int("chunk_multiple", chunk_multiple)
        self._members = self._group_members()
        self.next_step = 0

    @property
    def sampling_rate_per_group(self) -> float:
        """q_b = b·L/N (the ledger's q of a "cyclic_poisson" phase)."""
        return self.sampling_rate

    def _rng(self, *spawn_key: int):
        return np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=spawn_key))

    def _group_members(self) -> list:
        """Sorted example indices of each group (the secret assignment, in memory only)."""
        rng = os.urandom if self.secure else self._rng(_GROUP_STREAM)
        groups = assign_groups(rng, self.num_examples, self.num_bands)
        order = np.argsort(groups, kind="stable")
        bounds = np.searchsorted(groups[order], np.arange(self.num_bands + 1))
        return [order[bounds[g]:bounds[g + 1]] for g in range(self.num_bands)]

    def group_of_step(self, step: int) -> int:
        return int(step) % self.num_bands

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(index chunks [n, P], mask [n, P]) of step ``step``: group (step mod b), each member
        kept with probability q_b."""
        members = self._members[self.group_of_step(step)]
        rng = os.urandom if self.secure else self._rng(_STEP_STREAM, int(step))
        drawn = members[_uniforms(rng, len(members)) < self.sampling_rate] if len(members) else members
        return chunk(drawn, self.physical_batch_size, self.chunk_multiple)


    def __repr__(self) -> str:
        return (f"CyclicPoissonSampler(num_examples={self.num_examples}, expected_batch_size="
                f"{self.expected_batch_size}, num_bands={self.num_bands}, <secret groups>)")



@register_sampling("cyclic_poisson")
@dataclasses.dataclass(frozen=True)
class CyclicPoissonSampling(SamplingScheme):
    """Cyclic Poisson sampling over b groups (docs/algorithms.md §10.2): the ledger records q_b = b·L/N
    and parameter b, and every ``fit`` is a new segment (a new sampler: a new group assignment, so
    the privatizer's buffer restarts too, §10.3).

    Attributes:
      num_bands: b (from ``BandMF.sampling_arguments()``).
    """

    num_bands: int = 1
    event = staticmethod(cyclic_poisson_phase_event)  # BandMF's segment event (docs/algorithms.md §10.3)
    whole_segments = True

    def __post_init__(self):
        _checks.positive_int("num_bands", self.num_bands)
        group_sampling_rate(self.num_units, self.expected_batch_size, self.num_bands)  # refuses q_b > 1

    @property
    def sampling_rate(self) -> float:
        return group_sampling_rate(self.num_units, self.expected_batch_size, self.num_bands)

    @property
    def ledger_parameter(self) -> float:
        return float(self.num_bands)

    @property
    def new_segment(self) -> bool:
        return True

    def sampler(self, physical_batch_size, seed, secure, chunk_multiple=1):
        return CyclicPoissonSampler(self.num_units, self.expected_batch_size, self.num_bands, physical_batch_size,
                                    seed, secure=secure, chunk_multiple=chunk_multiple)
