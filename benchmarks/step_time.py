"""ms/step of a DP-SGD step against a non-private Keras step, same model, same process.

Rounds alternate DP and non-private timings; the figure reported is the median of
per-round ratios (robust to drift of a shared 2-core machine). Prints a Markdown table
and writes JSON.

    python benchmarks/step_time.py                      # MLP, CNN, transformer; batch 256, graph mode
    python benchmarks/step_time.py --jit=true --models=mlp,cnn
    python benchmarks/step_time.py --models=mlp --jit=false --batch_size=1024
    python benchmarks/step_time.py --models=mlp --rounds=3 --path=train_on_batch,fit

``--path=train_on_batch`` (default) times a loop of ``train_on_batch`` calls: every call pays
the host checks around the step (row-probe key, phase, ledger reads). ``--path=fit`` times
the steps of one ``fit`` (from the start of its second batch to the end of its last: the
per-step host work of callbacks and of the train-function wrapper, not fit's start-up, which
``benchmarks/fit_startup.py`` times); DP ``fit`` draws Poisson batches of expected size
``batch_size`` from ``FIT_ROWS`` examples, plain ``fit`` takes fixed batches of that size.

Columns: non-private Keras (1.0), the same step plus one Gaussian per parameter (the
noise floor of DP-SGD), tf_dp DP-SGD with each engine, and tf_dp FIBER.
"""

from __future__ import annotations

import itertools
import os
import sys
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

import tf_dp  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/record.py, also when loaded by path
from record import write_json  # noqa: E402  (writes the command, commit, machine and date)
from noise_floor import NoiseFloorModel  # noqa: E402  (the plain step plus its noise draw)

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mlp", "cnn", "transformer"],
                  "Models to time: mlp (784-512-512-10), cnn (tensorflow-privacy tutorial), transformer (Embedding + "
                  "MultiHeadAttention + LayerNorm + Dense text classifier, 64 tokens).")
flags.DEFINE_list("jit", ["false"], "XLA settings to time (false, true). The README's XLA figures use "
                  "--models=mlp,cnn; the transformer under XLA was not timed.")
flags.DEFINE_list("engines", ["ghost"], "Clipping engines to time (ghost, vectorized).")
flags.DEFINE_integer("batch_size", 256, "Batch size.")
flags.DEFINE_string("dtype_policy", "float32", "Keras dtype policy for all models (float32 or mixed_bfloat16; "
                    "tf_dp clips and adds noise in float32 either way).")
flags.DEFINE_list("path", ["train_on_batch"], "How steps are taken: train_on_batch (a loop of calls), fit (the "
                  "steps of one fit call, its start-up excluded).")
flags.DEFINE_enum("clock", "wall", ["wall", "thread"], "wall: elapsed time (the figures the README reports); "
                  "thread: CPU time of the calling thread (time.thread_time), i.e. the host's Python and "
                  "dispatch work without the kernels TF runs on its pool threads — robust to a loaded machine.")
flags.DEFINE_bool("fiber", True, "Also time tf_dp FIBER (false: its columns are nan).")
flags.DEFINE_integer("rounds", 5, "Alternating rounds.")
flags.DEFINE_integer("steps", 20, "Steps per timing.")
flags.DEFINE_string("path_now", "train_on_batch", "Internal: the path being timed.")
flags.DEFINE_string("output", "benchmarks/results/step_time.json", "Where to write the JSON results.")


def mlp():
    inputs = keras.Input((28, 28, 1))
    x = keras.layers.Flatten()(inputs)
    x = keras.layers.Dense(512, activation="relu")(x)
    x = keras.layers.Dense(512, activation="relu")(x)
    return inputs, keras.layers.Dense(10)(x)


def cnn():
    inputs = keras.Input((28, 28, 1))
    x = keras.layers.Conv2D(16, 8, strides=2, padding="same", activation="relu")(inputs)
    x = keras.layers.MaxPooling2D(2, 1)(x)
    x = keras.layers.Conv2D(32, 4, strides=2, padding="valid", activation="relu")(x)
    x = keras.layers.MaxPooling2D(2, 1)(x)
    x = keras.layers.Dense(32, activation="relu")(keras.layers.Flatten()(x))
    return inputs, keras.layers.Dense(10)(x)


VOCABULARY, TOKENS = 5000, 64


def transformer():
    inputs = keras.Input((TOKENS,), dtype="int32")
    x = keras.layers.Embedding(VOCABULARY, 64)(inputs)
    attended = keras.layers.MultiHeadAttention(num_heads=4, key_dim=16)(x, x)
    x = keras.layers.LayerNormalization()(x + attended)
    x = keras.layers.LayerNormalization()(x + keras.layers.Dense(64)(keras.layers.Dense(128, activation="relu")(x)))
    return inputs, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(x))


def _inputs(name):
    if name == "transformer":
        return np.random.randint(0, VOCABULARY, (FLAGS.batch_size, TOKENS)).astype("int32")
    return np.random.rand(FLAGS.batch_size, 28, 28, 1).astype("float32")


