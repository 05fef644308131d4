"""MultiWorkerMirroredStrategy with 2 worker processes on localhost (TF_CONFIG): every
worker draws the same global Poisson batch and keeps its replica's chunks; noise shares
sum to std σC once per global step; the ledger counts global steps."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

import tf_dp

WORKER = pathlib.Path(__file__).with_name("multi_worker_worker.py")


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.fixture(scope="module")
def workers():
    cluster = {"worker": [f"localhost:{port}" for port in _free_ports(2)]}
    processes = []
    for index in range(2):
        env = {**os.environ, "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})}
        processes.append(subprocess.Popen([sys.executable, str(WORKER)], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
    outputs = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=600)
            assert process.returncode == 0, stderr[-3000:]
            outputs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for process in processes:
            process.kill()
    return sorted(outputs, key=lambda r: r["worker"])


def test_workers_split_one_global_batch_without_overlap(workers):
    assert [w["replicas"] for w in workers] == [2, 2]
    for step, whole in enumerate(workers[0]["whole"]):
        parts = [w["served"][step] for w in workers]
        assert parts[0][0] + parts[1][0] == whole[0]  # every sampled example served exactly once
        assert parts[0][1] + parts[1][1] == pytest.approx(whole[1], rel=1e-5)
    assert workers[0]["served"][0][0] > 0 and workers[1]["served"][0][0] > 0  # 16 + overflow chunk: both work
    assert workers[0]["agreed_seed"] == workers[1]["agreed_seed"]


@pytest.mark.parametrize("name", ["sgd", "fiber"])
def test_fit_on_two_workers_equals_one_device_on_the_same_batches(workers, name):
    for w in workers:
        assert w[f"{name}_moved"] > 1e-3
        assert w[f"{name}_max_difference"] < 1e-5  # float32 summation order only
        assert w[f"{name}_steps"] == 3  # global steps, counted once


def test_noise_summed_over_workers_has_std_sigma_clip_over_global_batch(workers):
    # Each of the 2 replicas adds N(0, σ²C²/2); the all-reduced sum must have std σC (/L = 8).
    # Relative sd of the sample std of 20,000 normals is 1/√(2n) = 0.5 %: 5 sd = 2.5 %.
    # Full-std noise on both workers would give √2 (41 % off).
    for w in workers:
        assert abs(w["noise_std_ratio"] - 1) < 5 / np.sqrt(2 * w["units"])
    assert workers[0]["noise_checksum"] == workers[1]["noise_checksum"]  # one model, in sync
    for w in workers:  # one global step at the global rate q = 8/64
        # rel 1e-6: the ledger records σ as the optimizer holds it, in float32.
        assert w["noisy_epsilon"] == pytest.approx(tf_dp.compute_epsilon(64, 8, 1.3, steps=1), rel=1e-6)


def test_batched_datasets_are_refused_on_several_workers(workers):
    assert all(w["batched_refused"] for w in workers)
