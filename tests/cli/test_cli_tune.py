"""`tf-dp tune`: a tiny private random search on Adult from the command line. Its printed and
saved ε is the selection bound recomputed here from dp_accounting and Theorem 2 by hand; it
prints only the allowed lines (no number of trials, no seed) and releases the best model."""

import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant

from tests.cli.cli_runner import run_cli_commands
from tf_dp.tuning.selection import ORDERS

TRAIN, VALIDATION, BATCH, EPOCHS, TARGET, SCORE_NOISE, DELTA = 2000, 500, 200, 1, 3.0, 30.0, 1e-5
MEAN_TRIALS = 2  # E[K] (> 1 for the logarithmic law): the number of trainings is random and secret
ALLOWED_LINES = [
    r"tuning: epsilon = \d+\.\d{4} at delta = 1e-05 \(RDP\), the whole search \(K ~ logarithmic, E\[K\] = 2\); "
    r"one trial alone: \d+\.\d{4}",
    r"sigma per trial = \d+\.\d{4}",
    r"best trial: test accuracy = \d\.\d{4} \(l2_norm_clip = [\d.]+, learning_rate = [\d.]+\)",
    r"released: \S+model\.keras, \S+privacy\.json",
]


def cli(*args):
    return subprocess.run([sys.executable, "-m", "tf_dp.cli", *args], capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    output = tmp_path_factory.mktemp("tuned") / "release"
    result = cli("tune", "--dataset=adult", f"--target_epsilon={TARGET}", f"--mean_trials={MEAN_TRIALS}",
                 f"--train_examples={TRAIN}", f"--validation_examples={VALIDATION}", f"--batch_size={BATCH}",
                 f"--epochs={EPOCHS}", f"--score_noise={SCORE_NOISE}", "--learning_rates=0.1,1",
                 "--clip_norms=0.5,2", f"--output={output}")
    assert result.returncode == 0, result.stderr[-3000:]
    return result, output


@pytest.fixture(scope="module")
def after_tune(tuned):
    """`tf-dp report` of the release and `tf-dp tune` without --output, in one process."""
    _, output = tuned
    report, no_output = run_cli_commands([["report", str(output)], ["tune", "--target_epsilon=3"]])
    return {"report": report, "no_output": no_output}


def theorem_2_epsilon(sigma, gamma):
    """ε(δ) of the search by hand: one trial = T Poisson DP-SGD steps (q = L/N) + the Gaussian
    score, its RDP from dp_accounting; Theorem 2 at η = 0 with λ̂ over {1} ∪ orders; the
    RDP → (ε, δ) conversion of dp_accounting."""
    steps = EPOCHS * math.ceil(TRAIN / BATCH)
    trial = dp_event.ComposedDpEvent([
        dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(BATCH / TRAIN, dp_event.GaussianDpEvent(sigma)),
                                     steps),
        dp_event.GaussianDpEvent(SCORE_NOISE)])
    engine = rdp_privacy_accountant.RdpAccountant(list(ORDERS))
    engine.compose(trial)
    rdp, orders = np.asarray(engine._rdp), np.asarray(ORDERS)
    mean = (1 / gamma - 1) / math.log(1 / gamma)
    overhead = min([math.log(1 / gamma)] + [(1 - 1 / a) * r + math.log(1 / gamma) / a for a, r in zip(orders, rdp)])
    curve = rdp + overhead + math.log(mean) / (orders - 1)
    return rdp_privacy_accountant.compute_epsilon(orders, curve, DELTA)[0]


def test_tune_prints_only_the_allowed_lines(tuned):
    result, _ = tuned
    lines = result.stdout.strip().splitlines()
    assert len(lines) == len(ALLOWED_LINES), result.stdout
    for line, pattern in zip(lines, ALLOWED_LINES):
        assert re.fullmatch(pattern, line), line
    assert "seed" not in (result.stdout + result.stderr).lower()


def test_tune_epsilon_is_the_selection_bound_and_meets_the_target(tuned):
    result, output = tuned
    report = json.loads((output / "privacy.json").read_text())
    (phase,) = report["phases"]
    assert (phase["steps"], phase["sampling_rate"], phase["num_examples"]) == (10, 0.1, TRAIN)
    distribution = report["tuning"]["distribution"]
    assert distribution["name"] == "truncated_negative_binomial" and distribution["eta"] == 0.0
    assert distribution["expected_trials"] == pytest.approx(MEAN_TRIALS, rel=1e-9)
    expected = theorem_2_epsilon(phase["noise_multiplier"], distribution["gamma"])
    assert report["epsilon"] == pytest.approx(expected, rel=1e-9)
    assert report["epsilon"] <= TARGET
    assert f"epsilon = {report['epsilon']:.4f}" in result.stdout
    assert f"sigma per trial = {phase['noise_multiplier']:.4f}" in result.stdout
    assert "seed" not in json.dumps(report).lower()
    assert not {"trials", "num_trials", "k"} & {key.lower() for key in report["tuning"]}


def test_tune_releases_the_best_model_that_report_reads(tuned, after_tune):
    result, output = tuned
    report = json.loads((output / "privacy.json").read_text())
    best = report["tuning"]["hyperparameters"]
    assert best["learning_rate"] in (0.1, 1.0) and best["l2_norm_clip"] in (0.5, 2.0)
    assert f"l2_norm_clip = {best['l2_norm_clip']:g}, learning_rate = {best['learning_rate']:g}" in result.stdout
    assert (output / "model.keras").exists()
    printed = after_tune["report"]
    assert printed.returncode == 0 and f"epsilon = {report['epsilon']:.4f}" in printed.stdout


def test_tune_without_output_is_a_usage_error(after_tune):
    result = after_tune["no_output"]
    assert result.returncode != 0 and "--output" in result.stderr
