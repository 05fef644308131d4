"""Gaussian noise from a counter-based generator.

Each step draws N(0, stddev² I) for every coordinate of the model from Philox seeded by
the pair (run's 64-bit key, an index unique to (step, variable, replica)). Keyed draws make a run
reproducible from its seed, keep two steps' noise independent (never a reused counter),
and survive checkpoint/resume: the counter is the model's DP step count (its privacy
ledger, saved with the model), so it never repeats over the model's life — not across
``fit`` calls, recompiles with a new optimizer and the same seed, gradient-accumulation
micro-steps, or a resume; the key itself is never saved (``tf_dp.noise.key``). Philox under XLA on CPU was measured 30x faster than
``keras.random.normal``. XLA's Philox kernel lays out counters differently from TF's, so
a run with ``jit_compile=True`` draws a different (equally distributed) stream than one
without; each is reproducible from its seed.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf


def _philox_normal(shape, key: tf.Tensor, block: tf.Tensor, dtype) -> tf.Tensor:
    """N(0, 1) draws from Philox keyed by the seed pair (key, block).

    TF derives the Philox key and counter from the pair by hashing it, so distinct
    (key, block) pairs give independent streams; ``block`` is unique per (step, variable,
    replica), so no two draws of a run share one. (Measured here for 670k draws: 8.6 ms
    in graph mode, 19.8 ms under XLA; the raw key/counter op took 12 ms and 97 ms.)
    """
    seed = tf.stack([tf.cast(key, tf.int64), tf.cast(block, tf.int64)])
    return tf.random.stateless_normal(shape, seed=seed, dtype=dtype, alg="philox")


def add_gaussian_noise(
    tensors: Sequence[tf.Tensor], stddev: tf.Tensor, seed: tf.Tensor, step: tf.Tensor,
    replica: tf.Tensor | int = 0, replicas: int = 1,
) -> list[tf.Tensor]:
    """Returns ``[t + N(0, stddev² I) for t in tensors]``, one independent draw per coordinate.

    Args:
      tensors: the clipped gradient sums, one per trainable variable.
      stddev: σ·C, the noise standard deviation on the SUM.
      seed: int64 scalar, the run's Philox key.
      step: the model's DP step count before this step (the ledger's), unique over the
        model's life; distinct steps give independent noise.
      replica, replicas: under tf.distribute each of R replicas draws its own share (the
        caller scales the std by 1/√R so the all-reduced sum has std ``stddev``·√R/√R).
    """
    key = tf.cast(seed, tf.int64)
    replica = tf.cast(replica, tf.int64)
    first_block = tf.cast(step, tf.int64) * len(tensors) * replicas
    return [
        tensor + tf.cast(stddev, tensor.dtype)
        * _philox_normal(tf.shape(tensor), key, first_block + index * replicas + replica, tensor.dtype)
        for index, tensor in enumerate(tensors)
    ]
