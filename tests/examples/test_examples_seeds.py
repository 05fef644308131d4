"""The example scripts train with secret noise by default: `--noise_seed` (noise key and
Poisson batches) defaults to None, i.e. OS entropy, and is an opt-in whose help and
printed warning say that it voids the guarantee.

Independent check, per example, in one subprocess (this file run as a script): two runs
with the default flags start from the same (public) initial weights and end with different
trained weights (fresh noise and batches each run), while two runs with the same
`--noise_seed` end bit for bit equal. With public seeds the two default runs would be
equal, and re-running the script under "with x" and "without x" would tell which is true.
"""

import dataclasses
import functools
import hashlib
import importlib
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # ~3.5 min CPU: 24 tiny trainings, each tracing a fresh model

ROOT = pathlib.Path(__file__).resolve().parents[2]
OPT_IN_SEED = 2**40 + 7  # large, so the optimizers' small-seed warning stays out of the way
RUN_MARKER = "=== seed test run"
TEST_ROWS = 256  # test rows the examples evaluate on
WARNING = "is NO privacy guarantee"  # in the warning a fixed --noise_seed prints
# Tiny settings of each example (a few Poisson steps on a few hundred real rows).
TINY_FLAGS = {
    "mnist_dpsgd": ["--features=pixels", "--train_examples=256", "--batch_size=64", "--epochs=1",
                    "--noise_multiplier=1.0", "--ema_momentum=0"],
    "raco_adult": ["--max_steps=2", "--batch_size=256"],
    "fiber_vs_adamw": ["--optimizers=dpadamw", "--train_examples=256", "--test_examples=256", "--batch_size=64",
                       "--epochs=1", "--timing_rounds=0"],
    "dp_lora_text": ["--epochs=1", "--train_examples=256", "--test_examples=128", "--batch_size=64", "--rank=2",
                     "--vocabulary_size=500", "--embed_dim=8", "--ff_dim=16", "--timing_rounds=0"],
    "dp_lm_finetune": ["--train_examples=128", "--test_examples=32", "--batch_size=32", "--epochs=1",
                       "--vocabulary_size=200", "--sequence_length=8", "--num_layers=1", "--hidden_dim=16",
                       "--intermediate_dim=32", "--rank=2"],
}


def digest(weights) -> str:
    return hashlib.sha256(b"".join(w.tobytes() for w in weights)).hexdigest()


def small_test_split(data, rows: int = TEST_ROWS):
    """``data`` with its test arrays cut to ``rows`` (evaluation is not what is tested here)."""
    cut = {field.name: getattr(data, field.name)[:rows] for field in dataclasses.fields(data)
           if field.name.endswith("_test") and getattr(data, field.name) is not None}
    return dataclasses.replace(data, **cut)


def cache_data_loaders(tf_dp_data) -> None:
    """Each loader of ``tf_dp.data`` runs once per process (the examples only read the arrays),
    with the test split cut to TEST_ROWS."""
    for name in [n for n in dir(tf_dp_data) if n.startswith("load_")]:
        loader = getattr(tf_dp_data, name)
        setattr(tf_dp_data, name, functools.cache(lambda *a, loader=loader, **k: small_test_split(loader(*a, **k))))


def record_fits(tf_dp, fits: list) -> None:
    """Every DP fit appends the digests of the model's weights before and after it to ``fits``."""
    original_fit = tf_dp.DPModel.fit

    def recording_fit(self, *args, **kwargs):
        before = digest(self.get_weights())
        history = original_fit(self, *args, **kwargs)
        fits.append({"before": before, "after": digest(self.get_weights())})
        return history

    tf_dp.DPModel.fit = recording_fit


def run_example(example: str, fits: list) -> dict:
    """Imports ``example`` and runs its main four times (default flags twice, then
    --noise_seed=OPT_IN_SEED twice); returns the noise_seed flag's default and help and, per
    run, the weight digests of its DP fits. Removes the example's flags afterwards."""
    from absl import flags

    known = set(flags.FLAGS)
    module = importlib.import_module(example)
    flags.FLAGS([example, *TINY_FLAGS[example]])
    flag = flags.FLAGS["noise_seed"] if "noise_seed" in flags.FLAGS else None
    runs = []
    for seed in (None, None, OPT_IN_SEED, OPT_IN_SEED) if flag is not None else (None, None):
        if flag is not None:
            flags.FLAGS.noise_seed = seed
        print(f"{RUN_MARKER} {example} noise_seed={seed}", flush=True)
        fits.clear()
        module.main([example])
        runs.append({"noise_seed": seed, "fits": list(fits)})
    for name in set(flags.FLAGS) - known:
        delattr(flags.FLAGS, name)
    del sys.modules[example]
    return {"has_flag": flag is not None, "default": None if flag is None else flag.default,
            "help": "" if flag is None else flag.help, "runs": runs}


def worker(examples: list) -> None:
    """All ``examples`` in this one process (one TensorFlow start-up); one RESULT line each."""
    sys.path[:0] = [str(ROOT), str(ROOT / "examples")]  # this tree's tf_dp and examples, not an installed copy
    import tf_dp
    import tf_dp.data
    import tf_dp.raco

    cache_data_loaders(tf_dp.data)
    tf_dp.raco.calibrate_steps = functools.cache(tf_dp.raco.calibrate_steps)  # a pure function of its flags
    fits = []
    record_fits(tf_dp, fits)
    for example in examples:
        try:
            report = run_example(example, fits)
        except Exception as error:  # reported to the test of this example, the others still run
            report = {"error": f"{type(error).__name__}: {error}"}
        print(f"RESULT {example} " + json.dumps(report), flush=True)


@pytest.fixture(scope="module")
def reports():
    """{example: (report, printed output of each run)} from one worker process."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    command = [sys.executable, __file__, *TINY_FLAGS]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    found = {}
    for example in TINY_FLAGS:
        match = re.search(rf"^RESULT {example} (.*)$", result.stdout, re.M)
        assert match, f"no result for {example}: " + result.stdout[-2000:] + result.stderr[-3000:]
        outputs = [chunk for chunk in result.stdout.split(RUN_MARKER)[1:] if chunk.startswith(f" {example} ")]
        found[example] = json.loads(match.group(1)), outputs
    return found


@pytest.mark.parametrize("example", list(TINY_FLAGS))
def test_example_draws_fresh_noise_by_default_and_reproduces_only_when_opted_in(example, reports):
    report, outputs = reports[example]
    assert "error" not in report, report.get("error")
    assert report["has_flag"], f"{example} has no --noise_seed flag"
    assert report["default"] is None  # OS entropy for the noise key and the Poisson batches
    assert "VOIDS THE PRIVACY GUARANTEE" in report["help"]
    default_a, default_b, seeded_a, seeded_b = report["runs"]
    assert default_a["fits"] and len(default_a["fits"]) == len(seeded_a["fits"])
    for first, second in zip(default_a["fits"], default_b["fits"]):
        assert first["before"] == second["before"]  # the initial weights are public and fixed by --seed
        assert first["after"] != second["after"]  # fresh noise and batches: a re-run does not replay the release
    assert seeded_a["fits"] == seeded_b["fits"]  # the opt-in seed reproduces bit for bit
    assert all(WARNING not in text for text in outputs[:2])  # printed only when the seed is set
    assert all(WARNING in text for text in outputs[2:])


if __name__ == "__main__":
    worker(sys.argv[1:])
