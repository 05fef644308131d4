"""What DiSK and FIBER share: a two-point observation and one filter on ĝ (docs/algorithms.md §3, §4)."""

from __future__ import annotations

import tensorflow as tf

from tf_dp.optimizers.bases import FlatConfigDPOptimizer
from tf_dp.optimizers.transforms import GradientFilter, TwoPointObservation


class FilteredDPOptimizer(FlatConfigDPOptimizer):
    """A flat-config DP optimizer whose chain holds ``observation`` and one ``gradient_filter``."""

    def _set_parts(self, observation: TwoPointObservation, gradient_filter: GradientFilter) -> None:
        if self.gradient_accumulation_steps:
            raise ValueError(f"{type(self).__name__} filters every DP step's privatized gradient and observes at "
                             "θ_t + γ(θ_t − θ_{t−1}); `gradient_accumulation_steps` would average filtered steps "
                             "the noise-bias correction does not model. Use a larger `batch_size` (with "
                             "`physical_batch_size` to bound memory) instead.")
        _follow_correlated_noise_if_corrected(self, gradient_filter)
        self.observation, self.filters = observation, [gradient_filter]
        self.kappa, self.gamma = observation.kappa, observation.gamma
        self.observation_coefficient = observation.coefficient
        self.attenuation = gradient_filter.stationary_attenuation  # the stationary A
        self.correction = gradient_filter.correction

    @property
    def gradient_filter(self) -> GradientFilter:
        return self.filters[0]

    def filter_attenuation(self) -> tf.Tensor:
        """A_t of the latest step (0 before the first)."""
        return self.gradient_filter.attenuation(self.part_state(self.gradient_filter)["noise_covariance"].value)

    @property
    def _filtered_gradients(self) -> list:
        """g̃_t per trainable variable (the filter's state)."""
        return self.part_state(self.gradient_filter)["filtered_gradient"]

    @property
    def _previous_weights(self) -> list:
        """θ_{t−1} per trainable variable (the observation's state)."""
        return self.part_state(self.observation)["previous_weights"]

    def _two_point_config(self) -> dict:
        return {"kappa": self.kappa, "gamma": self.gamma, "correction": self.correction}


def _follow_correlated_noise_if_corrected(optimizer, gradient_filter: GradientFilter) -> None:
    """The filter's noise factor A_t (docs/algorithms.md §3.2, §4.2) is derived for noise
    independent across steps. With correlated noise (BandMF, b > 1) and a noise-bias correction
    that uses it, the filter tracks the joint covariance of its state and the noise recursion
    instead (§10.6); a correlated privatizer that does not state its recursion is refused."""
    if optimizer.privatizer.white_noise or not getattr(optimizer.inner_optimizer, "uses_noise_variance", False):
        return
    if getattr(optimizer.privatizer, "noise_recursion", lambda: None)() is None:
        raise ValueError(
            f"{type(optimizer).__name__}: noise={optimizer.privatizer!r} releases noise correlated across steps "
            "without stating its recursion (`noise_recursion()`), so the variance a "
            f"{type(gradient_filter).__name__} leaves of it is unknown and the noise-bias correction cannot be "
            "computed (docs/algorithms.md §10.6). Pass noise_bias_correction=False, or noise=None.")
    gradient_filter.follow_correlated_noise(optimizer.privatizer)
