"""DP optimizers: ``DPOptimizer(inner)`` noises once on the clipped sum, averages by L,
filters, then runs any Keras optimizer's update (docs/algorithms.md §1–§4)."""

from tf_dp.filters import attenuation_factor
from tf_dp.optimizers.clipped_sum import ClippedSum
from tf_dp.optimizers.bias_corrected_adam import BiasCorrectedAdam, BiasCorrectedAdamW, corrected_adam_direction
from tf_dp.optimizers.disk import DiSK, DiSKAdam, DiSKAdamW, DiSKSGD
from tf_dp.optimizers.dp_optimizer import DPOptimizer
from tf_dp.optimizers.dpadam import DPAdam
from tf_dp.optimizers.dpadamw import DPAdamW
from tf_dp.optimizers.dpsgd import DPSGD
from tf_dp.optimizers.fiber import FIBER
from tf_dp.optimizers.transforms import EMAFilter, GradientFilter, InnovationFilter, TwoPointObservation

__all__ = [
    "BiasCorrectedAdam", "BiasCorrectedAdamW", "ClippedSum", "DPAdam", "DPAdamW", "DPOptimizer", "DPSGD", "DiSK",
    "DiSKAdam", "DiSKAdamW", "DiSKSGD", "EMAFilter", "FIBER", "GradientFilter", "InnovationFilter",
    "TwoPointObservation",
    "attenuation_factor", "corrected_adam_direction",
]
