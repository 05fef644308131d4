"""Fashion-MNIST, read from the IDX files of the Debian package ``dataset-fashion-mnist``."""

from __future__ import annotations

import gzip
import math
import struct
from pathlib import Path

import numpy as np

from ._package_files import DataFileNotFoundError
from ._split import Split
from ._tabular import check_row_count

DEBIAN_PACKAGE = "dataset-fashion-mnist"
INSTALL_LINE = f"apt-get install {DEBIAN_PACKAGE}"
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
ROWS = {"train": 60_000, "test": 10_000}
IMAGE_SIZE = 28
CLASS_NAMES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip
_IDX_UNSIGNED_BYTE = 0x08


class DebianDataFileNotFoundError(DataFileNotFoundError):
    """A data file that a Debian package installs is missing (a :class:`DataFileNotFoundError`)."""

    def __init__(self, debian_package: str, path: Path) -> None:
        self.install_line = f"apt-get install {debian_package}"
        FileNotFoundError.__init__(
            self,
            f"Expected data file {path} is missing: the Debian package '{debian_package}' "
            f"is not installed. Install it (as root; run 'apt-get update' first if apt "
            f"does not know the package) with:\n    {self.install_line}",
        )


def load_fashion_mnist(flatten: bool = False) -> Split:
    """Load Fashion-MNIST: 60,000 train and 10,000 test 28x28 grey-scale clothing images.

    Source: H. Xiao, K. Rasul and R. Vollgraf (2017), "Fashion-MNIST: a Novel Image
    Dataset for Benchmarking Machine Learning Algorithms", arXiv:1708.07747,
    https://github.com/zalandoresearch/fashion-mnist; copyright 2017 Zalando SE, MIT
    licence. Read offline from the four ``*-idx?-ubyte.gz`` files in
    ``/usr/share/datasets/fashion-mnist`` that the Debian package
    ``dataset-fashion-mnist`` installs (``apt-get install dataset-fashion-mnist``);
    nothing is downloaded or cached.

    Preprocessing: none besides scaling: the standard train/test split of the files is
    kept in file order, and the uint8 pixels are divided by 255, so features lie in
    [0, 1] with 0 and 1 both attained. Ten balanced classes (6,000 train and 1,000 test
    images each), named in :data:`CLASS_NAMES`.

    Args:
        flatten: return features of shape ``(n, 784)`` instead of ``(n, 28, 28, 1)``.

    Returns:
        A :class:`Split` with float32 ``x`` in [0, 1], int32 labels 0-9, and no
        sensitive attribute.

    Raises:
        DataFileNotFoundError: a file is missing; the message gives the fix line
            ``apt-get install dataset-fashion-mnist``.
        ValueError: a file is not an unsigned-byte IDX file of the documented shape.
    """
    x_train, y_train = _load_part("train", flatten)
    x_test, y_test = _load_part("test", flatten)
    return Split(
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
        class_names=CLASS_NAMES,
        name="fashion_mnist",
    )


def find_fashion_mnist_file(name: str) -> Path:
    """Path of one Fashion-MNIST file, or :class:`DataFileNotFoundError` with the apt line."""
    path = FASHION_MNIST_DIR / name
    if not path.is_file():
        raise DebianDataFileNotFoundError(DEBIAN_PACKAGE, path)
    return path


def _load_part(part: str, flatten: bool) -> tuple[np.ndarray, np.ndarray]:
    image_file, label_file = FILES[part]
    images = read_idx(find_fashion_mnist_file(image_file))
    labels = read_idx(find_fashion_mnist_file(label_file))
    check_row_count("Fashion-MNIST", part, len(images), ROWS[part])
    check_row_count("Fashion-MNIST", f"{part} label", len(labels), ROWS[part])
    _check_shapes(images, labels)
    shape = (IMAGE_SIZE * IMAGE_SIZE,) if flatten else (IMAGE_SIZE, IMAGE_SIZE, 1)
    return _to_unit_interval(images).reshape((-1, *shape)), labels.astype(np.int32)


def _check_shapes(images: np.ndarray, labels: np.ndarray) -> None:
    if images.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE) or labels.ndim != 1:
        raise ValueError(f"Fashion-MNIST: unexpected shapes {images.shape} and {labels.shape}")
    if labels.size and labels.max() >= len(CLASS_NAMES):
        raise ValueError(f"Fashion-MNIST: label {labels.max()} outside 0..{len(CLASS_NAMES) - 1}")


def read_idx(path: Path) -> np.ndarray:
    """Read a gzip-compressed unsigned-byte IDX file (big-endian header) into a uint8 array."""
    with gzip.open(path, "rb") as handle:
        data = handle.read()
    if len(data) < 4 or data[:2] != b"\x00\x00" or data[2] != _IDX_UNSIGNED_BYTE:
        raise ValueError(f"{path}: not an unsigned-byte IDX file")
    ndim = data[3]
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    values = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if values.size != math.prod(shape):
        raise ValueError(f"{path}: header shape {shape} does not match {values.size} values")
    return values.reshape(shape)


def _to_unit_interval(pixels: np.ndarray) -> np.ndarray:
    """uint8 pixels divided by 255 as float32 (255 maps to exactly 1.0)."""
    x = pixels.astype(np.float32)
    np.divide(x, 255.0, out=x)
    return x
