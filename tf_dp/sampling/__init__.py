"""Batch selection: Poisson sampling laid out in fixed-size masked chunks."""

from tf_dp.sampling.poisson import PoissonSampler, choose_physical_batch_size, chunk, sample_poisson_batch

__all__ = ["PoissonSampler", "choose_physical_batch_size", "chunk", "sample_poisson_batch"]
