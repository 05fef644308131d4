"""RaCO-DP (docs/algorithms.md §5): private rate-constrained optimization (fairness and others).

constraints → noisy histogram (Laplace on the Poisson batch) → primal DP-SGD step on each
example's Lagrangian term + dual ascent on λ → joint (Gaussian, Laplace) accounting.
"""

from tf_dp.raco.accounting import (
    HISTOGRAM_MECHANISMS,
    GaussianLaplaceDpEvent,
    calibrate_noise_multiplier,
    calibrate_steps,
    compute_epsilon,
    effective_noise_multiplier,
    epsilon_of_phases,
    joint_step_pld,
)
from tf_dp.raco.constraints import (
    Constraint,
    ConstraintSet,
    DemographicParity,
    EqualizedOdds,
    FalseNegativeRate,
    RateConstraint,
)
from tf_dp.raco.histogram import NoisyHistogram
from tf_dp.raco.model import MultiplierReport, RateConstrainedModel

__all__ = [
    "Constraint", "ConstraintSet", "DemographicParity", "EqualizedOdds", "FalseNegativeRate",
    "GaussianLaplaceDpEvent", "HISTOGRAM_MECHANISMS",
    "MultiplierReport", "NoisyHistogram", "RateConstrainedModel", "RateConstraint", "calibrate_noise_multiplier",
    "calibrate_steps", "compute_epsilon", "effective_noise_multiplier", "epsilon_of_phases", "joint_step_pld",
]
