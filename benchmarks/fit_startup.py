"""Start-up of the first DP ``fit`` against a plain Keras ``fit``: seconds from the call to the
end of a one-step epoch on a fresh model (host checks, row probe, tracing, first step).

Rounds alternate a fresh DP model and a fresh plain Keras model of the same architecture in
one process; the figure is the median of per-round DP/plain ratios (robust to drift of a
shared machine). Also prints the ops of the traced DP train function (its graph and every
function it calls: the chunk loop's body, conditionals), the trace-time cost the clipping
rules' bookkeeping adds.

    python benchmarks/fit_startup.py                    # MLP and small CNN, 3 rounds
    python benchmarks/fit_startup.py --models=mlp --rounds=5
    python benchmarks/fit_startup.py --fold_static_counts=false   # rounding bounds built as ops (before)
    python benchmarks/fit_startup.py --models=mlp --clock=thread   # CPU time of the calling thread

On a shared, loaded machine the wall clock mostly measures waiting for a core; ``--clock=thread``
counts the calling thread's CPU time (tracing, the probe, graph building and the first call's
graph optimization run there; TensorFlow's kernels on its own pools do not count).

The row-independence probe's share (fit's probe and the trace's, tf_dp.models.row_independence) is
printed too.
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

import tf_dp  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mlp", "cnn"], "Models: mlp (784-256-256-10), cnn (two Conv2D + Dense).")
flags.DEFINE_integer("rounds", 3, "Alternating rounds (a fresh DP and a fresh plain model each).")
flags.DEFINE_integer("batch_size", 64, "Batch size (the expected Poisson batch size for DP).")
flags.DEFINE_bool("fold_static_counts", True, "tf_dp.clipping.rounding.FOLD_STATIC_COUNTS: γ of static counts as "
                  "constants (true) or as ops from tf.shape (false, the former graph).")
flags.DEFINE_enum("clock", "wall", ["wall", "thread"], "wall: elapsed time; thread: CPU time of the calling thread "
                  "(fair on a loaded machine).")
ROWS = 1024


def _now() -> float:
    return time.thread_time() if FLAGS.clock == "thread" else time.perf_counter()


def mlp():
    inputs = keras.Input((28, 28, 1))
    x = keras.layers.Flatten()(inputs)
    x = keras.layers.Dense(256, activation="relu")(x)
    x = keras.layers.Dense(256, activation="relu")(x)
    return inputs, keras.layers.Dense(10)(x)


def cnn():
    inputs = keras.Input((28, 28, 1))
    x = keras.layers.Conv2D(16, 8, strides=2, padding="same", activation="relu")(inputs)
    x = keras.layers.Conv2D(32, 4, strides=2, padding="valid", activation="relu")(x)
    x = keras.layers.Dense(32, activation="relu")(keras.layers.Flatten()(x))
    return inputs, keras.layers.Dense(10)(x)


def _fit_seconds(model, x, y) -> float:
    start = _now()
    model.fit(x, y, batch_size=FLAGS.batch_size, epochs=1, steps_per_epoch=1, verbose=0)
    return _now() - start


def _dp(build):
    model = tf_dp.DPModel(*build())
    model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _plain(build):
    model = keras.Model(*build())
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _tf_functions(function, depth=4) -> list:
    """The tf.functions reachable through ``function``'s closures (Keras and tf_dp wrap them)."""
    if hasattr(function, "_list_all_concrete_functions"):
        return [function]
    found = []
    for cell in (getattr(function, "__closure__", None) or ()) if depth else ():
        contents = cell.cell_contents
        if callable(contents):
            found += [f for f in _tf_functions(contents, depth - 1) if all(f is not g for g in found)]
    return found


def traced_ops(model) -> int:
    """Ops of the traced train function(s): top-level graph plus every library function's nodes."""
    total = 0
    for function in _tf_functions(model.train_function):
        for concrete in function._list_all_concrete_functions():
            graph_def = concrete.graph.as_graph_def()
            total += len(graph_def.node) + sum(len(f.node_def) for f in graph_def.library.function)
    return total


class _ProbeClock:
    """Seconds spent in the row-independence probe: fit's and the step trace's (wraps
    row_independence._probe)."""

    def __init__(self):
        from tf_dp.models import row_independence

        self.seconds, check = 0.0, row_independence._probe

        def timed(*args, **kwargs):
            start = _now()
            try:
                return check(*args, **kwargs)
            finally:
                self.seconds += _now() - start

        row_independence._probe = timed


def measure(name, build, clock):
    rng = np.random.default_rng(0)
    x = rng.random((ROWS, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, ROWS)
    _fit_seconds(_plain(build), x, y)  # warm up TensorFlow's own one-time costs
    _fit_seconds(_dp(build), x, y)
    dp_times, plain_times, probe_times, ops = [], [], [], None
    for _ in range(FLAGS.rounds):
        model = _dp(build)
        clock.seconds = 0.0
        dp_times.append(_fit_seconds(model, x, y))
        probe_times.append(clock.seconds)
        ops = traced_ops(model)
        plain_times.append(_fit_seconds(_plain(build), x, y))
    ratio = statistics.median(d / p for d, p in zip(dp_times, plain_times))
    print(f"{name}: DP fit start-up {statistics.median(dp_times):.2f} s, plain {statistics.median(plain_times):.2f} s, "
          f"DP/plain {ratio:.2f} (median of {FLAGS.rounds} rounds; probe {statistics.median(probe_times):.2f} s "
          f"of the DP fit); traced DP train function: {ops} ops (fold_static_counts={FLAGS.fold_static_counts}, "
          f"{FLAGS.clock} clock)",
          flush=True)


def main(_):
    from tf_dp.clipping import rounding

    rounding.FOLD_STATIC_COUNTS = FLAGS.fold_static_counts
    clock = _ProbeClock()
    for name in FLAGS.models:
        measure(name, {"mlp": mlp, "cnn": cnn}[name], clock)


if __name__ == "__main__":
    app.run(main)
