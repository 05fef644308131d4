"""Models whose train step is DP-SGD."""

from tf_dp.models.dp_model import DPFunctional, DPModel, DPModelMixin, DPSequential, make_private
from tf_dp.models.validation import privacy_problems

__all__ = ["DPFunctional", "DPModel", "DPModelMixin", "DPSequential", "make_private", "privacy_problems"]
