"""Canaries for the one-run audit: examples whose membership is the audited secret.

A canary should be easy to recognise once trained on and uninformative otherwise, so its
score separates members from non-members: a real example with a wrong label
(``mislabeled_canaries``), or a random-pixel input with a random label
(``random_pixel_canaries``), which no other example teaches the model.
"""

from __future__ import annotations

import numpy as np

from tf_dp import _checks

__all__ = ["mislabeled_canaries", "random_pixel_canaries"]


def mislabeled_canaries(
    x: np.ndarray, y: np.ndarray, count: int, num_classes: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Takes ``count`` random rows of (x, y) out as canaries and relabels each one with a
    class drawn uniformly from the other ``num_classes − 1``.

    Args:
      x: the dataset's inputs, one row per example.
      y: the integer class labels of ``x``.
      count: the number of canaries to take out (at most ``len(x)``).
      num_classes: K, the number of classes.
      seed: seeds the choice of rows and of the wrong labels.

    Returns:
      ``(x_rest, y_rest, canary_x, canary_y)``: the remaining rows (train on them always)
      and the canaries (each included with probability 1/2 by ``OneRunAudit``).
    """
    count = _checks.positive_int("count", count)
    if count > len(x):
        raise ValueError(f"`count` ({count}) exceeds the number of rows ({len(x)}).")
    rng = np.random.default_rng(seed)
    chosen = rng.permutation(len(x))[:count]
    rest = np.setdiff1d(np.arange(len(x)), chosen)
    shift = rng.integers(1, num_classes, size=count)  # 1..K−1: never the true class
    canary_y = ((y[chosen].astype(np.int64) + shift) % num_classes).astype(y.dtype)
    return x[rest], y[rest], x[chosen], canary_y


def random_pixel_canaries(
    count: int, shape: tuple[int, ...], num_classes: int, seed: int = 0, density: float | None = 0.1,
    dtype=np.float32,
) -> tuple[np.ndarray, np.ndarray]:
    """``count`` random inputs of ``shape`` with uniform random labels.

    Features are 1 with probability ``density`` and 0 otherwise (binary, like a sparse
    MNIST stroke image), or i.i.d. U[0, 1] when ``density`` is None. Sparse canaries share
    little with each other: ⟨x_i, x_j⟩ ≈ d·p² against ‖x_i‖² ≈ d·p (10 : 1 at p = 0.1, but
    only 4 : 3 for U[0, 1]), so training on one does not teach the model a label for
    "noise" in general, which would make non-members with that label look like members.

    Args:
      count: the number of canaries.
      shape: the shape of one input.
      num_classes: labels are drawn uniformly from 0..num_classes − 1.
      seed: seeds the inputs and labels.
      density: p in (0, 1), the probability a feature is 1; None for U[0, 1] features.
      dtype: the inputs' dtype.

    Returns:
      ``(canary_x, canary_y)``: the inputs and their int32 labels.

    Raises:
      ValueError: ``count`` is not a positive int or ``density`` is not in (0, 1).
    """
    count = _checks.positive_int("count", count)
    rng = np.random.default_rng(seed)
    if density is None:
        canary_x = rng.random((count, *shape))
    else:
        canary_x = rng.random((count, *shape)) < _checks.in_open_unit_interval("density", density)
    canary_y = rng.integers(0, num_classes, size=count).astype(np.int32)
    return canary_x.astype(dtype), canary_y
