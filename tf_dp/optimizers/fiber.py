"""FIBER: filter-aware innovation bias-corrected AdamW (docs/algorithms.md §4).

Observation: DiSK's two-point u_i, privatized as ĝ_t = (Σ_i clip_C(u_i) + N(0, σ²C²I))/L;
(κ, γ) set only the observation geometry. Denoising by the innovation filter with gain ω:

    ν_t = ĝ_t − g̃_{t−1},  r_t = (1 − ω) r_{t−1} + ω ν_t,  g̃_t = g̃_{t−1} + r_t

then AdamW on g̃_t with the filter-aware second moment

    v̄_t = max(v̂_t − A_t·σ_w², variance_floor),  σ_w = σC/L
    θ_{t+1} = θ_t − η (m̂_t / (√v̄_t + ε) + λ_wd θ_t),

where A_t is the variance the filter, started at zero, leaves of unit white noise after t
steps (``tf_dp.filters.innovation_noise_covariance_step``); it grows to the stationary
A(ω) = (2 − ω)/(4 − 3ω) within a few 1/ω steps. The chain of ``tf_dp.DPOptimizer``: a
``TwoPointObservation``, an ``InnovationFilter`` handing on A_t·σ_w², and
``BiasCorrectedAdamW`` as the inner optimizer.

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
from tf_dp.optimizers.bases import make_inner
from tf_dp.optimizers.bias_corrected_adam import DEFAULT_VARIANCE_FLOOR
from tf_dp.optimizers.filtered import FilteredDPOptimizer
from tf_dp.optimizers.transforms import EMAFilter, InnovationFilter, TwoPointObservation

FILTERS = ("innovation", "ema")


@keras.saving.register_keras_serializable(package="tf_dp")
class FIBER(FilteredDPOptimizer):
    """AdamW on the innovation-filtered privatized gradient, with the filter-attenuated
    noise variance A_t·σ_w² removed from the second moment (A_t → A(ω)). Accepts every
    argument of ``tf_dp.DPAdamW``.

    Args:
      learning_rate: η, a float or a Keras schedule.
      kappa: κ, the observation's weight (docs/algorithms.md §4).
      gamma: γ, the observation's look-ahead step.
      omega: ω in (0, 1], the innovation filter's gain.
      beta_1: Adam's β₁.
      beta_2: Adam's β₂.
      epsilon: Adam's ε.
      variance_floor: the floor of the corrected second moment.
      weight_decay: λ_wd, the decoupled weight decay.
      noise_bias_correction: whether to remove the filter-attenuated noise variance from v̂.
      l2_norm_clip: C, the per-example clipping bound (or an adaptive bound), as in ``tf_dp.DPOptimizer``.
      noise_multiplier: σ; None only when a ``target_epsilon`` given to ``DPModel.compile`` calibrates it.
      seed: the noise stream's key, or None for a fresh one from the OS.
      secure_mode: a fresh key from the OS CSPRNG at every step (``tf_dp.DPOptimizer``).
      filter: "innovation" (default) or "ema" (an ablation: DiSK's EMA with gain ω).
      correction: "transient" (default), "stationary" or "full" (see the module docstring).
      name: the optimizer's name.
      noise: the privatizer (a ``tf_dp.noise.Privatizer``, a registered name, or None for Gaussian).
      clipping: the clipping policy (a ``tf_dp.clipping.ClippingPolicy``, a registered name, or None for flat).
      **kwargs: any other argument of ``keras.optimizers.AdamW``.
    """

    base = "adamw"

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
        l2_norm_clip=1.0,
        noise_multiplier: Optional[float] = None,
        seed: Optional[int] = None,
        secure_mode: bool = False,
        filter: str = "innovation",
        correction: str = "transient",
        name: str = "FIBER",
        noise=None,
        clipping=None,
        **kwargs,
    ):
        inner = make_inner("adamw", learning_rate, name, noise_bias_correction, variance_floor, beta_1=beta_1,
                           beta_2=beta_2, epsilon=epsilon, weight_decay=weight_decay, **kwargs)
        super().__init__(inner, l2_norm_clip, noise_multiplier, seed, secure_mode, noise, clipping, name=name)
        self.noise_bias_correction, self.variance_floor = noise_bias_correction, float(variance_floor)
        self.filter = _checks.one_of("filter", filter, FILTERS)
        observation = TwoPointObservation(kappa, gamma)
        gain_filter = InnovationFilter if self.filter == "innovation" else EMAFilter
        self._set_parts(observation, gain_filter(omega, correction))
        self.omega = float(omega)

    @property
    def _residuals(self) -> list:
        """r_t per trainable variable (the innovation filter's state)."""
        return self.part_state(self.gradient_filter)["smoothed_residual"]

    def _legacy_layouts(self) -> list:
        """FIBER(filter="ema") used to save the innovation filter's layout: a 3-entry noise
        covariance (A_t first) and unused residuals after the filtered gradients."""
        if self.filter != "ema" or not self.built:
            return []
        state = self.part_state(self.gradient_filter)
        head = self._saved_variables()
        head = head[:len(head) - len(self._part_variables())]
        covariance = [(state["noise_covariance"], lambda saved: saved[:1])]
        rest = [(v, None) for v in self._previous_weights + self._filtered_gradients]
        return [[(v, None) for v in head] + covariance + rest + [(None, None)] * len(self._filtered_gradients)]

    def get_config(self):
        return {**self._flat_config(), **self._two_point_config(), "omega": self.omega, "filter": self.filter}
