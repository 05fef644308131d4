"""BandMF under MirroredStrategy on 2 logical CPU devices (docs/algorithms.md §10.4); used by
test_noise_bandmf_replicas.py. Prints one JSON line of results (large arrays go to the .npz
file named by argv[1])."""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dp  # noqa: E402
from tf_dp.noise import BandMF  # noqa: E402

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
results, arrays = {}, {}


def per_replica(variable) -> list:
    inner = variable._value if isinstance(variable, keras.Variable) else variable
    return [np.asarray(v.numpy()) for v in getattr(inner, "values", [inner])]


# 1. Zero gradients, T = 6 steps, lr = 1: the released global noise is (θ_{t−1} − θ_t)·L, the sum
# of both replicas' shares; the test compares its covariance over steps with σ²C²·C⁻¹C⁻ᵀ.
STEPS, BANDS, SIGMA, CLIP, L = 6, 4, 0.9, 1.5, 8.0
with strategy.scope():
    layer = keras.layers.Dense(12)
    layer.build((None, 2000))  # 24 012 coordinates
    optimizer = tf_dp.DPSGD(1.0, l2_norm_clip=CLIP, noise_multiplier=SIGMA, seed=4242, noise=BandMF(BANDS))
    optimizer.build(layer.trainable_variables)
variables = layer.trainable_variables


@tf.function
def zero_gradient_step(dp_step):
    def step():
        zeros = [tf.zeros_like(v) for v in variables]
        optimizer.apply_private_gradients(zeros, variables, tf.constant(L), dp_step=dp_step)
    strategy.run(step)


def flat(replica):
    return np.concatenate([per_replica(v)[replica].ravel() for v in variables]).astype(np.float64)


released, identical = [], True
previous = flat(0)
for t in range(STEPS):
    with optimizer.drawing_window():  # a reference computation of the mechanism (tests.harness.drawing_noise)
        zero_gradient_step(tf.constant(t, tf.int64))
    identical = identical and all(np.array_equal(flat(0), flat(r)) for r in range(2))
    current = flat(0)
    released.append((previous - current) * L)
    previous = current
arrays["released"] = np.stack(released)
results["released_identical_on_replicas"] = bool(identical)
buffer = optimizer.privatizer._buffer
shares = [np.concatenate([per_replica(b)[r].ravel() for b in buffer.variables]) for r in range(2)]
results["share_correlation"] = float(np.corrcoef(shares[0], shares[1])[0, 1])  # independent shares: ≈ 0
results["buffer_is_per_replica"] = [len(per_replica(b)) for b in buffer.variables] == [2] * len(variables)
results["coefficients"] = [float(c) for c in optimizer.privatizer.coefficients]
results["stddev_on_sum"] = SIGMA * CLIP
results["noise_variance_factor"] = float(optimizer.privatizer.noise_variance_factor().numpy())
results["expected_factor"] = float(optimizer.privatizer.variance_factors[STEPS - 1])
# A reset (new fit, re-key, resume) zeros every replica's buffer.
optimizer.privatizer.reset()
results["reset_zeroes_every_replica"] = all(not np.any(v) for b in buffer.variables for v in per_replica(b)) and \
    [int(v) for v in per_replica(buffer.last_step)] == [-1, -1]
# The buffer is in no checkpoint of the optimizer (it is held by a plain Python object).
checkpoint_names = [name for name, _ in tf.train.list_variables(
    tf.train.Checkpoint(optimizer=optimizer).save(os.path.join(sys.argv[1] + ".ckpt", "c")))]
results["checkpoint_names_with_bandmf"] = [n for n in checkpoint_names if "bandmf" in n.lower()]
results["checkpoint_size"] = len(checkpoint_names)

# 2. fit under 2 replicas vs one device: σ = 0 gives the same weights; σ > 0 the same ledger.
rng = np.random.default_rng(0)
N, BATCH, FIT_STEPS = 96, 12, 6
x = rng.normal(size=(N, 5)).astype("float32")
y = rng.integers(0, 3, N).astype("int32")


def classifier(sigma):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((5,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(3)(keras.layers.Dense(8, activation="tanh")(inputs)))
    model.compile(optimizer=tf_dp.DPSGD(0.5, l2_norm_clip=1.0, noise_multiplier=sigma, seed=77,
                                        noise=BandMF(2)), loss=loss)
    return model


def fitted(sigma, mirrored):
    if mirrored:
        with strategy.scope():
            model = classifier(sigma)
    else:
        model = classifier(sigma)
    initial = [w.copy() for w in model.get_weights()]
    model.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=FIT_STEPS, verbose=0, sampling_seed=2024)
    return model, initial


single, single_initial = fitted(0.0, mirrored=False)
mirrored, mirrored_initial = fitted(0.0, mirrored=True)
results["same_initial_weights"] = all(np.array_equal(a, b) for a, b in zip(single_initial, mirrored_initial))
results["sigma0_max_difference"] = float(max(np.max(np.abs(a - b)) for a, b in
                                             zip(single.get_weights(), mirrored.get_weights())))
results["sigma0_max_change"] = float(max(np.max(np.abs(a - b)) for a, b in
                                         zip(single.get_weights(), single_initial)))
noisy_single, _ = fitted(1.1, mirrored=False)
noisy_mirrored, _ = fitted(1.1, mirrored=True)
results["mirrored_ledger_steps"] = int(noisy_mirrored.privacy_ledger.steps.numpy())
results["mirrored_phases"] = [[p.scheme, p.steps, p.parameter, float(p.sampling_rate), float(p.noise_multiplier)]
                              for p in noisy_mirrored.privacy_ledger.phases()]
results["single_epsilon"] = float(noisy_single.get_epsilon(1e-5))
results["mirrored_epsilon"] = float(noisy_mirrored.get_epsilon(1e-5))
results["mirrored_weights_identical_on_replicas"] = all(
    all(np.array_equal(values[0], v) for v in values[1:]) for values in
    (per_replica(w) for w in noisy_mirrored.trainable_variables))
results["N"], results["batch"], results["fit_steps"] = N, BATCH, FIT_STEPS
np.savez(sys.argv[1], **arrays)
print(json.dumps(results))
sys.stdout.flush()
