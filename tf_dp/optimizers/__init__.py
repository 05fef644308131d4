"""DP optimizers: noise once on the clipped sum, average by L, then the base update."""

from tf_dp.filters import attenuation_factor
from tf_dp.optimizers.disk import DiSK, DiSKAdam, DiSKAdamW, DiSKSGD
from tf_dp.optimizers.dp_optimizer import DPOptimizer
from tf_dp.optimizers.dpadam import DPAdam
from tf_dp.optimizers.dpadamw import DPAdamW
from tf_dp.optimizers.dpsgd import DPSGD
from tf_dp.optimizers.fiber import FIBER
from tf_dp.optimizers.noise_bias_correction import corrected_adam_direction

__all__ = [
    "DPAdam", "DPAdamW", "DPOptimizer", "DPSGD", "DiSK", "DiSKAdam", "DiSKAdamW", "DiSKSGD", "FIBER",
    "attenuation_factor", "corrected_adam_direction",
]
