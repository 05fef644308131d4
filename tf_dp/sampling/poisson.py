"""Poisson batch selection with static shapes (docs/algorithms.md §1 step 1).

Each step every example joins the batch independently with probability q = L/N — the
sampling the accountant assumes. The realized batch (size k ~ Binomial(N, q)) is laid out
in ⌈k/P⌉ chunks of a fixed physical size P, padded with a 0/1 mask: shapes are static
for XLA, no example is ever dropped, and padded rows (zeros, never a copy of an example)
contribute nothing. The train step sums the clipped gradients of all chunks and applies
noise once.

Batch t is a function of (seed, t) alone: a data pipeline restarted, prefetching ahead or
running on another worker reproduces exactly the batch of step t, and the batches of
different steps use independent randomness.
"""

from __future__ import annotations

import math
import os
from typing import Iterator, Optional

import numpy as np

from tf_dp import _checks

PAD_INDEX = 0  # any valid index: padding slots are never read (their rows are zeros), and masked


def sample_poisson_batch(rng, num_examples: int, sampling_rate: float) -> np.ndarray:
    """Indices of the examples drawn, each independently with probability ``sampling_rate``.
    ``rng`` is a numpy Generator, or ``os.urandom`` for OS-entropy (secure) sampling.

    Args:
      rng: a ``numpy.random.Generator``, or a callable like ``os.urandom`` returning n random bytes.
      num_examples: N, the number of examples to draw from.
      sampling_rate: q, each example's inclusion probability.

    Returns:
      The sorted indices of the drawn examples (their number varies from draw to draw).
    """
    return np.flatnonzero(_uniforms(rng, num_examples) < sampling_rate)


def _uniforms(rng, count: int) -> np.ndarray:
    if isinstance(rng, np.random.Generator):
        return rng.random(count)
    words = np.frombuffer(rng(8 * count), dtype=np.uint64)
    return (words >> np.uint64(11)).astype(np.float64) * 2.0**-53  # 53 random bits in [0, 1)


def _binomial_log_pmf(n: int, p: float, k: np.ndarray) -> np.ndarray:
    lgamma = np.vectorize(math.lgamma)
    return lgamma(n + 1) - lgamma(k + 1) - lgamma(n - k + 1) + k * math.log(p) + (n - k) * math.log1p(-p)


