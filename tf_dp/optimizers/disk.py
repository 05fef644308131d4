"""DiSK (Zhang et al., ICLR 2025; docs/algorithms.md §3): simplified Kalman filtering of ĝ.

    u_i = c ∇ℓ(θ_t + γd_t; x_i) + (1 − c) ∇ℓ(θ_t; x_i),  c = (1 − κ)/(κγ)
    ĝ_t = (Σ_i clip_C(u_i) + N(0, σ²C²I)) / L
    g̃_t = (1 − κ) g̃_{t−1} + κ ĝ_t
    θ_{t+1} = BaseOptimizer(θ_t, g̃_t)      base ∈ {"adamw", "adam", "sgd"}

With ``noise_bias_correction=True`` (Adam bases) the second moment is corrected by the
noise variance the EMA leaves in g̃_t, A_t·σ_w² with A_t = (1 − κ)² A_{t−1} + κ² → κ/(2 − κ),
not by the full σ_w² of ĝ_t (``correction="stationary"``: κ/(2 − κ) from the first step;
``"full"``: σ_w², for ablations).
"""

from __future__ import annotations

from typing import Optional

import keras

from tf_dp import _checks
from tf_dp.filters import ema_attenuation_factor, ema_filter, ema_noise_variance_step
from tf_dp.optimizers.dp_optimizer import DPOptimizer
from tf_dp.optimizers.dpadam import DPAdam
from tf_dp.optimizers.dpadamw import DPAdamW
from tf_dp.optimizers.dpsgd import DPSGD
from tf_dp.optimizers.noise_bias_correction import FilteredNoiseVariance
from tf_dp.optimizers.two_point import TwoPointObservation

BASES = ("adamw", "adam", "sgd")
# Untuned first tries (docs/fiber_study.md, "Untuned defaults"): lr = 5e-3 was DiSK-AdamW's tuned
# optimum at every ε on MNIST; the SGD base keeps Keras' SGD default.
DEFAULT_LEARNING_RATES = {"adamw": 5e-3, "adam": 5e-3, "sgd": 0.01}


class DiSK(TwoPointObservation, FilteredNoiseVariance, DPOptimizer):
    """``DiSK(learning_rate=None, kappa=0.7, gamma=0.5, base="adamw", **base_and_dp_kwargs)``.

    Builds the DiSK variant of the chosen base (``DiSKAdamW``, ``DiSKAdam``, ``DiSKSGD``);
    every argument of that base DP optimizer is accepted. κ = 1 is the base optimizer.
    ``learning_rate=None`` takes DEFAULT_LEARNING_RATES[base] (5e-3 for the Adam bases).
    """

    def __new__(cls, *args, base: str = "adamw", **kwargs):
        if cls is DiSK:
            cls = _VARIANTS[_checks.one_of("base", base, BASES)]
        return super().__new__(cls)

    def __init__(self, learning_rate=None, kappa: float = 0.7, gamma: float = 0.5, base: Optional[str] = None,
                 correction: str = "transient", **kwargs):
        if learning_rate is None:
            learning_rate = DEFAULT_LEARNING_RATES[self.base]
        kwargs.setdefault("name", type(self).__name__)
        super().__init__(learning_rate=learning_rate, **kwargs)
        self._init_two_point(kappa, gamma)
        self._init_correction(correction)
        self.attenuation = ema_attenuation_factor(self.kappa)  # stationary κ/(2 − κ)

    def _advance_filter_noise(self, state):
        """A_t = (1 − κ)² A_{t−1} + κ²."""
        return ema_noise_variance_step(state, self.kappa)

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self._filtered_gradients = self.add_optimizer_variables(variables, "filtered_gradient")

    def update_step(self, gradient, variable, learning_rate):
        """g̃_t = (1 − κ) g̃_{t−1} + κ ĝ_t, then the base update with g̃_t. Keras calls this
        per variable with ĝ already summed over tf.distribute replicas."""
        state = self._filtered_gradients[self._get_variable_index(variable)]
        filtered = ema_filter(state.value, keras.ops.cast(gradient, state.dtype), self.kappa)
        self.assign(state, filtered)
        return super().update_step(filtered, variable, learning_rate)

    def get_config(self):
        return {**super().get_config(), **self._two_point_config(), "base": self.base, "correction": self.correction}


@keras.saving.register_keras_serializable(package="tf_dp")
class DiSKAdamW(DiSK, DPAdamW):
    base = "adamw"


@keras.saving.register_keras_serializable(package="tf_dp")
class DiSKAdam(DiSK, DPAdam):
    base = "adam"


@keras.saving.register_keras_serializable(package="tf_dp")
class DiSKSGD(DiSK, DPSGD):
    base = "sgd"


_VARIANTS = {"adamw": DiSKAdamW, "adam": DiSKAdam, "sgd": DiSKSGD}
