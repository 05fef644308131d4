"""AdaptiveClip under MirroredStrategy on 2 logical CPU devices; used by
test_clipping_adaptive_replicas.py. Prints one JSON line of results."""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

# This repository's tf_dp and tests (a script's path is its own folder: an installed tf_dp would be found).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import tf_dp  # noqa: E402
from tf_dp.models.data import distributed_poisson_dataset, poisson_dataset  # noqa: E402

from tests.harness import reference_steps  # noqa: E402

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
rng = np.random.default_rng(0)
N, L, P, FEATURES = 64, 16, 4, 4
x = rng.normal(size=(N, FEATURES)).astype("float32") * rng.uniform(0.2, 3.0, size=(N, 1)).astype("float32")
y = rng.integers(0, 3, N).astype("int32")
C0, QUANTILE, RATE = 1.0, 0.5, 0.2


def build():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((FEATURES,))
    return tf_dp.DPModel(inputs, keras.layers.Dense(3)(inputs))


def per_example_norms(weights, examples, labels):
    """‖∇ℓ(θ; x_i, y_i)‖ over all trainable variables, one GradientTape per example (float64 sum)."""
    inputs = keras.Input((FEATURES,))
    plain = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    plain.set_weights(weights)
    norms = []
    for example, label in zip(examples, labels):
        with tf.GradientTape() as tape:
            value = loss(label[None], plain(example[None]))
        grads = tape.gradient(value, plain.trainable_variables)
        norms.append(np.sqrt(sum(np.sum(np.square(g.numpy().astype(np.float64))) for g in grads)))
    return np.asarray(norms)


def adaptive_optimizer(count_stddev, learning_rate=0.1):
    clip = tf_dp.clipping.AdaptiveClip(C0, target_quantile=QUANTILE, learning_rate=RATE, count_stddev=count_stddev)
    return tf_dp.DPSGD(learning_rate, l2_norm_clip=clip, noise_multiplier=0.0, seed=1234567891011)


def replica_values(variable):
    inner = getattr(variable, "_value", variable)
    return [float(v.numpy()) for v in getattr(inner, "values", [inner])]


results = {}
batch = next(iter(poisson_dataset(x, y, N, L, P, seed=5, chunk_multiple=2)))
mask = batch["mask"].numpy().astype(bool)
results["chunk_sizes"] = [int(m.sum()) for m in mask]

# 1. σ = 0, σ_b = 0: C_1 from the global count, vs an independent per-example loop.
single = build()
initial = single.get_weights()
single.compile(optimizer=adaptive_optimizer(0.0), loss=loss)
with strategy.scope():
    mirrored = build()
    mirrored.set_weights(initial)
    mirrored.compile(optimizer=adaptive_optimizer(0.0), loss=loss)
single._prebuild(x, y)
with reference_steps(single):
    single.train_step(batch)
mirrored._prebuild(x, y)
distributed = next(iter(distributed_poisson_dataset(strategy, x, y, N, L, P, seed=5)))
results["replica_examples"] = [int(v.numpy().sum()) for v in distributed["mask"].values]
assert sum(results["replica_examples"]) == int(mask.sum())  # the same global batch, split
mirrored_step = tf.function(lambda d: strategy.run(mirrored.train_step, args=(d,)))
with reference_steps(mirrored):
    mirrored_step(distributed)
norms = per_example_norms(initial, batch["x"].numpy()[mask], batch["y"].numpy()[mask])
results["norm_margin"] = float(np.min(np.abs(norms - C0)) / C0)
below = int(np.sum(norms <= C0))
results["below_count"], results["batch_size"] = below, int(mask.sum())
fraction = (below - mask.sum() / 2) / L + 0.5
results["expected_clip"] = float(C0 * np.exp(-RATE * (fraction - QUANTILE)))
results["single_clip"] = single.optimizer.l2_norm_clip
results["mirrored_clip"] = mirrored.optimizer.l2_norm_clip
results["mirrored_clip_replicas"] = replica_values(mirrored.optimizer._l2_norm_clip)
# What replica 0's chunks alone would give (the count of the old code).
first = distributed["mask"].values[0].numpy().astype(bool).ravel()
local_norms = per_example_norms(initial, distributed["x"].values[0].numpy().reshape(-1, FEATURES)[first],
                                distributed["y"].values[0].numpy().ravel()[first])
local_fraction = (np.sum(local_norms <= C0) - first.sum() / 2) / L + 0.5
results["replica0_only_clip"] = float(C0 * np.exp(-RATE * (local_fraction - QUANTILE)))

# 2. σ_b > 0: the count noise recovered from C_{t+1}/C_t over many steps has std σ_b (one
# noise on the global count; not √R·σ_b, not σ_b/√R). Learning rate 0 and C reset to C0 keep
# the batch's true count fixed, so n_t = L(γ − ln(C_{t+1}/C0)/η − ½) − centred count.
COUNT_STDDEV, STEPS = 3.0, 400
with strategy.scope():
    noisy = build()
    noisy.set_weights(initial)
    noisy.compile(optimizer=adaptive_optimizer(COUNT_STDDEV, learning_rate=0.0), loss=loss)
noisy._prebuild(x, y)
noisy_step = tf.function(lambda d: strategy.run(noisy.train_step, args=(d,)))
centred = below - mask.sum() / 2
recovered, identical = [], True
for _ in range(STEPS):
    noisy.optimizer.l2_norm_clip = C0
    with reference_steps(noisy):
        noisy_step(distributed)
    values = replica_values(noisy.optimizer._l2_norm_clip)
    identical = identical and len(set(values)) == 1
    recovered.append(L * (QUANTILE - np.log(values[0] / C0) / RATE - 0.5) - centred)
results["count_noise_std"] = float(np.std(recovered))
results["count_noise_mean"] = float(np.mean(recovered))
results["count_noise_steps"] = STEPS
results["count_stddev"] = COUNT_STDDEV
results["clip_identical_on_replicas"] = bool(identical)

print(json.dumps(results))
sys.stdout.flush()
