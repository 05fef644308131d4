"""`tf-dp` command line, SavedModel export without DP machinery, privacy.json, TensorBoard ε."""

import json
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.cli.cli_runner import run_cli_commands
from tests.harness import sparse_ce

ROOT = pathlib.Path(__file__).resolve().parents[2]


def cli(*args):
    return subprocess.run([sys.executable, "-m", "tf_dp.cli", *args], capture_output=True, text=True, timeout=300)


COMMON = ["--num_examples=60000", "--batch_size=256", "--epochs=60", "--delta=1e-5"]
EPSILON_RUNS = {
    "rdp": ["epsilon", *COMMON, "--noise_multiplier=1.1"],
    "pld": ["epsilon", *COMMON, "--noise_multiplier=1.1", "--accountant=pld"],
    "calibrate": ["calibrate", "--target_epsilon=2.597", *COMMON],
}
BAD_USAGE = [["epsilon", "--batch_size=3"], ["frobnicate"], ["epsilon", "--no_such_flag=1"]]


@pytest.fixture(scope="module")
def cli_runs():
    """{tuple(args): the result of `tf-dp ARGS`} for EPSILON_RUNS and BAD_USAGE, from one process."""
    every = [*EPSILON_RUNS.values(), *BAD_USAGE]
    return dict(zip(map(tuple, every), run_cli_commands(every)))


def test_cli_epsilon_known_answers_and_calibrate(cli_runs):
    assert cli_runs[tuple(EPSILON_RUNS["rdp"])].stdout.strip() == "2.597"
    assert cli_runs[tuple(EPSILON_RUNS["pld"])].stdout.strip() == "2.382"
    sigma = float(cli_runs[tuple(EPSILON_RUNS["calibrate"])].stdout.strip())
    assert sigma == pytest.approx(1.1, abs=0.002)


@pytest.mark.parametrize("args", BAD_USAGE)
def test_cli_bad_usage_exits_non_zero_with_usage(args, cli_runs):
    result = cli_runs[tuple(args)]
    assert result.returncode != 0
    assert "tf-dp epsilon" in result.stderr or "FATAL Flags parsing error" in result.stderr  # absl's usage text


def _trained_model():
    x = np.random.default_rng(0).normal(size=(64, 5)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    inputs = keras.Input((5,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0, seed=0), loss=sparse_ce)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    return model, x


def test_export_serves_same_predictions_without_dp_machinery(tmp_path):
    model, x = _trained_model()
    path = str(tmp_path / "exported")
    model.export(path, verbose=False)
    served = tf.saved_model.load(path)
    np.testing.assert_allclose(served.serve(x).numpy(), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    layer = keras.layers.TFSMLayer(path, call_endpoint="serve")
    np.testing.assert_allclose(np.asarray(layer(x)), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    ops = {op.type for f in served.serve.concrete_functions for op in f.graph.get_operations()}
    assert not ops & {"StatelessRandomNormalV2", "StatelessRandomUniformV2", "UnsortedSegmentSum"}
    ledger = json.loads((tmp_path / "exported" / "privacy.json").read_text())
    assert ledger["steps"] == 4 and ledger["epsilon"] == pytest.approx(model.get_epsilon())
    report = cli("report", path)
    assert report.returncode == 0 and f"epsilon = {model.get_epsilon():.4f}" in report.stdout
    assert "sampling=poisson" in report.stdout


def test_report_reads_a_keras_file(tmp_path):
    model, _ = _trained_model()
    model.save(tmp_path / "m.keras")
    report = cli("report", str(tmp_path / "m.keras"))
    assert report.returncode == 0, report.stderr[-2000:]
    assert "4 steps" in report.stdout


def test_epsilon_reaches_tensorboard(tmp_path):
    model, x = _trained_model()
    y = (x[:, 0] > 0).astype("int32")
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[keras.callbacks.TensorBoard(str(tmp_path / "tb"))])
    tags = set()
    for event_file in (tmp_path / "tb").rglob("events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(str(event_file)):
            tags.update(v.tag for v in event.summary.value)
    assert "epoch_epsilon" in tags
