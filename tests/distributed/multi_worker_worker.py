"""One worker of a 2-process MultiWorkerMirroredStrategy cluster on localhost (TF_CONFIG
set by test_multi_worker.py). Prints one JSON line of results."""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

strategy = tf.distribute.MultiWorkerMirroredStrategy()  # must exist before other TF ops

import keras  # noqa: E402
import numpy as np  # noqa: E402

# This repository's tf_dp and tests (a script's path is its own folder: an installed tf_dp would be found).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import tf_dp  # noqa: E402
keras.config.disable_traceback_filtering()
from tf_dp.models.data import agreed_sampling_seed, distributed_poisson_dataset, poisson_dataset  # noqa: E402

from tests.harness import reference_steps  # noqa: E402

loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 4)).astype("float32")
x[::5] *= 100.0  # some gradients far above C
y = rng.integers(0, 3, 64).astype("int32")
results = {"worker": json.loads(os.environ["TF_CONFIG"])["task"]["index"],
           "replicas": strategy.num_replicas_in_sync}


def build(units=3, features=4, zeros=False):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((features,))
    initializer = "zeros" if zeros else "glorot_uniform"
    return tf_dp.DPModel(inputs, keras.layers.Dense(units, kernel_initializer=initializer)(inputs))


def compiled(make_optimizer, under_strategy, **model_args):
    with (strategy.scope() if under_strategy else tf.distribute.get_strategy().scope()):
        model = build(**model_args)
        model.compile(optimizer=make_optimizer(), loss=loss if not model_args else "mse")
    return model


# What this worker's replica is served: the masked row count and x-sum of its slice.
iterator = iter(distributed_poisson_dataset(strategy, x, y, 64, 16, None, seed=5))
served = []
for _ in range(3):
    element = next(iterator)
    local = strategy.experimental_local_results(element)[0]
    mask = local["mask"].numpy()
    served.append([float(mask.sum()), float((local["x"].numpy().sum(axis=-1) * mask).sum())])
results["served"] = served
results["whole"] = [[float(b["mask"].numpy().sum()), float((b["x"].numpy().sum(axis=-1) * b["mask"].numpy()).sum())]
                    for b in poisson_dataset(x, y, 64, 16, None, seed=5).take(3)]
results["agreed_seed"] = agreed_sampling_seed(strategy, None)

# 3 DP steps by fit under the strategy vs train_step on one device fed the same batches (σ = 0).
for name, make in {"sgd": lambda: tf_dp.DPSGD(0.1, l2_norm_clip=0.5, noise_multiplier=0.0, seed=1),
                   "fiber": lambda: tf_dp.FIBER(0.05, l2_norm_clip=0.5, noise_multiplier=0.0, seed=1)}.items():
    distributed = compiled(make, True)
    initial = distributed.get_weights()
    distributed.fit(x, y, batch_size=16, epochs=3, steps_per_epoch=1, sampling_seed=9, verbose=0)
    single = compiled(make, False)
    single.set_weights(initial)
    single._prebuild(x, y)
    with reference_steps(single):
        for batch in poisson_dataset(x, y, 64, 16, None, seed=9).take(3):
            single.train_step(batch)
    results[f"{name}_moved"] = float(max(np.abs(a - b).max() for a, b in zip(distributed.get_weights(), initial)))
    results[f"{name}_max_difference"] = float(max(np.abs(a - b).max()
                                                  for a, b in zip(distributed.get_weights(), single.get_weights())))
    results[f"{name}_steps"] = int(distributed.privacy_ledger.steps.numpy())
    results[f"{name}_epsilon"] = distributed.get_epsilon()

# σ > 0: one step from zero weights on zero inputs; the update is pure noise, std σC/L.
units, sigma, clip = 20000, 1.3, 0.7
noisy = compiled(lambda: tf_dp.DPSGD(1.0, l2_norm_clip=clip, noise_multiplier=sigma), True,
                 units=units, features=1, zeros=True)
noisy.fit(np.zeros((64, 1), "float32"), np.zeros((64, units), "float32"), batch_size=8, epochs=1, steps_per_epoch=1,
          verbose=0)
step = noisy.get_weights()[1]
results["noise_std_ratio"] = float(step.std() / (sigma * clip / 8))
results["noise_checksum"] = float(np.abs(step).sum())
results["units"] = units
results["noisy_epsilon"] = noisy.get_epsilon()
try:
    compiled(lambda: tf_dp.DPSGD(0.1, noise_multiplier=1.0), True).fit(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=1, verbose=0)
    results["batched_refused"] = False
except ValueError:
    results["batched_refused"] = True
print(json.dumps(results))
sys.stdout.flush()
