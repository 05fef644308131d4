"""The main job's script runs end to end on real MNIST and Fashion-MNIST, on scattering
features and on pixels, with tiny settings."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("dataset,features", [("mnist", "scattering"), ("fashion_mnist", "pixels")])
def test_mnist_dpsgd_example_prints_epsilon_and_accuracy(dataset, features):
    command = [
        sys.executable, str(ROOT / "examples" / "mnist_dpsgd.py"), f"--dataset={dataset}", f"--features={features}",
        "--epochs=1",
        "--train_examples=3000", "--batch_size=100", "--learning_rate=0.5", "--noise_multiplier=1.0",
        "--ema_momentum=0.9",
    ]  # the recipe's averaging (β = 0.997) would still be mostly the initial weights after 30 steps
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    final = re.search(r"final: test accuracy = ([0-9.]+), epsilon = ([0-9.]+)", result.stdout)
    assert final, result.stdout
    accuracy, epsilon = float(final.group(1)), float(final.group(2))
    assert accuracy > 0.3  # 30 noisy steps on 3000 real images reach ~0.5; chance (or no update) is ~0.1
    assert 0 < epsilon < 10
    assert "epsilon:" in result.stdout  # per-epoch ε in the progress output
