"""RaCO-DP (ALGORITHMS §5): private rate-constrained optimization. For now: its accounting."""

from tf_dp.raco.accounting import (
    HISTOGRAM_MECHANISMS,
    calibrate_noise_multiplier,
    calibrate_steps,
    compute_epsilon,
    effective_noise_multiplier,
    joint_step_pld,
)

__all__ = [
    "HISTOGRAM_MECHANISMS", "calibrate_noise_multiplier", "calibrate_steps", "compute_epsilon",
    "effective_noise_multiplier", "joint_step_pld",
]
