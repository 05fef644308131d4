"""FIBER: filter-aware innovation bias-corrected AdamW (docs/algorithms.md §4).

Observation: DiSK's two-point u_i, privatized as ĝ_t = (Σ_i clip_C(u_i) + N(0, σ²C²I))/L;
(κ, γ) set only the observation geometry. Denoising by the innovation filter with gain ω:

    ν_t = ĝ_t − g̃_{t−1},  r_t = (1 − ω) r_{t−1} + ω ν_t,  g̃_t = g̃_{t−1} + r_t

then AdamW on g̃_t with the filter-aware second moment

    v̄_t = max(v̂_t − A_t·σ_w², variance_floor),  σ_w = σC/L
    θ_{t+1} = θ_t − η (m̂_t / (√v̄_t + ε) + λ_wd θ_t),

where A_t is the variance the filter, started at zero, leaves of unit white noise after t
steps (``tf_dp.filters.innovation_noise_covariance_step``); it grows to the stationary
A(ω) = (2 − ω)/(4 − 3ω) within a few 1/ω steps.

ω = 1 with a one-point observation (κ = 1) is DP-AdamBC; without the correction, DP-AdamW.

Ablation options (the optimizer study, docs/fiber_study.md): ``filter="ema"`` replaces the innovation filter by
DiSK's EMA with gain ω, g̃_t = (1 − ω) g̃_{t−1} + ω ĝ_t (A_t → ω/(2 − ω)), keeping (κ, γ) for
the observation only; ``correction="stationary"`` subtracts A·σ_w² from the first step and
``"full"`` the whole σ_w² (DP-AdamBC's correction); ``noise_bias_correction=False`` none.
"""

from __future__ import annotations

from typing import Optional

import keras

from tf_dp import _checks
from tf_dp.filters import (
    attenuation_factor,
    ema_attenuation_factor,
    ema_filter,
    ema_noise_variance_step,
    innovation_filter,
    innovation_noise_covariance_step,
)
from tf_dp.optimizers.dpadam import DEFAULT_VARIANCE_FLOOR
from tf_dp.optimizers.dpadamw import DPAdamW
from tf_dp.optimizers.noise_bias_correction import FilteredNoiseVariance

FILTERS = ("innovation", "ema")
from tf_dp.optimizers.two_point import TwoPointObservation


@keras.saving.register_keras_serializable(package="tf_dp")
class FIBER(TwoPointObservation, FilteredNoiseVariance, DPAdamW):
    """AdamW on the innovation-filtered privatized gradient, with the filter-attenuated
    noise variance A_t·σ_w² removed from the second moment (A_t → A(ω)). Accepts every
    argument of ``tf_dp.DPAdamW``."""

    _filter_noise_size = 3  # the noise covariance (a, c, d) of the state (g̃, r); A_t = a

    def __init__(
        self,
        learning_rate=0.001,
        kappa: float = 0.7,
        gamma: float = 0.5,
        omega: float = 0.5,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        variance_floor: float = DEFAULT_VARIANCE_FLOOR,
        weight_decay: float = 0.004,
        noise_bias_correction: bool = True,
        l2_norm_clip: float = 1.0,
        noise_multiplier: Optional[float] = None,
        seed: Optional[int] = None,
        secure_mode: bool = False,
        filter: str = "innovation",
        correction: str = "transient",
        name: str = "FIBER",
        **kwargs,
    ):
        super().__init__(
            learning_rate=learning_rate, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon,
            variance_floor=variance_floor, weight_decay=weight_decay, noise_bias_correction=noise_bias_correction,
            l2_norm_clip=l2_norm_clip, noise_multiplier=noise_multiplier, seed=seed, secure_mode=secure_mode, name=name,
            **kwargs,
        )
        self._init_two_point(kappa, gamma)
        self._init_correction(correction)
        self.filter = _checks.one_of("filter", filter, FILTERS)
        # stationary A(ω), or the EMA's ω/(2 − ω)
        self.attenuation = attenuation_factor(omega) if self.filter == "innovation" else ema_attenuation_factor(omega)
        self.omega = float(omega)

    def _advance_filter_noise(self, state):
        if self.filter == "ema":
            return keras.ops.stack([ema_noise_variance_step(state[0], self.omega), state[1], state[2]])
        return innovation_noise_covariance_step(state, self.omega)

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self._filtered_gradients = self.add_optimizer_variables(variables, "filtered_gradient")
        self._residuals = self.add_optimizer_variables(variables, "smoothed_residual")

    def update_step(self, gradient, variable, learning_rate):
        """The innovation filter on ĝ_t (summed over tf.distribute replicas by Keras), then
        the bias-corrected AdamW update with g̃_t."""
        index = self._get_variable_index(variable)
        state, residual = self._filtered_gradients[index], self._residuals[index]
        observation = keras.ops.cast(gradient, state.dtype)
        if self.filter == "ema":
            new_state = ema_filter(state.value, observation, self.omega)
        else:
            new_state, new_residual = innovation_filter(state.value, residual.value, observation, self.omega)
            self.assign(residual, new_residual)
        self.assign(state, new_state)
        return super().update_step(new_state, variable, learning_rate)

    def get_config(self):
        return {**super().get_config(), **self._two_point_config(), "omega": self.omega, "filter": self.filter,
                "correction": self.correction}
