"""The study script's protocol on a smoke run (benchmarks/fiber_study.py --quick)."""

import functools
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.examples.example_runner import FAILED_MARKER, split_runs

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "fiber_study.py"


@functools.cache
def _study():  # once per process: the script defines absl flags at import
    spec = importlib.util.spec_from_file_location("fiber_study", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


OPTIMIZERS = ["dpadamw", "fiber"]


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory):
    """{stage: the records file of `python benchmarks/fiber_study.py --quick --stage=STAGE ...`}:
    the smoke run of every stage ("all", two optimizers, one ablation) and the untuned defaults
    ("defaults"), both in one process (tests/examples/example_runner.py)."""
    folder = tmp_path_factory.mktemp("fiber_study")
    outputs = {"all": folder / "study.jsonl", "defaults": folder / "defaults.jsonl"}
    runs = [["fiber_study", "--quick", "--stage=all", f"--optimizers={','.join(OPTIMIZERS)}",
             "--ablations=ema_filter", f"--output={outputs['all']}"],
            ["fiber_study", "--quick", f"--output={outputs['defaults']}", "--stage=defaults"]]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, str(ROOT / "tests" / "examples" / "example_runner.py"), json.dumps(runs)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000)
    assert result.returncode == 0, result.stderr[-3000:]
    for printed in split_runs(result.stdout, len(runs)):
        assert FAILED_MARKER not in printed, printed[-3000:]
    return outputs


def test_every_search_space_spans_two_decades_of_learning_rate_and_the_design_is_stratified():
    study = _study()
    for name, space in study.SPACES.items():
        configs = study.latin_hypercube(space, 12, seed=0)
        assert len(configs) == 12
        assert study.lr_decades(configs) >= 2, name
        for key, (low, high, scale) in space.items():
            values = sorted(c[key] for c in configs)
            assert low <= values[0] and values[-1] <= high
            # one draw per stratum: the k-th smallest lies in the k-th of 12 equal strata
            unit = [(math.log(v / low) / math.log(high / low)) if scale == "log" else (v - low) / (high - low)
                    for v in values]
            assert all(k / 12 <= u <= (k + 1) / 12 for k, u in enumerate(unit)), (name, key)
    floors = [c["variance_floor"] for c in study.latin_hypercube(study.SPACES["fiber"], 12)]
    assert math.log10(max(floors) / min(floors)) >= 4  # several decades of variance_floor


def test_quick_run_covers_every_optimizer_and_epsilon_and_tests_the_validation_argmax(quick_runs):
    output = quick_runs["all"]
    records = [json.loads(line) for line in output.read_text().splitlines()]
    tests = [r for r in records if r["kind"] == "test" and not r["optimizer"].startswith("ablation")]
    assert {(r["optimizer"], r["epsilon"]) for r in tests} == {(o, 1.0) for o in OPTIMIZERS}
    for name in OPTIMIZERS:
        tuned = [r for r in records if r["kind"] == "tune" and r["optimizer"] == name]
        assert len(tuned) == 2
        chosen = max(tuned, key=lambda r: r["accuracy"])["config"]
        assert all(r["config"] == chosen for r in tests if r["optimizer"] == name)
        # σ is calibrated to ε on each run's own training rows
        assert all(0.9 <= r["epsilon_spent"] <= 1.0 for r in tuned + tests if r["optimizer"] == name)
    ablations = {r["optimizer"] for r in records if r["optimizer"].startswith("ablation:")}
    assert ablations == {"ablation:ema_filter"}
    [ema] = [r for r in records if r["optimizer"] == "ablation:ema_filter"]
    assert ema["config"] == next(r["config"] for r in tests if r["optimizer"] == "fiber")
    [diagnostic] = [r for r in records if r["kind"] == "diagnostic"]
    for row in diagnostic["probe"]:
        # the companion filter on pure N(0, σ_w²) noise leaves A_t·σ_w² (tens of thousands of coordinates)
        assert row["noise_only_filtered_var_over_target"] == pytest.approx(1.0, rel=0.05)
        assert 0 < row["A_t"] <= 1


def test_untuned_defaults_stage_runs_each_try_once_and_the_report_lists_them(quick_runs):
    output = quick_runs["defaults"]
    study = _study()
    # The second run and the report in this process (no second TensorFlow start-up), with
    # what --quick sets; the flags are restored afterwards.
    from absl import flags
    from absl.testing import flagsaver

    if not flags.FLAGS.is_parsed():
        flags.FLAGS(["fiber_study"])
    with flagsaver.flagsaver(quick=True, output=str(output), **study.QUICK):
        epsilons = [float(e) for e in flags.FLAGS.epsilons]
        study.run_defaults(flags.FLAGS.task, None, epsilons)  # finds every try done: trains nothing, reads no data
        records = [json.loads(line) for line in output.read_text().splitlines()]
        report = study.report(study.read_records(str(output)), study.run_keys())  # what --stage=report prints
    tries = [(r["optimizer"], r["try"]) for r in records if r["kind"] == "defaults"]
    want = [(name, label) for name, labels in study.DEFAULT_TRIES.items() for label in labels]
    assert sorted(tries) == sorted(want)
    for name, label in want:
        assert f"| {name}, {label} |" in report


def _dp_accounting_epsilon(rate, sigma, count, delta=1e-5):
    """dp_accounting directly (RDP): the Poisson-sampled Gaussian composed ``count`` times."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant

    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(dp_event.PoissonSampledDpEvent(rate, dp_event.GaussianDpEvent(sigma)), count)
    return accountant.get_epsilon(delta)


def test_bandmf_baselines_carry_bandmf_noise_and_sigma_meets_the_amplified_event_of_dp_accounting():
    from absl import flags

    import tf_dp

    study = _study()
    if not flags.FLAGS.is_parsed():
        flags.FLAGS(["fiber_study"])  # the defaults: T = 200, L = 64, b = 4
    steps, batch, bands, rows = flags.FLAGS.steps, flags.FLAGS.batch_size, flags.FLAGS.bands, 8000
    for name in study.BANDMF:
        assert name in study.SPACES
        # FIBER + BandMF is a borrowed-config run only (--optimizers=bandmf_fiber); the others are swept
        assert (name in flags.FLAGS.optimizers) == (name != "bandmf_fiber")
        sigma = study.noise_multiplier(1.0, rows, name)
        # b·L/N sampling, ⌈T/b⌉ rounds: ε ≤ 1 at σ, and the calibration is tight (0.1 %)
        assert _dp_accounting_epsilon(bands * batch / rows, sigma, math.ceil(steps / bands)) <= 1.0
        assert _dp_accounting_epsilon(bands * batch / rows, 0.995 * sigma, math.ceil(steps / bands)) > 1.0
        # a config at the middle of the optimizer's space (FIBER's lr = step_scale·√floor)
        config = {key: (low * high) ** 0.5 if scale == "log" else (low + high) / 2
                  for key, (low, high, scale) in study.SPACES[name].items()}
        optimizer = study.make_optimizer(name, study.with_learning_rate(config), sigma, seed=0)
        assert isinstance(optimizer.privatizer, tf_dp.noise.BandMF) and optimizer.privatizer.num_bands == bands
    # DP-SGD's σ is its own Poisson event's (rate L/N, T steps), not the BandMF one
    sigma = study.noise_multiplier(1.0, rows, "dpsgd")
    assert _dp_accounting_epsilon(batch / rows, sigma, steps) <= 1.0
    assert _dp_accounting_epsilon(batch / rows, 0.995 * sigma, steps) > 1.0
