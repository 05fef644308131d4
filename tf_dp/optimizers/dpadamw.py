"""DP-AdamW: decoupled weight decay on top of DP-Adam (with optional DP-AdamBC correction)."""

from __future__ import annotations

from typing import Optional

import keras

from tf_dp.optimizers.dp_optimizer import DPOptimizer
from tf_dp.optimizers.dpadam import DEFAULT_VARIANCE_FLOOR, NoiseBiasCorrectedAdamMixin


@keras.saving.register_keras_serializable(package="tf_dp")
class DPAdamW(NoiseBiasCorrectedAdamMixin, DPOptimizer, keras.optimizers.AdamW):
    """AdamW on the privatized gradient ĝ:

        θ ← θ − η (m̂ / (√v̄ + ε) + λ_wd θ),  v̄ = v̂  or  max(v̂ − σ_w², variance_floor).

    Weight decay uses only θ (public), so it costs no privacy. Accepts every argument of
    ``keras.optimizers.AdamW``.
    """

    def __init__(
        self,
        learning_rate=0.001,
        l2_norm_clip: float = 1.0,
        noise_multiplier: Optional[float] = None,
        seed: Optional[int] = None,
        secure_mode: bool = False,
        weight_decay: float = 0.004,
        noise_bias_correction: bool = False,
        variance_floor: float = DEFAULT_VARIANCE_FLOOR,
        name: str = "DPAdamW",
        **kwargs,
    ):
        super().__init__(learning_rate=learning_rate, weight_decay=weight_decay, name=name, **kwargs)
        self._init_dp(l2_norm_clip, noise_multiplier, seed, secure_mode)
        self._init_bias_correction(noise_bias_correction, variance_floor)

    def get_config(self):
        return {**super().get_config(), **self._dp_config(), **self._bias_correction_config()}
