"""DP-SGD (Abadi et al. 2016): SGD with momentum/Nesterov on the privatized gradient ĝ."""

from __future__ import annotations

from typing import Optional

import keras

from tf_dp.optimizers.dp_optimizer import DPOptimizer


@keras.saving.register_keras_serializable(package="tf_dp")
class DPSGD(DPOptimizer, keras.optimizers.SGD):
    """θ ← θ − η·ĝ (or Keras' momentum/Nesterov form), ĝ = (Σ_i clip_C(g_i) + N(0, σ²C²I)) / L.

    Accepts every argument of ``keras.optimizers.SGD`` plus ``l2_norm_clip``,
    ``noise_multiplier`` and ``seed`` (see ``tf_dp.optimizers.DPOptimizer``).
    """

    def __init__(
        self,
        learning_rate=0.01,
        l2_norm_clip: float = 1.0,
        noise_multiplier: Optional[float] = None,
        seed: Optional[int] = None,
        secure_mode: bool = False,
        momentum: float = 0.0,
        nesterov: bool = False,
        name: str = "DPSGD",
        **kwargs,
    ):
        super().__init__(learning_rate=learning_rate, momentum=momentum, nesterov=nesterov, name=name, **kwargs)
        self._init_dp(l2_norm_clip, noise_multiplier, seed, secure_mode)

    def get_config(self):
        return {**super().get_config(), **self._dp_config()}
