"""A privacy budget enforced inside the compiled step.

Callbacks run only between executions; with ``steps_per_execution = k`` one execution
runs k DP steps, so a budget checked by a callback alone overshoots by up to k − 1 steps.
``StepLimit`` holds the largest total step count the budget allows and the σ it was
computed for; the train step releases a step only if

    steps < limit   and   σ_step = σ_limit,

so neither extra steps in an execution nor a σ lowered by a later callback can spend more
than the budget. A blocked step releases nothing (zero gradient, no noise, not counted).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

_NO_LIMIT = -1


class StepLimit(tf.Module):
    """The budget's step limit as TF variables (not saved with the model: a budget belongs
    to a ``fit`` call, and the ledger, which is saved, records what ran)."""

    def __init__(self):
        super().__init__(name="step_limit")
        once = tf.VariableAggregation.ONLY_FIRST_REPLICA
        self.limit = tf.Variable(_NO_LIMIT, dtype=tf.int64, trainable=False, name="limit", aggregation=once)
        self.sigma = tf.Variable(0.0, dtype=tf.float32, trainable=False, name="sigma", aggregation=once)

    def set(self, total_steps: int, noise_multiplier: float) -> None:
        """Allow steps while the ledger counts fewer than ``total_steps`` at σ = ``noise_multiplier``."""
        self.limit.assign(int(total_steps))
        self.sigma.assign(np.float32(noise_multiplier))

    def clear(self) -> None:
        self.limit.assign(_NO_LIMIT)

    def allows(self, steps_taken: tf.Tensor, noise_multiplier: tf.Tensor) -> tf.Tensor:
        """1.0 if this step fits the budget, else 0.0 (read inside the compiled step)."""
        limit = self.limit.read_value()
        within = tf.logical_and(steps_taken < limit,
                                tf.cast(noise_multiplier, tf.float32) == self.sigma.read_value())
        return tf.cast(tf.logical_or(limit == _NO_LIMIT, within), tf.float32)
