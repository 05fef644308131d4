"""The two-point observation of DiSK and FIBER (docs/algorithms.md §3):

    u_i = c · ∇ℓ(θ_t + γ d_t; x_i) + (1 − c) · ∇ℓ(θ_t; x_i),   d_t = θ_t − θ_{t−1},
    c = (1 − κ) / (κ γ),

combined per example BEFORE clipping, so one clip bounds the sensitivity by C and the
step is one Gaussian mechanism at the user's σ. c = 1 needs one gradient evaluation (at
θ_t + γd_t), κ = 1 (c = 0) one at θ_t. θ_{t−1} is kept in optimizer variables, recorded
before Keras' decoupled weight decay, so d_t is the full move of the previous step.
"""

from __future__ import annotations

import tensorflow as tf

from tf_dp import _checks
from tf_dp.clipping import CURRENT_WEIGHTS, EvaluationPoint


def observation_coefficient(kappa: float, gamma: float) -> float:
    """c = (1 − κ)/(κγ); 0 when κ = 1 (then γ is irrelevant)."""
    if kappa == 1:
        return 0.0
    if gamma == 0:
        raise ValueError(
            f"c = (1 - kappa) / (kappa * gamma) is undefined for gamma = 0 with kappa = {kappa} < 1: "
            "set gamma > 0, or kappa = 1 for a one-point observation."
        )
    return (1 - kappa) / (kappa * gamma)


class TwoPointObservation:
    """Mixin for DP optimizers observing the two-point combination."""

    def _init_two_point(self, kappa: float, gamma: float):
        kappa = _checks.real("kappa", kappa)
        if not 0 < kappa <= 1:
            raise ValueError(f"`kappa` must lie in (0, 1], got {kappa}.")
        gamma = _checks.non_negative("gamma", gamma, "It scales the look-ahead θ_t + γ·d_t.")
        self.kappa, self.gamma = kappa, gamma
        self.observation_coefficient = observation_coefficient(kappa, gamma)

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self._previous_weights = [
            self.add_variable_from_reference(v, name="previous_weights", initializer=_current_value(v))
            for v in variables
        ]

    def evaluation_points(self, trainable_variables) -> tuple:
        c = self.observation_coefficient
        if c == 0:
            return CURRENT_WEIGHTS
        look_ahead = [
            v.value + self.gamma * (v.value - self._previous_weights[self._get_variable_index(v)].value)
            for v in trainable_variables
        ]
        if c == 1:
            return (EvaluationPoint(1.0, look_ahead),)
        return (EvaluationPoint(c, look_ahead), EvaluationPoint(1 - c))

    def _apply_weight_decay(self, variables):
        """Keras calls this once per step, before any update (also when weight decay is
        off): remember θ_t here, BEFORE the decay θ_t ← (1 − ηλ)θ_t, so that the next step's
        direction is d_{t+1} = θ_{t+1} − θ_t exactly (not θ_{t+1} − (1 − ηλ)θ_t)."""
        self._remember_weights(variables)
        super()._apply_weight_decay(variables)

    def _remember_weights(self, variables):
        """θ_{t−1} ← θ_t for every variable this step updates, on every device: in a
        cross-replica merge call, as Keras applies weight decay under tf.distribute."""
        previous = [self._previous_weights[self._get_variable_index(v)] for v in variables]

        def copy(distribution, targets, sources):
            for target, source in zip(targets, sources):
                distribution.extended.update(target.value, lambda t, s: t.assign(s), args=(source.value,),
                                             group=False)

        tf.__internal__.distribute.interim.maybe_merge_call(copy, self._distribution_strategy, previous,
                                                            list(variables))

    def _two_point_config(self) -> dict:
        return {"kappa": self.kappa, "gamma": self.gamma}


def _current_value(variable):
    def initializer(shape, dtype=None):
        return tf.cast(tf.identity(variable.value), dtype or variable.dtype)

    return initializer
