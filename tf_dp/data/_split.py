"""The result type shared by all loaders."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class Split:
    """A train/test split of one data set, as numpy arrays.

    Attributes:
        x_train, x_test: float32 features.
        y_train, y_test: int32 class labels in ``range(len(class_names))``.
        sensitive_train, sensitive_test: int32 group ids of the sensitive attribute
            (index into ``group_names``), or None for data sets without one.
        sensitive_attribute: name of the sensitive attribute (e.g. ``"sex"``), or None.
        group_names: ``group_names[g]`` names sensitive group id ``g``.
        class_names: ``class_names[k]`` names label ``k``.
        feature_names: one name per feature column (empty for images).
        ids_train, ids_test: identifiers of the source rows (or subjects) in each split,
            when this package made the split itself; None otherwise.
        name: short data set name.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    sensitive_train: np.ndarray | None = None
    sensitive_test: np.ndarray | None = None
    sensitive_attribute: str | None = None
    group_names: tuple[str, ...] = ()
    class_names: tuple[str, ...] = ()
    feature_names: tuple[str, ...] = ()
    ids_train: np.ndarray | None = None
    ids_test: np.ndarray | None = None
    name: str = ""

    @property
    def num_classes(self) -> int:
        """Number of label classes."""
        return len(self.class_names)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one example (without the batch dimension)."""
        return tuple(self.x_train.shape[1:])
