"""DiSK's state filter (Zhang et al., ICLR 2025; ALGORITHMS §3)."""

from __future__ import annotations


def ema_filter(previous, observation, kappa: float):
    """g̃_t = (1 − κ) g̃_{t−1} + κ ĝ_t."""
    return (1 - kappa) * previous + kappa * observation
