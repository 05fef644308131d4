"""Laplace noise for RaCO-DP's histogram, from the same Philox key as the Gaussian.

Gaussian draws fold streams ≥ 0 into (key, step); the Laplace draw of a step folds in the
stream ``tf_dp.streams.SUM_RELEASE`` (−1, allocated there), so the two never share a seed
(tf_dp.noise.gaussian.draw_seed).
"""

from __future__ import annotations

import tensorflow as tf

from tf_dp import streams
from tf_dp.noise.gaussian import draw_seed

LAPLACE_STREAM = streams.SUM_RELEASE.code  # RaCO-DP's histogram noise (allocated in tf_dp.streams)


def laplace_noise(shape, scale: tf.Tensor, seed: tf.Tensor, step: tf.Tensor, dtype=tf.float32,
                  stream: int = LAPLACE_STREAM) -> tf.Tensor:
    """Laplace(0, scale) draws: X = −scale · sign(U) · log(1 − 2|U|), U ~ Uniform(−½, ½).

    Args:
      shape: the shape of the draw.
      scale: the Laplace scale b (a scalar tensor).
      seed: the run's Philox key (``NoiseKey.read()``).
      step: the ledger's DP step; with the key and the Laplace stream it seeds the draw.
      dtype: the returned dtype (the draw is made in float64).
      stream: the Philox stream code (allocated in ``tf_dp.streams``).

    Returns:
      A tensor of ``shape`` of independent Laplace(0, scale) draws.
    """
    pair = draw_seed(seed, step, stream)
    uniform = tf.random.stateless_uniform(shape, seed=pair, dtype=tf.float64, alg="philox")
    centred = uniform - 0.5
    # log1p(−2|U|) is finite: U < 1 strictly, so 2|U − ½| < 1 except at U = 0 (prob. 2^-53).
    magnitude = -tf.math.log1p(-2.0 * tf.minimum(tf.abs(centred), 0.5 - 2.0**-54))
    return tf.cast(tf.cast(scale, tf.float64) * tf.sign(centred) * magnitude, dtype)
