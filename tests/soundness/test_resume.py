"""A run killed with SIGKILL and resumed reports ε of every step taken."""

import pathlib
import signal
import subprocess
import sys
import time

import pytest

import tf_dp

WORKER = pathlib.Path(__file__).with_name("resume_worker.py")


def _paths(tmp, name):
    return [str(tmp / "backup"), str(tmp / f"{name}.marker"), str(tmp / f"{name}.result")]


def _start(pause, *runs):
    """One worker process training the runs (path triples of ``_paths``) one after the other,
    pausing ``pause`` seconds after each step."""
    return subprocess.Popen([sys.executable, str(WORKER), str(pause), *(path for paths in runs for path in paths)])


def _steps_done(marker):
    try:
        return int(pathlib.Path(marker).read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def test_sigkill_mid_epoch_then_resume_accounts_all_steps(tmp_path):
    _, marker, _ = _paths(tmp_path, "killed")
    process = _start(0.1, _paths(tmp_path, "killed"))  # slow steps: killed between backups
    deadline = time.time() + 600  # against a hung worker (start-up alone can take minutes under load)
    while _steps_done(marker) < 27 and process.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    assert process.poll() is None, "worker finished before it could be killed"
    process.send_signal(signal.SIGKILL)  # mid-epoch 2 (20 steps per epoch)
    process.wait()
    killed_at = _steps_done(marker)
    assert 20 < killed_at < 40

    # The resumed run (the killed run's backup folder), then an uninterrupted run in a folder of
    # its own, in one process.
    clean = tmp_path / "clean"
    clean.mkdir()
    (_, _, result), (_, _, clean_result) = _paths(tmp_path, "resumed"), _paths(clean, "clean")
    resumed = _start(0, _paths(tmp_path, "resumed"), _paths(clean, "clean"))
    assert resumed.wait(timeout=900) == 0
    epsilon, steps = pathlib.Path(result).read_text().split()
    epsilon, steps = float(epsilon), int(steps)
    clean_epsilon, clean_steps = pathlib.Path(clean_result).read_text().split()

    # Keras resumes at the start of the interrupted epoch, from the last backup (every 5
    # steps), so the resumed model has taken the backed-up steps of the killed run AND the
    # 3 epochs after: more steps than the uninterrupted 80, never fewer.
    assert int(clean_steps) == 80
    assert steps >= 80 and steps == 60 + (killed_at // 5) * 5
    assert epsilon == pytest.approx(tf_dp.compute_epsilon(400, 20, 1.2000000476837158, steps=steps), rel=1e-9)
    assert epsilon >= float(clean_epsilon)
    resumed_part_only = tf_dp.compute_epsilon(400, 20, 1.2000000476837158, steps=60)
    assert epsilon > resumed_part_only
