"""DP optimizers: noise once on the clipped sum, average by L, then the base update."""

from tf_dp.optimizers.dp_optimizer import DPOptimizer
from tf_dp.optimizers.dpadam import DPAdam
from tf_dp.optimizers.dpadamw import DPAdamW
from tf_dp.optimizers.dpsgd import DPSGD
from tf_dp.optimizers.noise_bias_correction import corrected_adam_direction

__all__ = ["DPOptimizer", "DPSGD", "DPAdam", "DPAdamW", "corrected_adam_direction"]
