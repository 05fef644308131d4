"""DiSK (Zhang et al., ICLR 2025; docs/algorithms.md §3): simplified Kalman filtering of ĝ.

    u_i = c ∇ℓ(θ_t + γd_t; x_i) + (1 − c) ∇ℓ(θ_t; x_i),  c = (1 − κ)/(κγ)
    ĝ_t = (Σ_i clip_C(u_i) + N(0, σ²C²I)) / L
    g̃_t = (1 − κ) g̃_{t−1} + κ ĝ_t
    θ_{t+1} = BaseOptimizer(θ_t, g̃_t)      base ∈ {"adamw", "adam", "sgd"}

The chain of ``tf_dp.DPOptimizer`` with a ``TwoPointObservation`` and an ``EMAFilter``
(gain κ) around the base. With ``noise_bias_correction=True`` (Adam bases) the inner
``BiasCorrectedAdam(W)`` subtracts the noise variance the EMA leaves in g̃_t, A_t·σ_w² with
A_t = (1 − κ)² A_{t−1} + κ² → κ/(2 − κ), not the full σ_w² of ĝ_t
(``correction="stationary"``: κ/(2 − κ) from the first step; ``"full"``: σ_w², ablations).
"""

from __future__ import annotations

from typing import Optional

import keras

from tf_dp import _checks
from tf_dp.optimizers.bases import BASES, make_inner
from tf_dp.optimizers.bias_corrected_adam import DEFAULT_VARIANCE_FLOOR
from tf_dp.optimizers.filtered import FilteredDPOptimizer
from tf_dp.optimizers.transforms import EMAFilter, TwoPointObservation

# Untuned first tries (docs/fiber_study.md, "Untuned defaults"): lr = 5e-3 was DiSK-AdamW's tuned
# optimum at every ε on MNIST; the SGD base keeps Keras' SGD default.
DEFAULT_LEARNING_RATES = {"adamw": 5e-3, "adam": 5e-3, "sgd": 0.01}
_NAMES = {"adamw": "DiSKAdamW", "adam": "DiSKAdam", "sgd": "DiSKSGD"}


@keras.saving.register_keras_serializable(package="tf_dp")
class DiSK(FilteredDPOptimizer):
    """``DiSK(learning_rate=None, kappa=0.7, gamma=0.5, base="adamw", **base_and_dp_kwargs)``.

    Every argument of the base's DP optimizer (``DPAdamW``, ``DPAdam``, ``DPSGD``) is
    accepted. κ = 1 is the base optimizer. ``learning_rate=None`` takes
    DEFAULT_LEARNING_RATES[base] (5e-3 for the Adam bases).

    Args:
      learning_rate: η, or None for DEFAULT_LEARNING_RATES[base].
      kappa: κ in (0, 1], the filter's gain (1: the base optimizer).
      gamma: γ, the observation's look-ahead step (docs/algorithms.md §4).
      base: the base optimizer: "adamw", "adam" or "sgd".
      correction: how the filtered noise variance is removed from the second moment ("transient" default).
      l2_norm_clip: C, the per-example clipping bound (or an adaptive bound), as in ``tf_dp.DPOptimizer``.
      noise_multiplier: σ; None only when a ``target_epsilon`` given to ``DPModel.compile`` calibrates it.
      seed: the noise stream's key, or None for a fresh one from the OS.
      secure_mode: a fresh key from the OS CSPRNG at every step (``tf_dp.DPOptimizer``).
      noise_bias_correction: whether to correct the second moment for the noise (None: the base's default).
      variance_floor: the floor of the corrected second moment.
      name: the optimizer's name, or None for a default.
      noise: the privatizer (a ``tf_dp.noise.Privatizer``, a registered name, or None for Gaussian).
      clipping: the clipping policy (a ``tf_dp.clipping.ClippingPolicy``, a registered name, or None for flat).
      **kwargs: any other argument of the base's DP optimizer.
    """

    def __init__(self, learning_rate=None, kappa: float = 0.7, gamma: float = 0.5, base: str = "adamw",
                 correction: str = "transient", l2_norm_clip=1.0, noise_multiplier: Optional[float] = None,
                 seed: Optional[int] = None, secure_mode: bool = False, noise_bias_correction: Optional[bool] = None,
                 variance_floor: float = DEFAULT_VARIANCE_FLOOR, name: Optional[str] = None, noise=None,
                 clipping=None, **kwargs):
        base = _checks.one_of("base", base, BASES)
        learning_rate = DEFAULT_LEARNING_RATES[base] if learning_rate is None else learning_rate
        name = name or _NAMES[base]
        if base == "adamw":
            kwargs.setdefault("weight_decay", 0.004)
        inner = make_inner(base, learning_rate, name, noise_bias_correction, variance_floor, **kwargs)
        super().__init__(inner, l2_norm_clip, noise_multiplier, seed, secure_mode, noise, clipping, name=name)
        self.base = base
        self.noise_bias_correction, self.variance_floor = bool(noise_bias_correction), float(variance_floor)
        observation = TwoPointObservation(kappa, gamma)
        self._set_parts(observation, EMAFilter(observation.kappa, correction))

    def get_config(self):
        return {**self._flat_config(), **self._two_point_config(), "base": self.base}


@keras.saving.register_keras_serializable(package="tf_dp")
class DiSKAdamW(DiSK):
    """``DiSK(base="adamw")``.

    Args:
      learning_rate: η, or None for DEFAULT_LEARNING_RATES["adamw"].
      kappa: κ in (0, 1], the filter's gain.
      gamma: γ, the observation's look-ahead step.
      base: the base optimizer (default "adamw").
      **kwargs: any other argument of ``DiSK``.
    """

    def __init__(self, learning_rate=None, kappa: float = 0.7, gamma: float = 0.5, base: str = "adamw", **kwargs):
        _require_base(type(self), base, "adamw")
        super().__init__(learning_rate, kappa, gamma, "adamw", **kwargs)


@keras.saving.register_keras_serializable(package="tf_dp")
class DiSKAdam(DiSK):
    """``DiSK(base="adam")``.

    Args:
      learning_rate: η, or None for DEFAULT_LEARNING_RATES["adam"].
      kappa: κ in (0, 1], the filter's gain.
      gamma: γ, the observation's look-ahead step.
      base: the base optimizer (default "adam").
      **kwargs: any other argument of ``DiSK``.
    """

    def __init__(self, learning_rate=None, kappa: float = 0.7, gamma: float = 0.5, base: str = "adam", **kwargs):
        _require_base(type(self), base, "adam")
        super().__init__(learning_rate, kappa, gamma, "adam", **kwargs)


@keras.saving.register_keras_serializable(package="tf_dp")
class DiSKSGD(DiSK):
    """``DiSK(base="sgd")``.

    Args:
      learning_rate: η, or None for DEFAULT_LEARNING_RATES["sgd"].
      kappa: κ in (0, 1], the filter's gain.
      gamma: γ, the observation's look-ahead step.
      base: the base optimizer (default "sgd").
      **kwargs: any other argument of ``DiSK``.
    """

    def __init__(self, learning_rate=None, kappa: float = 0.7, gamma: float = 0.5, base: str = "sgd", **kwargs):
        _require_base(type(self), base, "sgd")
        super().__init__(learning_rate, kappa, gamma, "sgd", **kwargs)


def _require_base(cls, given: str, base: str) -> None:
    if given != base:
        raise ValueError(f"{cls.__name__} has base={base!r}; got base={given!r}. Use tf_dp.DiSK(base=...).")
