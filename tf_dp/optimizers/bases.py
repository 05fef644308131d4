"""The inner optimizers of tf_dp's named DP optimizers, and their flat configs.

``DPSGD``, ``DPAdam``, ``DPAdamW``, ``DiSK`` and ``FIBER`` are ``tf_dp.DPOptimizer`` around
one of these bases. Their configs stay flat — the inner's arguments beside the DP ones, as
tf_dp has always saved them — so a config of any version rebuilds the same optimizer.
"""

from __future__ import annotations

import keras

from tf_dp import _checks
from tf_dp.optimizers.bias_corrected_adam import DEFAULT_VARIANCE_FLOOR, BiasCorrectedAdam, BiasCorrectedAdamW
from tf_dp.optimizers.dp_optimizer import DPOptimizer, _deserialized_dp_config

BASES = ("adamw", "adam", "sgd")
_PLAIN = {"sgd": keras.optimizers.SGD, "adam": keras.optimizers.Adam, "adamw": keras.optimizers.AdamW}
_CORRECTED = {"adam": BiasCorrectedAdam, "adamw": BiasCorrectedAdamW}


def make_inner(base: str, learning_rate, name: str, noise_bias_correction=None,
               variance_floor: float = DEFAULT_VARIANCE_FLOOR, **kwargs) -> keras.optimizers.Optimizer:
    """The Keras optimizer of ``base`` ("sgd", "adam", "adamw"); the Adam bases with
    ``noise_bias_correction=True`` subtract the noise variance the wrapper hands them
    (``BiasCorrectedAdam(W)``, docs/algorithms.md §2). Named like the wrapper, so the
    variables keep their paths (``DPSGD/dense_kernel_momentum``)."""
    base = _checks.one_of("base", base, BASES)
    if base == "sgd":
        if noise_bias_correction is not None:
            raise TypeError("`noise_bias_correction` corrects Adam's second moment; the SGD base has none. Drop it, "
                            "or use base='adam'/'adamw'.")
        return keras.optimizers.SGD(learning_rate=learning_rate, name=name, **kwargs)
    if noise_bias_correction is None:
        noise_bias_correction = False
    if not isinstance(noise_bias_correction, bool):
        raise TypeError(f"`noise_bias_correction` must be a bool, got {noise_bias_correction!r}.")
    variance_floor = _checks.positive("variance_floor", variance_floor)
    if noise_bias_correction:
        return _CORRECTED[base](learning_rate=learning_rate, variance_floor=variance_floor, name=name, **kwargs)
    return _PLAIN[base](learning_rate=learning_rate, name=name, **kwargs)


class FlatConfigDPOptimizer(DPOptimizer):
    """A DPOptimizer with a fixed base whose config is flat (inner arguments + DP arguments)."""

    base: str = "sgd"

    def _flat_config(self) -> dict:
        inner = dict(self.inner_optimizer.get_config())
        inner.pop("name", None)
        config = {"name": self.name, **inner, **self._dp_config()}
        if self.base != "sgd":
            config["noise_bias_correction"] = self.noise_bias_correction
            config["variance_floor"] = self.variance_floor
        return config

    def get_config(self):
        return self._flat_config()

    @classmethod
    def from_config(cls, config, custom_objects=None):
        return cls(**_deserialized_dp_config(config, custom_objects))
