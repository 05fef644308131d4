"""One worker of a 2-process MultiWorkerMirroredStrategy cluster on localhost (TF_CONFIG
set by test_sources.py): fit on a random-access source that records which indices this
worker's input pipeline read. Prints one JSON line of results."""

import json
import os
import sys
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

strategy = tf.distribute.MultiWorkerMirroredStrategy()  # must exist before other TF ops

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dp  # noqa: E402

N, L, SEED, STEPS = 96, 16, 9, 3
rng = np.random.default_rng(0)
x = rng.normal(size=(N, 4)).astype("float32")
y = rng.integers(0, 3, N).astype("int32")


class Recording:
    """Records the indices read by the input pipeline (tf.data threads, not the main thread,
    which reads the row-independence guard's first examples)."""

    def __init__(self):
        self.loaded = []

    def __len__(self):
        return N

    def __getitem__(self, index):
        if threading.current_thread() is not threading.main_thread():
            self.loaded.append(int(index))
        return x[index], y[index]


def compiled(under_strategy):
    with (strategy.scope() if under_strategy else tf.distribute.get_strategy().scope()):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        model = tf_dp.DPModel(inputs, keras.layers.Dense(3)(inputs))
        model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=0.5, noise_multiplier=0.0, seed=1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


source = Recording()
distributed = compiled(True)
distributed.fit(source, batch_size=L, epochs=1, steps_per_epoch=STEPS, sampling_seed=SEED, verbose=0)
single = compiled(False)
single.fit(x, y, batch_size=L, epochs=1, steps_per_epoch=STEPS, sampling_seed=SEED, verbose=0)
print(json.dumps({
    "worker": json.loads(os.environ["TF_CONFIG"])["task"]["index"],
    "loaded": source.loaded,
    "max_difference": float(max(np.abs(a - b).max() for a, b in zip(distributed.get_weights(), single.get_weights()))),
    "steps": int(distributed.privacy_ledger.steps.numpy()),
}))
sys.stdout.flush()
