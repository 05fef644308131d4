"""BandMF under MirroredStrategy on 2 logical CPU devices (docs/algorithms.md §10.4): each replica
runs the recursion on its own share (std σC/√R, its own stream and buffer); the all-reduced noise
has the single-device covariance σ²C²·C⁻¹C⁻ᵀ (numpy inverse of the banded Toeplitz C), σ = 0
trains as on one device, and the ledger's ε is dp_accounting's for the same event.
The runs are in bandmf_replicas_worker.py (a subprocess: logical devices must be set first)."""

import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

WORKER = pathlib.Path(__file__).with_name("bandmf_replicas_worker.py")
ROOT = str(WORKER.parents[2])


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    arrays = str(tmp_path_factory.mktemp("bandmf_replicas") / "arrays.npz")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, str(WORKER), arrays], capture_output=True, text=True, timeout=900,
                         env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    values = json.loads(run.stdout.strip().splitlines()[-1])
    values["released"] = np.load(arrays)["released"]
    return values


def _toeplitz(coefficients, steps):
    """The T×T lower-triangular b-banded Toeplitz C, C[t, t−j] = c_j (numpy, float64)."""
    return sum(c * np.eye(steps, k=-j) for j, c in enumerate(coefficients))


def test_the_summed_shares_have_the_single_device_covariance(results):
    """Zero gradients, T = 6, n = 24 012 coordinates: Σ̂ = W Wᵀ/n vs σ²C²·C⁻¹C⁻ᵀ.

    Tolerance as on one device (tests/test_noise_bandmf.py): Σ̂_st is a mean of n i.i.d. products
    with variance Σ_ss Σ_tt + Σ_st² (Isserlis); every entry within 5 standard errors. Unscaled
    shares (std σC on each replica) or one stream on both replicas give 2Σ: rejected."""
    noise = results["released"]
    steps, n = noise.shape
    inverse = np.linalg.inv(_toeplitz(results["coefficients"], steps))
    expected = results["stddev_on_sum"]**2 * inverse @ inverse.T
    empirical = noise @ noise.T / n
    standard_error = np.sqrt((np.outer(np.diag(expected), np.diag(expected)) + expected**2) / n)
    assert np.all(np.abs(empirical - expected) < 5 * standard_error), (empirical, expected)
    for wrong in (2 * expected, results["stddev_on_sum"]**2 * np.eye(steps)):  # unscaled shares; white noise
        assert np.any(np.abs(empirical - wrong) > 20 * standard_error)


def test_every_replica_holds_its_own_share_and_releases_the_same_values(results):
    assert results["released_identical_on_replicas"]
    assert results["buffer_is_per_replica"]
    # Independent streams: the two buffers are uncorrelated (one shared stream would give 1).
    assert abs(results["share_correlation"]) < 5 / math.sqrt(4 * 24012)
    # The variance factor F_n handed to the corrections is the single-device one (§10.5).
    assert results["noise_variance_factor"] == pytest.approx(results["expected_factor"], rel=1e-6)


def test_the_buffers_are_secret_and_a_reset_zeros_every_replica(results):
    assert results["reset_zeroes_every_replica"]
    assert results["checkpoint_size"] > 0 and results["checkpoint_names_with_bandmf"] == []


def test_bandmf_fits_under_two_replicas_and_sigma_zero_trains_as_on_one_device(results):
    assert results["same_initial_weights"]
    assert results["sigma0_max_change"] > 1e-2  # the steps moved the weights
    assert results["sigma0_max_difference"] < 1e-6  # float32 sums in another order
    assert results["mirrored_weights_identical_on_replicas"]


def test_the_ledger_of_a_two_replica_fit_is_dp_accountings_event(results):
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant

    from tf_dp.accounting.accountant import RDP_ORDERS

    n, batch, steps, bands = results["N"], results["batch"], results["fit_steps"], 2
    [(scheme, phase_steps, parameter, rate, sigma)] = results["mirrored_phases"]
    assert (scheme, phase_steps, parameter) == ("cyclic_poisson", steps, bands)
    assert rate == pytest.approx(bands * batch / n) and sigma == pytest.approx(1.1, rel=1e-6)
    accountant = rdp_privacy_accountant.RdpAccountant(RDP_ORDERS)
    accountant.compose(dp_event.PoissonSampledDpEvent(rate, dp_event.GaussianDpEvent(sigma)),
                       math.ceil(steps / bands))
    assert results["mirrored_epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)
    assert results["mirrored_epsilon"] == results["single_epsilon"]
