"""Runs DP steps under MirroredStrategy on 2 logical CPU devices; used by test_distributed.py."""

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
x = rng.normal(size=(8, 4)).astype("float32")
x[3] *= 100.0  # clipped
y = rng.integers(0, 3, 8).astype("int32")


def build(units=3, features=4, zeros=False):
    inputs = keras.Input((features,))
    init = "zeros" if zeros else "glorot_uniform"
    return tf_dp.DPModel(inputs, keras.layers.Dense(units, kernel_initializer=init)(inputs))


results = {}
x = rng.normal(size=(64, 4)).astype("float32")
x[::5] *= 100.0  # some gradients far above C
y = rng.integers(0, 3, 64).astype("int32")
single = build()
initial = single.get_weights()
single.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=0.5, noise_multiplier=0.0, seed=1), loss=loss)
with strategy.scope():
    mirrored = build()
    mirrored.set_weights(initial)
    mirrored.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=0.5, noise_multiplier=0.0, seed=1), loss=loss)
# The same Poisson batch (two chunks: 16 + overflow) on one device and split over two replicas.
batch = next(iter(poisson_dataset(x, y, 64, 16, None, seed=5, chunk_multiple=2)))
results["chunks"] = [float(v) for v in batch["mask"].numpy().sum(axis=1)]
single._prebuild(x, y)
with reference_steps(single):
    single.train_step(batch)
mirrored._prebuild(x, y)
distributed = next(iter(distributed_poisson_dataset(strategy, x, y, 64, 16, None, seed=5)))
results["chunks_per_replica"] = [float(v.numpy().sum()) for v in distributed["mask"].values]
with reference_steps(mirrored):
    tf.function(lambda d: strategy.run(mirrored.train_step, args=(d,)))(distributed)
try:
    mirrored.train_on_batch(x, y, batch_size=len(y))
    results["train_on_batch_refused"] = False
except ValueError:
    results["train_on_batch_refused"] = True
results["max_difference_sigma0"] = float(max(np.abs(a - b).max() for a, b in zip(single.get_weights(),
                                                                                mirrored.get_weights())))
results["steps_counted"] = int(mirrored.privacy_ledger.steps.numpy())

units, sigma, clip = 20000, 1.3, 0.7
with strategy.scope():
    noisy = build(units, 1, zeros=True)
    noisy.compile(optimizer=tf_dp.DPSGD(1.0, l2_norm_clip=clip, noise_multiplier=sigma, seed=3), loss="mse")
before = noisy.get_weights()[1]
noisy.fit(np.zeros((64, 1), "float32"), np.zeros((64, units), "float32"), batch_size=8, epochs=1, steps_per_epoch=1,
          verbose=0)
step = noisy.get_weights()[1] - before
results["noise_std_ratio"] = float(step.std() / (sigma * clip / 8))  # L = 8, the expected global batch
results["units"] = units

with strategy.scope():
    fitted = build()
    fitted.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0, seed=0), loss=loss)
big_x = rng.normal(size=(200, 4)).astype("float32")
fitted.fit(big_x, (big_x[:, 0] > 0).astype("int32"), batch_size=20, epochs=1, verbose=0)
results["fit_steps"] = int(fitted.privacy_ledger.steps.numpy())
results["fit_epsilon"] = fitted.get_epsilon()


def three_steps(make_optimizer, under_strategy):
    """3 steps (σ = 0) from the same weights: ``fit`` under the strategy (3 epochs of 1 step),
    or train_step on one device fed the batches of steps 0, 1, 2 of the same seeded stream."""
    with (strategy.scope() if under_strategy else tf.distribute.get_strategy().scope()):
        model = build()
        model.set_weights(initial)
        model.compile(optimizer=make_optimizer(), loss=loss)
    if under_strategy:
        model.fit(x, y, batch_size=16, epochs=3, steps_per_epoch=1, sampling_seed=9, verbose=0)
    else:
        model._prebuild(x, y)
        with reference_steps(model):
            for batch in poisson_dataset(x, y, 64, 16, None, seed=9).take(3):
                model.train_step(batch)
    return model.get_weights()


for name, make in {"sgd": lambda: tf_dp.DPSGD(0.05, noise_multiplier=0.0, l2_norm_clip=0.5),
                   "disk": lambda: tf_dp.DiSK(0.05, noise_multiplier=0.0, l2_norm_clip=0.5, seed=2),
                   "fiber": lambda: tf_dp.FIBER(0.05, noise_multiplier=0.0, l2_norm_clip=0.5, seed=2)}.items():
    one, two = three_steps(make, False), three_steps(make, True)
    results[f"{name}_max_difference"] = float(max(np.abs(a - b).max() for a, b in zip(one, two)))
    results[f"{name}_moved"] = float(max(np.abs(a - b).max() for a, b in zip(one, initial)))
print(json.dumps(results))
sys.stdout.flush()
