"""Batch selection: Poisson sampling laid out in fixed-size masked chunks (its cyclic variant for
banded matrix-factorization noise, docs/algorithms.md §10, and Poisson sampling of users,
§11), and the loader that reads only the
sampled examples from a random-access source."""

from tf_dp.sampling.balls_in_bins import BallsInBinsSampler  # noqa: F401  (registers "balls_in_bins" sampling)
from tf_dp.sampling.cyclic_poisson import CyclicPoissonSampler
from tf_dp.sampling.poisson import PoissonSampler, choose_physical_batch_size, chunk, sample_poisson_batch
from tf_dp.sampling.sources import (ArraySource, DatasetSource, ExampleSource, RecordSource, SourceError,
                                    TFRecordSource, example_source)
from tf_dp.sampling.users import UserPoissonSampler

__all__ = ["ArraySource", "CyclicPoissonSampler", "DatasetSource", "ExampleSource", "PoissonSampler", "RecordSource",
           "SourceError", "TFRecordSource", "UserPoissonSampler", "choose_physical_batch_size", "chunk",
           "example_source",
           "sample_poisson_batch"]
