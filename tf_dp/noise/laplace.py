"""Laplace noise for RaCO-DP's histogram, from the same Philox key as the Gaussian.

Gaussian draws use counters (0, block) with small low words; Laplace draws start the low
word at 2^63, so the two never share a counter value within a run.
"""

from __future__ import annotations

import tensorflow as tf

_PHILOX = 1
_LAPLACE_COUNTER_OFFSET = 2**63


def laplace_noise(shape, scale: tf.Tensor, seed: tf.Tensor, step: tf.Tensor, dtype=tf.float32) -> tf.Tensor:
    """Laplace(0, scale) draws: X = −scale · sign(U) · log(1 − 2|U|), U ~ Uniform(−½, ½)."""
    counter = tf.stack([tf.constant(_LAPLACE_COUNTER_OFFSET, tf.uint64), tf.bitcast(tf.cast(step, tf.int64), tf.uint64)])
    key = tf.reshape(tf.bitcast(tf.cast(seed, tf.int64), tf.uint64), [1])
    uniform = tf.raw_ops.StatelessRandomUniformV2(shape=shape, key=key, counter=counter, alg=_PHILOX, dtype=tf.float64)
    centred = uniform - 0.5
    # log1p(−2|U|) is finite: U < 1 strictly, so 2|U − ½| < 1 except at U = 0 (prob. 2^-53).
    magnitude = -tf.math.log1p(-2.0 * tf.minimum(tf.abs(centred), 0.5 - 2.0**-54))
    return tf.cast(tf.cast(scale, tf.float64) * tf.sign(centred) * magnitude, dtype)
