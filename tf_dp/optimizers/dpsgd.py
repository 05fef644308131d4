"""DP-SGD (Abadi et al. 2016): SGD with momentum/Nesterov on the privatized gradient ĝ."""

from __future__ import annotations

from typing import Optional

import keras

from tf_dp.optimizers.bases import FlatConfigDPOptimizer, make_inner


@keras.saving.register_keras_serializable(package="tf_dp")
class DPSGD(FlatConfigDPOptimizer):
    """θ ← θ − η·ĝ (or Keras' momentum/Nesterov form), ĝ = (Σ_i clip_C(g_i) + N(0, σ²C²I)) / L.

    ``tf_dp.DPOptimizer(keras.optimizers.SGD(...))`` with a flat config. Accepts every
    argument of ``keras.optimizers.SGD`` plus the DP ones (see ``tf_dp.DPOptimizer``).

    Args:
      learning_rate: η, a float or a Keras schedule.
      l2_norm_clip: C, the per-example clipping bound (or an adaptive bound), as in ``tf_dp.DPOptimizer``.
      noise_multiplier: σ; None only when a ``target_epsilon`` given to ``DPModel.compile`` calibrates it.
      seed: the noise stream's key, or None for a fresh one from the OS.
      secure_mode: a fresh key from the OS CSPRNG at every step (``tf_dp.DPOptimizer``).
      momentum: Keras SGD's momentum.
      nesterov: whether to use Nesterov momentum.
      name: the optimizer's name.
      noise: the privatizer (a ``tf_dp.noise.Privatizer``, a registered name, or None for Gaussian).
      clipping: the clipping policy (a ``tf_dp.clipping.ClippingPolicy``, a registered name, or None for flat).
      **kwargs: any other argument of ``keras.optimizers.SGD``.
    """

    base = "sgd"

    def __init__(
        self,
        learning_rate=0.01,
        l2_norm_clip=1.0,
        noise_multiplier: Optional[float] = None,
        seed: Optional[int] = None,
        secure_mode: bool = False,
        momentum: float = 0.0,
        nesterov: bool = False,
        name: str = "DPSGD",
        noise=None,
        clipping=None,
        **kwargs,
    ):
        inner = make_inner("sgd", learning_rate, name, momentum=momentum, nesterov=nesterov, **kwargs)
        super().__init__(inner, l2_norm_clip, noise_multiplier, seed, secure_mode, noise, clipping, name=name)
