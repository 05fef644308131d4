"""Filters: post-processing of the privatized gradient ĝ_t before the update (free in privacy)."""

from tf_dp.filters.ema import ema_attenuation_factor, ema_filter, ema_noise_variance_step
from tf_dp.filters.innovation import attenuation_factor, innovation_filter, innovation_noise_covariance_step

__all__ = [
    "attenuation_factor", "ema_attenuation_factor", "ema_filter", "ema_noise_variance_step", "innovation_filter",
    "innovation_noise_covariance_step",
]
