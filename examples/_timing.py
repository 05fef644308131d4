"""Helpers shared by the example scripts: step timing inside fit, and random subsets."""

from __future__ import annotations

import statistics
import time

import keras
import numpy as np


class BatchClock(keras.callbacks.Callback):
    """Wall-clock time at the end of every training batch (ms/step = median gap)."""

    def on_train_begin(self, logs=None):
        self.times: list[float] = []

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter())

    def ms_per_step(self) -> float:
        gaps = np.diff(self.times)  # the first step (tracing) has no predecessor: excluded
        return 1000 * statistics.median(gaps) if len(gaps) else float("nan")


def random_subset(x: np.ndarray, y: np.ndarray, size, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``size`` rows drawn without replacement (all rows if None); splits ordered by class
    (e.g. tweets) would give a single class from a prefix."""
    if size is None or size >= len(y):
        return x, y
    rows = np.sort(np.random.default_rng(seed).choice(len(y), size, replace=False))
    return x[rows], y[rows]


def time_steps(models: dict, train, batch_size: int, rounds: int, steps: int) -> dict[str, float]:
    """Median ms/step of each model over ``rounds`` rounds of ``steps`` fit steps; the models
    take turns, in a rotated order each round, so that load from other jobs hits all alike.
    Round r samples with the fixed ``sampling_seed`` r + 1, so that every model is timed on
    the same batch sizes: the models must be throwaway copies whose weights are never
    released (they are only timed)."""
    names = list(models)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            clock = BatchClock()
            models[name].fit(*train, batch_size=batch_size, epochs=1, steps_per_epoch=steps + 1,
                             sampling_seed=round_index + 1, callbacks=[clock], verbose=0)
            times[name].append(clock.ms_per_step())
    return {name: statistics.median(values) for name, values in times.items()}
