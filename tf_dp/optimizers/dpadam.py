"""DP-Adam, optionally with the noise-bias correction of DP-AdamBC (docs/algorithms.md §2)."""

from __future__ import annotations

from typing import Optional

import keras

from tf_dp.optimizers.bases import FlatConfigDPOptimizer, make_inner
from tf_dp.optimizers.bias_corrected_adam import DEFAULT_VARIANCE_FLOOR


@keras.saving.register_keras_serializable(package="tf_dp")
class DPAdam(FlatConfigDPOptimizer):
    """Adam on ĝ = (Σ_i clip_C(g_i) + N(0, σ²C²I)) / L.

    ``noise_bias_correction=True`` (DP-AdamBC, Tang et al. 2024) replaces v̂ by
    v̄ = max(v̂ − σ_w², variance_floor), σ_w = σC/L, in the denominator √v̄ + ε: the inner
    optimizer is then ``tf_dp.optimizers.BiasCorrectedAdam``, else ``keras.optimizers.Adam``.
    Accepts every argument of ``keras.optimizers.Adam``.

    Args:
      learning_rate: η, a float or a Keras schedule.
      l2_norm_clip: C, the per-example clipping bound (or an adaptive bound), as in ``tf_dp.DPOptimizer``.
      noise_multiplier: σ; None only when a ``target_epsilon`` given to ``DPModel.compile`` calibrates it.
      seed: the noise stream's key, or None for a fresh one from the OS.
      secure_mode: a fresh key from the OS CSPRNG at every step (``tf_dp.DPOptimizer``).
      noise_bias_correction: whether to subtract the noise variance σ_w² from v̂ (DP-AdamBC).
      variance_floor: the floor of the corrected second moment.
      name: the optimizer's name.
      noise: the privatizer (a ``tf_dp.noise.Privatizer``, a registered name, or None for Gaussian).
      clipping: the clipping policy (a ``tf_dp.clipping.ClippingPolicy``, a registered name, or None for flat).
      **kwargs: any other argument of ``keras.optimizers.Adam``.
    """

    base = "adam"

    def __init__(
        self,
        learning_rate=0.001,
        l2_norm_clip=1.0,
        noise_multiplier: Optional[float] = None,
        seed: Optional[int] = None,
        secure_mode: bool = False,
        noise_bias_correction: bool = False,
        variance_floor: float = DEFAULT_VARIANCE_FLOOR,
        name: str = "DPAdam",
        noise=None,
        clipping=None,
        **kwargs,
    ):
        inner = make_inner(self.base, learning_rate, name, noise_bias_correction, variance_floor, **kwargs)
        super().__init__(inner, l2_norm_clip, noise_multiplier, seed, secure_mode, noise, clipping, name=name)
        self.noise_bias_correction, self.variance_floor = noise_bias_correction, float(variance_floor)
