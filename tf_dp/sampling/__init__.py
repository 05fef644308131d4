"""Batch selection: Poisson sampling laid out in fixed-size masked chunks, and the loader
that reads only the sampled examples from a random-access source."""

from tf_dp.sampling.poisson import PoissonSampler, choose_physical_batch_size, chunk, sample_poisson_batch
from tf_dp.sampling.sources import (ArraySource, DatasetSource, ExampleSource, RecordSource, SourceError,
                                    TFRecordSource, example_source)
from tf_dp.sampling.users import UserPoissonSampler

__all__ = ["ArraySource", "DatasetSource", "ExampleSource", "PoissonSampler", "RecordSource", "SourceError",
           "TFRecordSource", "UserPoissonSampler", "choose_physical_batch_size", "chunk", "example_source",
           "sample_poisson_batch"]
