"""RaCO-DP under MirroredStrategy on 2 logical CPU devices: every replica must use ONE noisy
histogram of the WHOLE global Poisson batch (counts summed over replicas, one Laplace draw),
so constraint values, λ and the Lagrangian weights W equal those of one device fed the same
batch. The worker runs in a subprocess (logical devices must be set before TF starts)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest


@pytest.fixture(scope="module")
def results():
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    run = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_histogram_noise_is_present_and_both_replicas_hold_data(results):
    assert all(results["chunks_per_replica"])  # both replicas count examples
    assert results["noise_size"] > 0.05  # Laplace(0.5) on 8 cells: the released histogram is noisy


def test_every_replica_sees_the_single_device_noisy_histogram(results):
    # The Laplace draw has no replica index, so one device and the all-reduced global
    # histogram must agree up to float32 summation order — on EVERY replica.
    assert len(results["replica_histograms"]) == 2
    for histogram in results["replica_histograms"]:
        np.testing.assert_allclose(histogram, results["single_histogram"], rtol=0, atol=1e-4)


def test_secure_mode_replicas_share_one_noisy_histogram(results):
    # Each replica draws its own key from the OS in secure_mode: still ONE draw, the same Ĥ
    # on both replicas, and it is noisy (not the single device's seeded draw).
    first, second = (np.array(h) for h in results["secure_histograms"])
    np.testing.assert_array_equal(first, second)
    assert np.abs(first - np.array(results["single_histogram"])).max() > 1e-3


def test_constraint_values_multipliers_and_sigma_zero_weights_equal_single_device(results):
    np.testing.assert_allclose(results["mirrored_values"], results["single_values"], atol=1e-5)
    np.testing.assert_allclose(results["mirrored_multipliers"], results["single_multipliers"], atol=1e-5)
    assert results["weights_moved"] > 1e-3
    assert results["max_weight_difference"] < 1e-5  # W uses the global histogram and the global L


def test_fit_under_strategy_equals_single_device_steps(results):
    # Two fit steps (σ = 0, histogram noise on): λ carried from step 1 to step 2 via the
    # ONLY_FIRST_REPLICA multipliers must match one device's train_step on the same batches.
    np.testing.assert_allclose(results["fit_multipliers"][1], results["fit_multipliers"][0], atol=1e-5)
    np.testing.assert_allclose(results["fit_values"][1], results["fit_values"][0], atol=1e-5)
    assert results["fit_max_weight_difference"] < 1e-5


# ---------------------------------------------------------------------------- worker
def _worker():
    import threading

    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

    import keras

    import tf_dp
    from tf_dp.models.data import distributed_poisson_dataset, poisson_dataset
    from tests.harness import reference_steps
    from tf_dp.raco import DemographicParity, RateConstrainedModel

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rng = np.random.default_rng(0)
    n = 64
    x = rng.normal(size=(n, 4)).astype("float32")
    x[::5] *= 30.0  # some gradients far above C
    y = rng.integers(0, 2, n).astype("int32")
    groups = rng.integers(0, 2, n).astype("int32")
    start_multipliers = np.array([0.8, 0.3, 0.5, 1.2], "float32")  # λ ≠ 0: W matters at the first step
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,))
    initial = keras.Model(inputs, keras.layers.Dense(2, activation="softmax")(inputs)).get_weights()

    def build(under_strategy):
        with (strategy.scope() if under_strategy else tf.distribute.get_strategy().scope()):
            inputs = keras.Input((4,))
            model = RateConstrainedModel(inputs, keras.layers.Dense(2, activation="softmax")(inputs))
            model.set_weights(initial)
            model.compile(optimizer=tf_dp.DPSGD(0.5, l2_norm_clip=0.5, noise_multiplier=0.0, seed=1),
                          loss="sparse_categorical_crossentropy", constraints=[DemographicParity(0.02)],
                          num_groups=2, histogram_noise=0.5, dual_learning_rate=2.0)
            model.multipliers.assign(start_multipliers)
        return model

    def probe(model):
        """Record the noisy histogram train_step hands to the constraint values (per thread:
        MirroredStrategy runs each replica's step in its own thread)."""
        seen, values = threading.local(), model.constraint_set.values

        def recording(histogram):
            seen.histogram = histogram
            return values(histogram)

        model.constraint_set.values = recording
        return seen

    results = {}
    extras = {"groups": groups}
    # One fixed global Poisson batch: on one device, and split by chunks over two replicas.
    batch = next(iter(poisson_dataset(x, y, n, 16, 8, 5, extras, chunk_multiple=2)))
    single = build(False)
    single._prebuild(x, y)
    clean = single.histogram.counts(
        single(tf.reshape(batch["x"], [-1, 4])), tf.reshape(batch["groups"], [-1]), tf.reshape(batch["mask"], [-1]))
    seen = probe(single)
    with reference_steps(single):
        single.train_step(batch)
    results["single_histogram"] = seen.histogram.numpy().tolist()
    results["noise_size"] = float(np.abs(seen.histogram.numpy() - clean.numpy()).max())

    mirrored = build(True)
    mirrored._prebuild(x, y)
    distributed = next(iter(distributed_poisson_dataset(strategy, x, y, n, 16, 8, 5, extras)))
    results["chunks_per_replica"] = [float(v.numpy().sum()) for v in distributed["mask"].values]
    seen = probe(mirrored)

    def step(data):
        mirrored.train_step(data)
        return seen.histogram

    with reference_steps(mirrored):
        per_replica = tf.function(lambda d: strategy.run(step, args=(d,)))(distributed)
    results["replica_histograms"] = [v.numpy().tolist() for v in per_replica.values]
    for name, model in (("single", single), ("mirrored", mirrored)):
        results[f"{name}_values"] = model.constraint_values.numpy().tolist()
        results[f"{name}_multipliers"] = model.multipliers.numpy().tolist()
    results["max_weight_difference"] = float(max(np.abs(a - b).max()
                                                 for a, b in zip(single.get_weights(), mirrored.get_weights())))
    results["weights_moved"] = float(max(np.abs(a - b).max() for a, b in zip(single.get_weights(), initial)))

    # secure_mode: every replica draws its own OS key, yet all must hold the same (one) Ĥ.
    with strategy.scope():
        secure = build(True)
        secure.compile(optimizer=tf_dp.DPSGD(0.5, l2_norm_clip=0.5, noise_multiplier=0.0, secure_mode=True),
                       loss="sparse_categorical_crossentropy", constraints=[DemographicParity(0.02)],
                       num_groups=2, histogram_noise=0.5, dual_learning_rate=2.0)
    secure._prebuild(x, y)
    seen = probe(secure)

    def secure_step(data):
        secure.train_step(data)
        return seen.histogram

    with reference_steps(secure):
        per_replica = tf.function(lambda d: strategy.run(secure_step, args=(d,)))(distributed)
    results["secure_histograms"] = [v.numpy().tolist() for v in per_replica.values]

    # fit under the strategy (2 steps) vs train_step on one device fed the batches of steps 0, 1.
    one, two = build(False), build(True)
    one._prebuild(x, y)
    with reference_steps(one):
        for data in poisson_dataset(x, y, n, 16, 8, 9, extras).take(2):
            one.train_step(data)
    two.fit(x, y, groups=groups, batch_size=16, physical_batch_size=8, epochs=1, steps_per_epoch=2,
            sampling_seed=9, verbose=0)
    results["fit_multipliers"] = [m.multipliers.numpy().tolist() for m in (one, two)]
    results["fit_values"] = [m.constraint_values.numpy().tolist() for m in (one, two)]
    results["fit_max_weight_difference"] = float(max(np.abs(a - b).max()
                                                     for a, b in zip(one.get_weights(), two.get_weights())))
    print(json.dumps(results))
    sys.stdout.flush()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    _worker()
