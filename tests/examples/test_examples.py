"""The main job's script runs end to end on real MNIST and Fashion-MNIST, on scattering
features and on pixels, with tiny settings (both runs in one process: tests/examples/example_runner.py)."""

import json
import pathlib
import re
import subprocess
import sys

import pytest

from tests.examples.example_runner import FAILED_MARKER, split_runs

ROOT = pathlib.Path(__file__).resolve().parents[2]
CASES = [("mnist", "scattering"), ("fashion_mnist", "pixels")]


def flags_of(dataset, features):
    return [
        "mnist_dpsgd", f"--dataset={dataset}", f"--features={features}", "--epochs=1",
        "--train_examples=3000", "--batch_size=100", "--learning_rate=0.5", "--noise_multiplier=1.0",
        "--ema_momentum=0.9",
    ]  # the recipe's averaging (β = 0.997) would still be mostly the initial weights after 30 steps


@pytest.fixture(scope="module")
def outputs():
    """{(dataset, features): the printed output of `python examples/mnist_dpsgd.py` with those flags}."""
    command = [sys.executable, str(ROOT / "tests" / "examples" / "example_runner.py"),
               json.dumps([flags_of(*case) for case in CASES])]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(zip(CASES, split_runs(result.stdout, len(CASES))))


@pytest.mark.parametrize("dataset,features", CASES)
def test_mnist_dpsgd_example_prints_epsilon_and_accuracy(dataset, features, outputs):
    stdout = outputs[dataset, features]
    assert FAILED_MARKER not in stdout, stdout[-3000:]
    final = re.search(r"final: test accuracy = ([0-9.]+), epsilon = ([0-9.]+)", stdout)
    assert final, stdout
    accuracy, epsilon = float(final.group(1)), float(final.group(2))
    assert accuracy > 0.3  # 30 noisy steps on 3000 real images reach ~0.5; chance (or no update) is ~0.1
    assert 0 < epsilon < 10
    assert "epsilon:" in stdout  # per-epoch ε in the progress output
