"""Noise: the Gaussian mechanism's draw (ALGORITHMS §1 step 4) and RaCO-DP's Laplace."""

from tf_dp.noise.gaussian import add_gaussian_noise, new_seed, secure_key
from tf_dp.noise.laplace import laplace_noise

__all__ = ["add_gaussian_noise", "laplace_noise", "new_seed", "secure_key"]
