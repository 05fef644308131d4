"""Writes tests/data/scattering_reference.npz: Kymatio's order-2 scattering of two real MNIST
digits and one random RGB image, the independent reference of tests/features/test_scattering.py.

Needs kymatio (0.3.0; only its 2D NumPy frontend, since ``kymatio.numpy`` itself fails to import
with SciPy ≥ 1.15):  pip install --no-deps kymatio appdirs configparser && python tools/scattering_reference.py
"""

import pathlib

import numpy as np
from kymatio.scattering2d.frontend.numpy_frontend import ScatteringNumPy2D

from tf_dp.data import load_mnist

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "data" / "scattering_reference.npz"


def main():
    digits = load_mnist().x_test[:2, :, :, 0].astype(np.float64)  # [2, 28, 28] in [0, 1]
    colour = np.random.default_rng(0).random((1, 3, 16, 24))  # [1, C, H, W], J = 3
    np.savez_compressed(
        OUT,
        digits=digits.astype(np.float32),
        digits_scattering=ScatteringNumPy2D(J=2, shape=(28, 28), L=8)(digits).astype(np.float32),  # [2, 81, 7, 7]
        colour=colour.astype(np.float32),
        colour_scattering=ScatteringNumPy2D(J=3, shape=(16, 24), L=4)(colour).astype(np.float32),  # [1, 3, K, 2, 3]
    )
    print(OUT, OUT.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
