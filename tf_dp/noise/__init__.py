"""Noise: the Gaussian mechanism's draw (ALGORITHMS §1 step 4)."""

from tf_dp.noise.gaussian import add_gaussian_noise, new_seed

__all__ = ["add_gaussian_noise", "new_seed"]
