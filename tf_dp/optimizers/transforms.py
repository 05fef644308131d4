"""One DP step as a chain of small parts (docs/algorithms.md §1 steps 4–5, §3, §4).

    Σ_i ḡ_i ─privatize→ Σ_i ḡ_i + z_t ─average→ ĝ_t ─release gate→ ─filters→ g̃_t ─inner optimizer→ θ_{t+1}

``tf_dp.DPOptimizer.apply_private_gradients`` runs the chain. The stateless parts are
functions. A stateful part (a filter, the two-point observation) is optax-like: ``init``
declares its state as optimizer variables (saved with the model; they hold functions of
released values only, never a secret), ``update`` is a function of the values it is
PASSED — the gradient, the noise variance it carries, the state's current values — and
returns the new state, which the optimizer assigns. What the noise leaves in the gradient
travels down the chain as a value: σ_w² after the average, A_t·σ_w² after a filter that
passes the fraction A_t of white noise, and the inner optimizer receives it (the
noise-bias-corrected Adam of ``tf_dp.optimizers.BiasCorrectedAdamW`` subtracts it).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_dp import _checks
from tf_dp.clipping import CURRENT_WEIGHTS, EvaluationPoint
from tf_dp.filters import (
    attenuation_factor,
    ema_attenuation_factor,
    ema_filter,
    ema_noise_variance_step,
    innovation_filter,
    innovation_noise_covariance_step,
)
from tf_dp.filters.correlated import (
    attenuation_of_marginal,
    joint_covariance_step,
    joint_system,
    stationary_attenuation_of_marginal,
)

# What a filter hands on as the noise variance of its output (study ablations,
# docs/fiber_study.md): the exact A_t·σ_w² of the filter started at zero (default), its
# stationary A·σ_w² from the first step, or the full σ_w² of the unfiltered ĝ (DP-AdamBC's).
CORRECTIONS = ("transient", "stationary", "full")


# ------------------------------------------------------------------ stateless parts
def privatize(privatizer, clipped_sums: Sequence[tf.Tensor], stddev_on_sum: tf.Tensor, key: tf.Tensor,
              dp_step: tf.Tensor, replica=0, replicas: int = 1) -> list:
    """Σ_i ḡ_i + z_t, z_t drawn by the privatizer with std ``stddev_on_sum`` = σ·sensitivity(C).

    Under tf.distribute each of the R replicas adds an independent share of std
    stddev/√R; the inner optimizer (or the filters' all-reduce) sums the shares, so the
    global sum carries the noise exactly once (R = 1: the plain mechanism).
    """
    return privatizer.privatize(list(clipped_sums), stddev_on_sum / replicas**0.5, key, dp_step, replica, replicas)


def average(noisy_sums: Sequence[tf.Tensor], expected_batch_size) -> list:
    """ĝ_t = (Σ_i ḡ_i + z_t) / L, L the expected (Poisson) or declared batch size, never the
    realized one (docs/algorithms.md §1 step 5, §7)."""
    denominator = tf.cast(expected_batch_size, tf.float32)
    return [g / tf.cast(denominator, g.dtype) for g in noisy_sums]


def release_gate(gradients: Sequence[tf.Tensor], release: Optional[tf.Tensor]) -> list:
    """ĝ_t · release: release = 0 when a privacy budget forbids the step, so the update sees
    a zero gradient (a function of public state only)."""
    if release is None:
        return list(gradients)
    return [g * tf.cast(release, g.dtype) for g in gradients]


def add_public_gradients(gradients: Sequence[tf.Tensor], public: Optional[Sequence]) -> list:
    """ĝ_t + ∇R(θ_t): data-independent terms (weight regularizers) cost no privacy."""
    if public is None:
        return list(gradients)
    return [g if p is None else g + tf.cast(p, g.dtype) for g, p in zip(gradients, public)]


def all_reduce_sum(gradients: Sequence[tf.Tensor]) -> list:
    """The sum over tf.distribute replicas (the identity outside a replica context)."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return list(gradients)
    return list(context.all_reduce(tf.distribute.ReduceOp.SUM, list(gradients)))


# ------------------------------------------------------------------ filters
@dataclasses.dataclass(frozen=True)
class CorrelatedNoise:
    """What a filter needs to track correlated noise (docs/algorithms.md §10.6): the privatizer
    (its ``segment_restarted()``), M and u of the joint system, the filter's state size d and
    the stationary A'_∞ (NaN unless correction="stationary")."""

    privatizer: object
    transition: np.ndarray
    drive: np.ndarray
    filter_size: int
    stationary_attenuation: float


class GradientFilter:
    """A linear filter on ĝ_t: g̃_t = F(g̃_{t−1}, ĝ_t), post-processing (free in privacy).

    Subclasses define ``state_names`` (one variable per trainable variable each),
    ``noise_state_size`` (the noise covariance the filter tracks, A_t = its entry 0),
    ``filter(gradient, per-variable state)``, ``advance_noise(covariance)`` (white noise) and
    ``state_space()`` (F, b of x_t = F x_{t−1} + b ĝ_t). Fed correlated noise (BandMF, after
    ``follow_correlated_noise``) the filter tracks instead the joint covariance of its state
    and the noise recursion's (docs/algorithms.md §10.6) and A_t is the share of the MARGINAL
    variance of its input that it passes.

    Args:
      correction: the noise variance handed on: "transient" A_t·σ_w² (exact for the filter
        started at zero), "stationary" A·σ_w², "full" σ_w².
    """

    #: The filter must see ĝ summed over tf.distribute replicas, not one replica's share.
    needs_global_gradient = True
    state_names: tuple = ()
    noise_state_size = 1

    def __init__(self, correction: str = "transient"):
        self.correction = _checks.one_of("correction", correction, CORRECTIONS)
        self._correlated: Optional[CorrelatedNoise] = None  # set by follow_correlated_noise

    @property
    def stationary_attenuation(self) -> float:
        """A: the fraction of its input's noise variance the stationary filter passes."""
        if self._correlated is not None:
            return self._correlated.stationary_attenuation
        return self._white_stationary_attenuation

    @property
    def _white_stationary_attenuation(self) -> float:
        raise NotImplementedError

    def follow_correlated_noise(self, privatizer) -> None:
        """Track the noise of ``privatizer`` (BandMF, b > 1) jointly with the filter's state:
        A_t becomes P_t[0, 0]/F_n of docs/algorithms.md §10.6. Call before ``init``.

        Args:
          privatizer: exposes ``noise_recursion()`` (c_0, …, c_{b−1}) and ``segment_restarted()``.
        """
        filter_transition, filter_input = self.state_space()
        transition, drive = joint_system(filter_transition, filter_input, privatizer.noise_recursion())
        size = len(filter_input)
        stationary = stationary_attenuation_of_marginal(transition, drive, size) \
            if self.correction == "stationary" else float("nan")
        self._correlated = CorrelatedNoise(privatizer, transition, drive, size, stationary)
        self.noise_state_size = transition.shape[0] ** 2

    def state_space(self) -> tuple:
        """(F [d, d], b [d]) of the filter's linear recursion x_t = F x_{t−1} + b ĝ_t."""
        raise NotImplementedError

    def init(self, optimizer, variables) -> dict:
        """Declares the state: per-variable lists (zeros) and the noise covariance (zeros)."""
        state = {name: optimizer.add_state_variables(variables, name) for name in self.state_names}
        state["noise_covariance"] = optimizer.add_state_variable((self.noise_state_size,), "filter_noise_covariance")
        return state

    def update(self, gradients: Sequence[tf.Tensor], noise_variance: tf.Tensor, state: dict):
        """Returns (g̃_t per variable, the noise variance left in g̃_t, the new state).

        Args:
          gradients: ĝ_t, summed over replicas.
          noise_variance: σ_w², the per-coordinate noise variance of ĝ_t.
          state: current values of the state declared by ``init``.
        """
        new_state = {name: [] for name in self.state_names}
        filtered = []
        for index, gradient in enumerate(gradients):
            values = [state[name][index] for name in self.state_names]
            outputs = self.filter(tf.cast(gradient, values[0].dtype), *values)
            for name, value in zip(self.state_names, outputs):
                new_state[name].append(value)
            filtered.append(outputs[0])
        covariance = self._advanced_noise_covariance(state["noise_covariance"])
        new_state["noise_covariance"] = covariance
        return filtered, self.handed_on_variance(self.attenuation(covariance), noise_variance), new_state

    def _advanced_noise_covariance(self, covariance):
        if self._correlated is None:
            return self.advance_noise(covariance)
        noise = self._correlated
        return joint_covariance_step(covariance, noise.transition, noise.drive, noise.filter_size,
                                     noise.privatizer.segment_restarted())

    def attenuation(self, covariance) -> tf.Tensor:
        """A_t from the tracked covariance: its entry 0 (white noise), or P_t[0, 0]/F_n (§10.6)."""
        if self._correlated is None:
            return covariance[0]
        return attenuation_of_marginal(covariance, self._correlated.filter_size)

    def handed_on_variance(self, attenuation: tf.Tensor, noise_variance: tf.Tensor) -> tf.Tensor:
        """A_t·σ_w² ("transient"), A·σ_w² ("stationary") or σ_w² ("full")."""
        if self.correction == "full":
            return noise_variance
        factor = attenuation if self.correction == "transient" else self.stationary_attenuation
        return tf.cast(factor, noise_variance.dtype) * noise_variance

    def filter(self, gradient, *state):
        raise NotImplementedError

    def advance_noise(self, covariance):
        raise NotImplementedError


class EMAFilter(GradientFilter):
    """DiSK's filter (docs/algorithms.md §3): g̃_t = (1 − κ) g̃_{t−1} + κ ĝ_t,
    A_t = (1 − κ)² A_{t−1} + κ² → κ/(2 − κ).

    Args:
      gain: κ ∈ (0, 1] (FIBER's EMA ablation: ω).
      correction: see ``GradientFilter``.
    """

    state_names = ("filtered_gradient",)

    def __init__(self, gain: float, correction: str = "transient"):
        super().__init__(correction)
        self._stationary = ema_attenuation_factor(gain)  # checks 0 < κ ≤ 1
        self.gain = float(gain)

    @property
    def _white_stationary_attenuation(self) -> float:
        return self._stationary

    def state_space(self) -> tuple:
        return [[1.0 - self.gain]], [self.gain]

    def filter(self, gradient, filtered):
        return (ema_filter(filtered, gradient, self.gain),)

    def advance_noise(self, covariance):
        return tf.reshape(ema_noise_variance_step(covariance[0], self.gain), [1])


class InnovationFilter(GradientFilter):
    """FIBER's filter (docs/algorithms.md §4): ν_t = ĝ_t − g̃_{t−1}, r_t = (1 − ω) r_{t−1} +
    ω ν_t, g̃_t = g̃_{t−1} + r_t; the noise covariance of (g̃, r) advances by
    ``innovation_noise_covariance_step`` (A_t → A(ω) = (2 − ω)/(4 − 3ω)).

    Args:
      gain: ω ∈ (0, 1].
      correction: see ``GradientFilter``.
    """

    state_names = ("filtered_gradient", "smoothed_residual")
    noise_state_size = 3

    def __init__(self, gain: float, correction: str = "transient"):
        super().__init__(correction)
        self._stationary = attenuation_factor(gain)  # checks 0 < ω ≤ 1
        self.gain = float(gain)

    @property
    def _white_stationary_attenuation(self) -> float:
        return self._stationary

    def state_space(self) -> tuple:
        """x = (g̃, r): g̃_t = (1 − ω)(g̃ + r) + ω ĝ_t, r_t = −ω g̃ + (1 − ω) r + ω ĝ_t."""
        keep = 1.0 - self.gain
        return [[keep, keep], [-self.gain, keep]], [self.gain, self.gain]

    def filter(self, gradient, filtered, residual):
        return innovation_filter(filtered, residual, gradient, self.gain)

    def advance_noise(self, covariance):
        return innovation_noise_covariance_step(covariance, self.gain)


# ------------------------------------------------------------------ the observation
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
    """Where DiSK and FIBER evaluate per-example gradients (docs/algorithms.md §3):

        u_i = c ∇ℓ(θ_t + γ d_t; x_i) + (1 − c) ∇ℓ(θ_t; x_i),  d_t = θ_t − θ_{t−1},  c = (1 − κ)/(κγ),

    combined per example BEFORE clipping, so one clip bounds the sensitivity by C. The
    state θ_{t−1} is recorded before the inner update (so before its decoupled weight
    decay): d_t is the full move of the previous step.

    Args:
      kappa: κ ∈ (0, 1]; κ = 1 is the one-point observation at θ_t.
      gamma: γ ≥ 0, the look-ahead.
    """

    def __init__(self, kappa: float, gamma: float):
        kappa = _checks.real("kappa", kappa)
        if not 0 < kappa <= 1:
            raise ValueError(f"`kappa` must lie in (0, 1], got {kappa}.")
        self.gamma = _checks.non_negative("gamma", gamma, "It scales the look-ahead θ_t + γ·d_t.")
        self.kappa = kappa
        self.coefficient = observation_coefficient(kappa, self.gamma)

    def init(self, optimizer, variables) -> dict:
        """θ_{t−1}, started at the weights the optimizer is built on (d_0 = 0)."""
        return {"previous_weights": optimizer.add_state_variables(variables, "previous_weights", copy_values=True)}

    def evaluation_points(self, variables, state: dict) -> tuple:
        """((c, θ_t + γd_t), (1 − c, θ_t)); one point when c ∈ {0, 1}."""
        if self.coefficient == 0:
            return CURRENT_WEIGHTS
        look_ahead = [v.value + self.gamma * (v.value - p) for v, p in zip(variables, state["previous_weights"])]
        if self.coefficient == 1:
            return (EvaluationPoint(1.0, look_ahead),)
        return (EvaluationPoint(self.coefficient, look_ahead), EvaluationPoint(1 - self.coefficient))

    @staticmethod
    def record(variables) -> dict:
        """The new state before the update: θ_{t−1} ← θ_t."""
        return {"previous_weights": [tf.identity(v.value) for v in variables]}
