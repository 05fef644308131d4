"""Noise: the Gaussian mechanism's draw (docs/algorithms.md §1 step 4), banded matrix-factorization
noise (``BandMF``, §10) and RaCO-DP's Laplace, keyed by a secret that is never saved (``key``) and a
counter that never repeats; ``SumNoise`` states a second release the optimizer draws for a plug-in
(``DPOptimizer.release_sum``)."""

from tf_dp.noise.bandmf import BandMF
from tf_dp.noise.gaussian import add_gaussian_noise
from tf_dp.noise.key import NoiseKey, new_seed, secure_key
from tf_dp.noise.laplace import laplace_noise
from tf_dp.noise.release import SumNoise

__all__ = ["BandMF", "NoiseKey", "SumNoise", "add_gaussian_noise", "laplace_noise", "new_seed", "secure_key"]
