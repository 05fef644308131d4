"""Filters: post-processing of the privatized gradient ĝ_t before the update (free in privacy)."""

from tf_dp.filters.ema import ema_filter
from tf_dp.filters.innovation import attenuation_factor, innovation_filter

__all__ = ["attenuation_factor", "ema_filter", "innovation_filter"]
