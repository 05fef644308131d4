"""Adam's update with the noise-variance bias of the second moment removed (DP-AdamBC).

Adam's v_t = β₂ v_{t−1} + (1−β₂) ĝ_t² absorbs the DP noise variance σ_w² per coordinate
(Tang et al. 2024). The corrected step uses

    v̄_t = max(v̂_t − A·σ_w², variance_floor),   θ ← θ − η m̂_t / (√v̄_t + ε)

with A = 1 for DP-AdamBC; for the filtered gradient of FIBER and DiSK, A = A_t, the
fraction of white noise the filter (started at zero) passes by step t, which grows to the
stationary A(ω) (FIBER) or κ/(2−κ) (DiSK) — ``FilteredNoiseVariance``.
"""

from __future__ import annotations

import tensorflow as tf

from tf_dp import _checks

# What the filtered optimizers subtract from v̂ (study ablations): the exact A_t of
# the filter started at zero (default), its stationary A from the first step, or the full
# σ_w² of the unfiltered ĝ (DP-AdamBC's correction, ignoring the filter).
CORRECTIONS = ("transient", "stationary", "full")


def corrected_adam_direction(
    m: tf.Tensor,
    v: tf.Tensor,
    step: tf.Tensor,
    beta_1: float,
    beta_2: float,
    epsilon: float,
    noise_variance: tf.Tensor,
    variance_floor: float,
) -> tf.Tensor:
    """Returns m̂ / (√max(v̂ − noise_variance, variance_floor) + ε)."""
    dtype = m.dtype
    step = tf.cast(step, dtype)
    m_hat = m / (1 - tf.pow(tf.cast(beta_1, dtype), step))
    v_hat = v / (1 - tf.pow(tf.cast(beta_2, dtype), step))
    v_bar = tf.maximum(v_hat - tf.cast(noise_variance, dtype), tf.cast(variance_floor, dtype))
    return m_hat / (tf.sqrt(v_bar) + tf.cast(epsilon, dtype))


class FilteredNoiseVariance:
    """Mixin for the filtered DP optimizers (DiSK, FIBER): the noise variance left in g̃_t.

    The filter is linear, so the noise in its state evolves on its own. Started at zero and
    fed white noise of unit variance, its output holds after t steps the variance A_t, which
    grows to the stationary attenuation A (DiSK's κ/(2−κ), FIBER's A(ω)). The noise
    covariance of the filter state is advanced once per step, before the update, so that
    the update of step t reads

        noise_variance_on_average = A_t · σ_w²,   σ_w = σC/L,

    what the filter actually leaves of this step's noise (for the DP-AdamBC correction);
    ``correction="stationary"`` uses A instead of A_t, ``"full"`` σ_w² (ablations).
    Subclasses set ``_filter_noise_size`` and ``_advance_filter_noise(state)``; A_t = state[0].
    """

    _filter_noise_size = 1

    def _init_correction(self, correction: str):
        self.correction = _checks.one_of("correction", correction, CORRECTIONS)

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self._filter_noise = self.add_variable(
            shape=(self._filter_noise_size,), dtype="float32", aggregation="only_first_replica",
            name="filter_noise_covariance",
        )

    def _advance_filter_noise(self, state):
        raise NotImplementedError

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        """Once per step (also under tf.distribute): A_{t−1} → A_t, then the updates."""
        self._filter_noise.assign(self._advance_filter_noise(self._filter_noise.value))
        return super()._backend_update_step(grads, trainable_variables, learning_rate)

    def filter_attenuation(self) -> tf.Tensor:
        """A_t of the latest step (0 before the first)."""
        return self._filter_noise.value[0]

    def noise_variance_on_average(self, dtype) -> tf.Tensor:
        """A_t · σ_w²: the noise variance left in the filtered gradient g̃_t (``correction``
        "stationary": A·σ_w²; "full": σ_w²)."""
        full = super().noise_variance_on_average(dtype)
        if self.correction == "full":
            return full
        factor = self.filter_attenuation() if self.correction == "transient" else self.attenuation
        return tf.cast(factor, dtype) * full