FIT_ROWS = 20  # fit's data: FIT_ROWS · batch_size examples


def _ms_per_step(model, x, y, steps):
    if FLAGS.path_now == "fit":
        return _ms_per_fit_step(model, x, y, steps)
    start = _now()
    kwargs = {"batch_size": len(y)} if isinstance(model, tf_dp.DPModel) else {}
    for _ in range(steps):
        model.train_on_batch(x, y, **kwargs)
    return (_now() - start) / steps * 1000


def _now() -> float:
    return time.thread_time() if FLAGS.clock == "thread" else time.perf_counter()


class _StepClock(keras.callbacks.Callback):
    """Times from the start of the second batch to the end of the last."""

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 1:
            self.start = _now()

    def on_train_batch_end(self, batch, logs=None):
        self.end = _now()


def _ms_per_fit_step(model, x, y, steps):
    rows = FIT_ROWS * FLAGS.batch_size
    x, y = np.resize(x, (rows, *x.shape[1:])), np.resize(y, rows)
    clock = _StepClock()
    model.fit(x, y, batch_size=FLAGS.batch_size, epochs=1, steps_per_epoch=steps + 1, verbose=0,
              callbacks=[clock])
    return (clock.end - clock.start) / steps * 1000


def measure(name, build, jit, engine):
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x = _inputs(name)
    y = np.random.randint(0, 2, FLAGS.batch_size)
    private = tf_dp.DPModel(*build())
    private.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0, seed=0), loss=loss, jit_compile=jit,
                    clipping_engine=engine)
    fiber = tf_dp.DPModel(*build())
    fiber.compile(optimizer=tf_dp.FIBER(1e-3, noise_multiplier=1.0, seed=0), loss=loss, jit_compile=jit,
                  clipping_engine=engine)
    plain = keras.Model(*build())
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, jit_compile=jit)
    floor = NoiseFloorModel(*build())
    floor.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, jit_compile=jit)
    models = (private, plain, floor, fiber) if FLAGS.fiber else (private, plain, floor)
    for model in models:  # trace/compile outside the timings
        _ms_per_step(model, x, y, 3)
    dp_times, plain_times, floor_times, fiber_times = [], [], [], []
    for _ in range(FLAGS.rounds):
        dp_times.append(_ms_per_step(private, x, y, FLAGS.steps))
        plain_times.append(_ms_per_step(plain, x, y, FLAGS.steps))
        floor_times.append(_ms_per_step(floor, x, y, FLAGS.steps))
        fiber_times.append(_ms_per_step(fiber, x, y, FLAGS.steps) if FLAGS.fiber else float("nan"))
    return {
        "model": name, "path": FLAGS.path_now, "jit_compile": jit, "engine": engine, "batch_size": FLAGS.batch_size,
        "dtype_policy": FLAGS.dtype_policy,
        "plain_ms": statistics.median(plain_times), "floor_ms": statistics.median(floor_times),
        "dp_ms": statistics.median(dp_times), "fiber_ms": statistics.median(fiber_times),
        "fiber_ratio": statistics.median(d / p for d, p in zip(fiber_times, plain_times)),
        "ratio": statistics.median(d / p for d, p in zip(dp_times, plain_times)),
        "ratio_to_floor": statistics.median(d / f for d, f in zip(dp_times, floor_times)),
    }


def main(argv):
    del argv
    keras.config.set_dtype_policy(FLAGS.dtype_policy)
    builders = {"mlp": mlp, "cnn": cnn, "transformer": transformer}
    print(f"batch {FLAGS.batch_size}, {FLAGS.dtype_policy}, {os.cpu_count()} cores, median of {FLAGS.rounds} "
          f"alternating rounds of {FLAGS.steps} steps, {FLAGS.clock} clock\n", flush=True)
    print("| model | path | XLA | engine | non-private ms | non-private + noise ms | DP-SGD ms | DP-SGD / non-private "
          "| DP-SGD / noise floor | FIBER ms | FIBER / non-private |")
    print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    results = []
    for name, path, jit, engine in itertools.product(FLAGS.models, FLAGS.path, FLAGS.jit, FLAGS.engines):
        FLAGS.path_now = path
        r = measure(name, builders[name], jit == "true", engine)
        results.append(r)
        print(f"| {r['model']} | {path} | {r['jit_compile']} | {r['engine']} | {r['plain_ms']:.1f} | "
              f"{r['floor_ms']:.1f} | "
              f"{r['dp_ms']:.1f} | {r['ratio']:.2f}x | {r['ratio_to_floor']:.2f}x | {r['fiber_ms']:.1f} | "
              f"{r['fiber_ratio']:.2f}x |", flush=True)
    write_json(FLAGS.output, {"date": time.strftime("%Y-%m-%d"), "results": results}, indent=2)


if __name__ == "__main__":
    app.run(main)
