"""Models whose train step is DP-SGD."""

from tf_dp.models.dp_model import DPFunctional, DPModel, DPModelMixin, DPSequential, make_private
from tf_dp.models.validation import fix, validate

__all__ = ["DPFunctional", "DPModel", "DPModelMixin", "DPSequential", "fix", "make_private", "validate"]
