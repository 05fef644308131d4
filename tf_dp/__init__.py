"""tf_dp: differentially private training for TensorFlow with Keras 3.

features (``tf_dp.features``, fixed per-example maps, no privacy cost) →
sample (``tf_dp.sampling``) → per-example norms and clipping (``tf_dp.clipping``) →
noise (``tf_dp.noise``) → filter (``tf_dp.filters``) → update (``tf_dp.optimizers``) → account (``tf_dp.accounting``).
"""

from tf_dp import accounting, audit, clipping, features, filters, noise, raco, sampling
from tf_dp.accounting import calibrate_noise_multiplier, compute_epsilon
from tf_dp.accounting.callbacks import PrivacyBudget, PrivacyReport
from tf_dp.averaging import ParameterAveraging
from tf_dp.models import DPModel, DPSequential, fix, make_private, validate
from tf_dp.optimizers import FIBER, DiSK, DPAdam, DPAdamW, DPOptimizer, DPSGD

from tf_dp._version import __version__  # noqa: E402

__all__ = [
    "FIBER", "DPAdam", "DPAdamW", "DPModel", "DPOptimizer", "DPSGD", "DiSK", "DPSequential", "PrivacyBudget",
    "PrivacyReport",
    "accounting", "audit", "calibrate_noise_multiplier", "clipping", "features", "filters", "raco", "compute_epsilon",
    "make_private", "noise",
    "fix", "sampling", "validate", "ParameterAveraging", "__version__",
]
