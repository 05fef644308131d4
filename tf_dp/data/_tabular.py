"""Small numpy helpers shared by the tabular loaders: checks, encoding, splitting."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ._split import Split


def check_row_count(dataset: str, split: str, actual: int, expected: int) -> None:
    """Raise ValueError when a split does not have the documented number of rows."""
    if actual != expected:
        raise ValueError(
            f"{dataset}: expected {expected} rows in the {split} split, found {actual}; "
            "the data file is not the documented version."
        )


def group_names_of(sensitive_attribute: str, choices: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """The group names of ``sensitive_attribute`` in ``choices``; ValueError naming the choices otherwise."""
    if sensitive_attribute not in choices:
        raise ValueError(f"sensitive_attribute must be one of {list(choices)}, got {sensitive_attribute!r}")
    return choices[sensitive_attribute]


def subset(table: dict[str, np.ndarray], mask: np.ndarray) -> dict[str, np.ndarray]:
    """The rows ``mask`` selects, in every column of ``table``."""
    return {name: values[mask] for name, values in table.items()}


def split_rows(
    is_test: np.ndarray,
    features: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray, tuple[str, ...]]],
    labels: np.ndarray,
    groups: np.ndarray,
    ids: np.ndarray,
    **metadata,
) -> Split:
    """The :class:`Split` of one table's rows by the boolean ``is_test`` mask.

    Args:
        is_test: True for the rows of the test split, one per row.
        features: (train mask, test mask) -> (x_train, x_test, feature names), every
            statistic fitted on the train rows.
        labels, groups, ids: one entry per row: label, sensitive group id, source row id.
        **metadata: the other :class:`Split` fields (sensitive_attribute, group_names,
            class_names, name).

    Returns:
        The Split: features from ``features``, every per-row array cut by ``is_test``.
    """
    is_train = ~is_test
    x_train, x_test, feature_names = features(is_train, is_test)
    return Split(
        x_train=x_train,
        y_train=labels[is_train],
        x_test=x_test,
        y_test=labels[is_test],
        sensitive_train=groups[is_train],
        sensitive_test=groups[is_test],
        feature_names=feature_names,
        ids_train=ids[is_train],
        ids_test=ids[is_test],
        **metadata,
    )


def check_fraction(test_fraction: float) -> None:
    """Raise ValueError unless 0 < test_fraction < 1."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")


def fit_vocabulary(train_values: np.ndarray) -> tuple[str, ...]:
    """Sorted distinct values of one categorical column, taken from the train split only."""
    return tuple(sorted(set(train_values.tolist())))


def one_hot(values: np.ndarray, vocabulary: Sequence[str]) -> np.ndarray:
    """float32 indicator columns, one per vocabulary entry; unseen values give all zeros."""
    return (values[:, None] == np.asarray(vocabulary, dtype=values.dtype)[None, :]).astype(np.float32)


def standardize(train: np.ndarray, test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scale both splits with the train mean and std (a std of 0 counts as 1); float32 out."""
    mean, std = _train_statistics(train)
    return _scale(train, mean, std), _scale(test, mean, std)


def _train_statistics(train: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    train = np.asarray(train, dtype=np.float64)
    std = train.std(axis=0)
    return train.mean(axis=0), np.where(std > 0, std, 1.0)


def _scale(x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    return ((np.asarray(x, dtype=np.float64) - mean) / std).astype(np.float32)


def encode_columns(
    train: dict[str, np.ndarray],
    test: dict[str, np.ndarray],
    numeric: Sequence[str],
    categorical: Sequence[str],
    extra: Sequence[tuple[str, "callable"]] = (),
) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """Standardized ``numeric`` columns, then ``extra`` (name, table -> [n, 1]) columns, then
    one-hot ``categorical`` columns; statistics and vocabularies fitted on train only."""
    numeric_train, numeric_test = standardize(
        np.column_stack([train[c].astype(np.float64) for c in numeric]),
        np.column_stack([test[c].astype(np.float64) for c in numeric]),
    )
    blocks_train = [numeric_train] + [encode(train) for _, encode in extra]
    blocks_test = [numeric_test] + [encode(test) for _, encode in extra]
    names = [*numeric, *(name for name, _ in extra)]
    for column in categorical:
        vocabulary = fit_vocabulary(train[column])
        blocks_train.append(one_hot(train[column], vocabulary))
        blocks_test.append(one_hot(test[column], vocabulary))
        names.extend(f"{column}={value}" for value in vocabulary)
    return np.hstack(blocks_train), np.hstack(blocks_test), tuple(names)


def encode_groups(values: np.ndarray, group_names: Sequence[str], attribute: str) -> np.ndarray:
    """int32 group ids: the index of each value in ``group_names``; unknown values raise."""
    lookup = {name: index for index, name in enumerate(group_names)}
    unknown = sorted(set(values.tolist()) - lookup.keys())
    if unknown:
        raise ValueError(f"unknown {attribute} values {unknown}; expected one of {list(group_names)}")
    return np.array([lookup[value] for value in values.tolist()], dtype=np.int32)


def stratified_group_split(
    groups: np.ndarray, labels: np.ndarray, test_fraction: float, seed: int
) -> np.ndarray:
    """Boolean test mask that keeps every group (e.g. a subject) on one side of the split.

    Groups are shuffled with ``numpy.random.default_rng(seed)`` separately within each
    label class, and ``round(test_fraction * n)`` groups of each class go to the test
    split, so both splits keep the class ratio. Every group must carry a single label.
    Pass ``groups=np.arange(n)`` for a plain stratified row split.
    """
    check_fraction(test_fraction)
    group_labels = _label_per_group(groups, labels)
    rng = np.random.default_rng(seed)
    test_groups = []
    for label in sorted(set(group_labels.values())):
        members = np.array(sorted(g for g, lab in group_labels.items() if lab == label))
        count = int(round(test_fraction * len(members)))
        test_groups.append(rng.permutation(members)[:count])
    return np.isin(groups, np.concatenate(test_groups))


def _label_per_group(groups: np.ndarray, labels: np.ndarray) -> dict:
    group_labels: dict = {}
    for group, label in zip(groups.tolist(), labels.tolist()):
        if group_labels.setdefault(group, label) != label:
            raise ValueError(f"group {group!r} has more than one label; cannot stratify by group")
    return group_labels
