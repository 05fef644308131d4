"""How far above the exact per-example gradient norm the conv rules' certified norms sit.

Every norm tf_dp clips by is an upper bound under floating-point rounding (docs/algorithms.md
§6.4): a bound above the truth over-clips a little (safe), never under-clips. This prints the
relative excess (tf_dp norm − per-example loop norm) / loop norm for a few Conv2D shapes.

    python benchmarks/conv_norm_excess.py
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dp  # noqa: E402
from tests.harness import flat_norms, loop_per_example_gradients, sparse_ce  # noqa: E402

SHAPES = [(1, 8, 2, 28), (16, 4, 2, 13), (3, 3, 1, 16), (8, 5, 1, 32)]  # C_in, kernel, stride, H = W


def excess(channels: int, kernel: int, stride: int, size: int, batch: int = 16):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((size, size, channels))
    hidden = keras.layers.Conv2D(16, kernel, strides=stride, activation="tanh")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(10)(keras.layers.Flatten()(hidden)))
    x = np.random.default_rng(1).normal(size=(batch, size, size, channels)).astype("float32")
    y = np.arange(batch) % 10
    total, _ = tf_dp.clipping.per_example_gradient_norms(model, sparse_ce, x, y)
    exact = flat_norms(loop_per_example_gradients(model, x, y))
    return (np.asarray(total, np.float64) - exact) / exact


def main():
    for shape in SHAPES:
        rel = excess(*shape)
        print(f"conv {shape[1]}x{shape[1]}/{shape[2]}, C_in = {shape[0]}, {shape[3]}x{shape[3]}: "
              f"relative excess min {rel.min():.1e}, max {rel.max():.1e}")


if __name__ == "__main__":
    main()