def choose_physical_batch_size(num_examples: int, sampling_rate: float) -> int:
    """P minimizing the expected rows processed per step, E[⌈k/P⌉]·P, k ~ Binomial(N, q).

    Too small a P often needs a second, mostly padded chunk; too large a P pads every
    step. Candidates are multiples of 8 from L up to L + 6√L.

    Args:
      num_examples: N, the dataset size.
      sampling_rate: q, the Poisson sampling rate (L = qN is the expected batch size).

    Returns:
      The physical batch size P (N when ``sampling_rate`` ≥ 1).
    """
    mean = num_examples * sampling_rate
    if sampling_rate >= 1:
        return num_examples
    std = math.sqrt(mean * (1 - sampling_rate))
    high = min(num_examples, int(math.ceil(mean + 10 * std + 10)))
    sizes = np.arange(0, high + 1)
    pmf = np.exp(_binomial_log_pmf(num_examples, sampling_rate, sizes))
    candidates = range(max(8, int(mean) // 8 * 8), max(16, int(mean + 6 * std) + 8), 8)

    def expected_rows(physical: int) -> float:
        chunks = np.maximum(1, np.ceil(sizes / physical))
        return float(np.sum(pmf * chunks * physical))

    return min(candidates, key=expected_rows)


def chunk(indices: np.ndarray, physical_batch_size: int, multiple: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Lays ``indices`` out as [n_chunks, P] (n_chunks a multiple of ``multiple``) and the
    0/1 mask. Padding slots hold PAD_INDEX, a placeholder, not an example: whoever gathers
    rows by these indices must not feed that example there (the sources of
    tf_dp.sampling.sources never read padding slots: their rows are zeros).

    Args:
      indices: the drawn examples' indices (e.g. from ``sample_poisson_batch``).
      physical_batch_size: P, the rows per chunk.
      multiple: the number of chunks is rounded up to a multiple of this (e.g. the replica count).

    Returns:
      The pair (padded indices, mask), both of shape [n_chunks, P].
    """
    chunks = max(1, math.ceil(len(indices) / physical_batch_size))
    chunks = math.ceil(chunks / multiple) * multiple
    padded = np.full(chunks * physical_batch_size, PAD_INDEX, dtype=np.int64)
    mask = np.zeros(chunks * physical_batch_size, dtype=np.float32)
    padded[: len(indices)] = indices
    mask[: len(indices)] = 1.0
    return padded.reshape(chunks, physical_batch_size), mask.reshape(chunks, physical_batch_size)


def stream_seed(seed, secure: bool):
    """The batch stream's seed: the user's ``seed`` hashed to 64 bits (None: OS entropy), or
    None in secure mode, which draws every batch from the OS and accepts no seed.

    Args:
      seed: the sampling seed, or None.
      secure: whether batches are drawn from the OS CSPRNG.

    Returns:
      A 64-bit int, or None in secure mode.
    """
    if secure and seed is not None:
        raise ValueError("secure sampling draws from the OS; it accepts no `seed`.")
    return None if secure else int(np.random.SeedSequence(seed).entropy) % 2**64


class StepSampler:
    """A sampler whose batch of step t is ``batch(t)``, a function of its secret seed and t
    only; ``stream`` serves steps in order from where the last stream stopped (or from a
    given step), ``next_step`` being that position. Base of every sampler."""

    next_step = 0

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def stream(self, first_step: Optional[int] = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Batches of steps first_step, first_step + 1, ... (default: where the last stream stopped)."""
        for _, indices, mask in self.numbered_stream(first_step):
            yield indices, mask

    def numbered_stream(self, first_step: Optional[int] = None) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """(t, indices, mask) = (t, *batch(t)) for t = first_step, first_step + 1, ... (default:
        where the last stream stopped); ``next_step`` is t + 1 once step t is served."""
        step = self.next_step if first_step is None else int(first_step)
        while True:
            self.next_step = step + 1
            yield (step, *self.batch(step))
            step += 1

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return self.stream()


class PoissonSampler(StepSampler):
    """Endless stream of Poisson batches as (index chunks, mask) of static width P.

    Args:
      num_examples: N.
      expected_batch_size: L; the sampling rate is q = L / N.
      physical_batch_size: P (None chooses it by ``choose_physical_batch_size``).
      seed: numpy seed for the batch selection (None: fresh OS entropy); batch t is drawn
        from ``numpy.random.default_rng([seed, t])``.
      secure: draw every step's uniforms from ``os.urandom`` (secure mode; no seed).
      chunk_multiple: the number of chunks of a step is rounded up to a multiple of this.
    """

    def __init__(self, num_examples: int, expected_batch_size: int, physical_batch_size: Optional[int] = None,
                 seed: Optional[int] = None, secure: bool = False, chunk_multiple: int = 1):
        self.num_examples = _checks.positive_int("num_examples", num_examples)
        self.expected_batch_size = _checks.batch_size_for(num_examples, expected_batch_size)
        self.sampling_rate = self.expected_batch_size / self.num_examples
        if physical_batch_size is None:
            physical_batch_size = choose_physical_batch_size(self.num_examples, self.sampling_rate)
        self.physical_batch_size = _checks.positive_int("physical_batch_size", physical_batch_size)
        self.secure = secure
        self.seed = stream_seed(seed, secure)
        self.chunk_multiple = _checks.positive_int("chunk_multiple", chunk_multiple)
        self.next_step = 0

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(index chunks [n, P], mask [n, P]) of the Poisson batch of step ``step``."""
        rng = os.urandom if self.secure else np.random.default_rng([self.seed, int(step)])
        indices = sample_poisson_batch(rng, self.num_examples, self.sampling_rate)
        return chunk(indices, self.physical_batch_size, self.chunk_multiple)

