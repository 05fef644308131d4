"""Peak resident memory (ru_maxrss) of DP training vs a plain Keras step, each in a fresh
subprocess, and of DP `fit` at one logical batch with different physical chunk sizes.

    python benchmarks/peak_memory.py
"""

from __future__ import annotations

import subprocess
import os
import sys

from absl import app, flags
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/record.py, also when loaded by path
from record import write_json  # noqa: E402  (writes the command, commit, machine and date)

FLAGS = flags.FLAGS
flags.DEFINE_integer("batch_size", 256, "Batch size of the step comparison.")
flags.DEFINE_integer("logical_batch", 2048, "Expected Poisson batch of the chunk comparison.")
flags.DEFINE_list("physical", ["128", "512", "2048"], "Physical chunk sizes to compare.")
flags.DEFINE_string("output", "benchmarks/results/peak_memory.json", "JSON output.")

WORKER = r"""
import os, resource, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import keras, numpy as np, tf_dp
mode, batch, physical = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
inputs = keras.Input((784,))
h = keras.layers.Dense(512, activation="relu")(inputs)
h = keras.layers.Dense(512, activation="relu")(h)
outputs = keras.layers.Dense(10)(h)
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
x = np.random.rand(8192, 784).astype("float32"); y = np.random.randint(0, 10, 8192)
if mode == "plain":
    model = keras.Model(inputs, outputs); model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    for _ in range(10): model.train_on_batch(x[:batch], y[:batch])
else:
    model = tf_dp.DPModel(inputs, outputs)
    model.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0, seed=0), loss=loss,
                  clipping_engine="vectorized" if mode == "vectorized" else "ghost")
    if physical:
        model.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=5, physical_batch_size=physical, verbose=0)
    else:
        for _ in range(10): model.train_on_batch(x[:batch], y[:batch], batch_size=batch)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def peak_mb(mode: str, batch: int, physical: int = 0) -> float:
    run = subprocess.run([sys.executable, "-c", WORKER, mode, str(batch), str(physical)], capture_output=True,
                         text=True, timeout=900)
    if run.returncode:
        raise RuntimeError(run.stderr[-2000:])
    return float(run.stdout.strip().splitlines()[-1])


def main(argv):
    del argv
    plain, ghost = peak_mb("plain", FLAGS.batch_size), peak_mb("ghost", FLAGS.batch_size)
    vectorized = peak_mb("vectorized", FLAGS.batch_size)
    chunks = {p: peak_mb("ghost", FLAGS.logical_batch, int(p)) for p in FLAGS.physical}
    print(f"\nMLP 784-512-512-10, batch {FLAGS.batch_size}: peak RSS plain {plain:.0f} MB, DP ghost {ghost:.0f} MB "
          f"({ghost / plain:.2f}x), DP vectorized {vectorized:.0f} MB ({vectorized / plain:.2f}x)")
    print(f"DP fit at expected batch {FLAGS.logical_batch}: " +
          ", ".join(f"physical {p}: {mb:.0f} MB" for p, mb in chunks.items()))
    write_json(FLAGS.output, {"plain_mb": plain, "ghost_mb": ghost, "vectorized_mb": vectorized,
                              "chunks_mb": chunks}, indent=2)


if __name__ == "__main__":
    app.run(main)
