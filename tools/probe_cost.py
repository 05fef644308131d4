"""Wall time of one row-independence probe (tf_dp.models.row_independence), uncached.

Usage: python tools/probe_cost.py

Prints, for a 784-512-512-10 MLP and the MNIST CNN of the DP-SGD examples, the median of
five probes after a warm-up, on the rows the probe reads in ``fit`` (16 probed + 51 donors).
A ``fit`` pays one probe, plus one more if it traces its step; a ``train_on_batch`` loop pays
one per re-trace or new phase (docs/algorithms.md §1.2).
"""

import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout's tf_dp

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dp  # noqa: E402
from tf_dp.models import row_independence  # noqa: E402

REPEATS = 5


def mlp():
    return tf_dp.DPSequential([keras.Input((784,)), keras.layers.Dense(512, activation="relu"),
                               keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])


def cnn():
    return tf_dp.DPSequential([
        keras.Input((28, 28, 1)), keras.layers.Conv2D(16, 8, strides=2, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2, 1), keras.layers.Conv2D(32, 4, strides=2, activation="relu"),
        keras.layers.MaxPooling2D(2, 1), keras.layers.Flatten(), keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(10)])


def probe_seconds(make) -> tuple[float, float]:
    """(first probe, median of the next REPEATS) in seconds."""
    keras.utils.set_random_seed(0)
    model = make()
    model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rows = row_independence.GUARD_ROWS + row_independence.DONOR_SEARCH
    x = np.random.default_rng(0).normal(size=(rows, *model.input_shape[1:])).astype("float32")
    y = (np.arange(rows) % 10).astype("int32")
    times = []
    for _ in range(REPEATS + 1):
        start = time.perf_counter()
        row_independence.check_rows_independent(model, model._dp_loss, x, y)  # fit's call: probes every time
        times.append(time.perf_counter() - start)
    return times[0], float(np.median(times[1:]))


def main():
    for name, make in (("MLP 784-512-512-10", mlp), ("MNIST CNN", cnn)):
        first, median = probe_seconds(make)
        print(f"{name}: one probe {median:.3f} s (median of {REPEATS}; the first, with tracing, {first:.3f} s)")


if __name__ == "__main__":
    main()
