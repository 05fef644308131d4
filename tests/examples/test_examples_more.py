"""The DP-LoRA text example and the FIBER vs DP-AdamW example run end to end on real data
with tiny settings and print their final lines (both in one process:
tests/examples/example_runner.py)."""

import json
import pathlib
import re
import subprocess
import sys

import pytest

from tests.examples.example_runner import FAILED_MARKER, split_runs

ROOT = pathlib.Path(__file__).resolve().parents[2]
NUMBER = r"([0-9.]+|nan)"
RUNS = {
    "dp_lora_text": ["--epochs=1", "--train_examples=1000", "--test_examples=500", "--batch_size=100", "--rank=2",
                     "--target_epsilon=8", "--vocabulary_size=2000", "--embed_dim=16", "--ff_dim=32",
                     "--timing_rounds=1", "--timing_steps=2"],
    "fiber_vs_adamw": ["--dataset=mnist", "--epochs=1", "--train_examples=2000", "--test_examples=1000",
                       "--batch_size=100", "--target_epsilon=4", "--timing_rounds=1", "--timing_steps=2"],
}


@pytest.fixture(scope="module")
def outputs():
    """{example: the printed output of `python examples/EXAMPLE.py RUNS[example]`}."""
    command = [sys.executable, str(ROOT / "tests" / "examples" / "example_runner.py"),
               json.dumps([[name, *flags] for name, flags in RUNS.items()])]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(zip(RUNS, split_runs(result.stdout, len(RUNS))))


def run_example(outputs: dict, name: str) -> str:
    stdout = outputs[name]
    assert FAILED_MARKER not in stdout, stdout[-3000:]
    return stdout


def test_dp_lora_text_example_reports_both_runs_at_the_same_epsilon(outputs):
    stdout = run_example(outputs, "dp_lora_text")
    run = r"params = (\d+), ms/step = {n}, test accuracy = {n}, epsilon = {n}".format(n=NUMBER)
    final = re.search(rf"final: full: {run}; lora\(rank=2\): {run}; LoRA/full step time = {NUMBER}x", stdout)
    assert final, stdout
    full_params, full_ms, full_accuracy, full_epsilon = final.group(1, 2, 3, 4)
    lora_params, lora_ms, lora_accuracy, lora_epsilon = final.group(5, 6, 7, 8)
    # the embedding alone has 2000 x 16 weights; the LoRA factors of rank 2 are a few hundred
    assert int(full_params) > 32_000 > 50 * int(lora_params) > 0
    assert float(full_epsilon) == float(lora_epsilon) and 0 < float(full_epsilon) <= 8.0
    assert 0 <= float(full_accuracy) <= 1 and 0 <= float(lora_accuracy) <= 1
    assert float(full_ms) > 0 and float(lora_ms) > 0
    assert stdout.count("epsilon:") == 2  # per-epoch ε of each run in the progress output
    assert re.search(r"--- lora\(rank=2\): \d+ trainable parameters in 14 variables", stdout)  # 7 kernels x (a, b)


def test_fiber_vs_adamw_example_prints_accuracies_and_step_time_ratios(outputs):
    stdout = run_example(outputs, "fiber_vs_adamw")
    final = re.search(
        rf"final: mnist test accuracy: fiber = {NUMBER}, dpadamw = {NUMBER}, dpadambc = {NUMBER}; "
        rf"step time vs dpadamw: fiber {NUMBER}x, dpadambc {NUMBER}x; epsilon = {NUMBER}", stdout)
    assert final, stdout
    fiber, adamw, adambc, fiber_ratio, adambc_ratio, epsilon = (float(final.group(i)) for i in range(1, 7))
    assert fiber > 0.3  # 20 noisy steps on 2000 real digits; chance is 0.1
    assert 0 <= adamw <= 1 and 0 <= adambc <= 1
    assert fiber_ratio > 0 and adambc_ratio > 0
    assert 0 < epsilon <= 4.0
    assert stdout.count("epsilon:") == 3  # per-epoch ε of each optimizer
