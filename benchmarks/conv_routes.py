"""ms of each exact route to per-example convolution gradients, against the batch filter
gradient a non-private step computes instead, per Conv2D layer of the tutorial CNN.

    python benchmarks/conv_routes.py                    # batch 256
    python benchmarks/conv_routes.py --batch_size=1024

Routes (all exact): a grouped convolution's filter gradient with the examples as groups
(tf_dp's route for C_in = 1 where the kernel exists: oneDNN on), a depthwise filter gradient
with the examples as channels (C_in = 1; runs without oneDNN, but slower there than
unfolding: 71 ms against 49 ms at batch 256 on the tutorial CNN's first layer), unfolded
patches with explicit
A_iᵀS_i (tf_dp's route for C_in > 1 within the memory budget) and with float64 Gram-form
norms (beyond it), both with their rounding bounds (tf_dp/clipping/rounding.py), and the
float32 Gram form used before (unsafe under cancellation). The ratio to the batch filter
gradient bounds what any of them can reach inside a DP step on this machine. Run with
TF_ENABLE_ONEDNN_OPTS=0 to time the routes of CPUs where TensorFlow leaves oneDNN off (the
grouped row is then skipped).
Rounds alternate the routes; medians are reported. Prints a Markdown table, writes JSON.
"""

from __future__ import annotations

import os
import sys
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

from step_time import cnn  # noqa: E402
from tf_dp.clipping import conv  # noqa: E402
from tf_dp.clipping.dense import DenseContribution  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/record.py, also when loaded by path
from record import write_json  # noqa: E402  (writes the command, commit, machine and date)

FLAGS = flags.FLAGS  # --batch_size, --rounds and --output are step_time's flags
flags.DEFINE_integer("calls", 30, "Calls per timing.")
FLAGS.set_default("rounds", 7)
FLAGS.set_default("output", "benchmarks/results/conv_routes.json")


def _batch_filter_gradient(layer, x, s):
    (kh, kw), strides, _ = conv._window(layer)
    return tf.compat.v1.nn.conv2d_backprop_filter(x, [kh, kw, x.shape[-1], layer.filters], s,
                                                  [1, *strides, 1], layer.padding.upper())


def _depthwise(layer, x, s):
    """C_in = 1: the examples as the channels of one image, a depthwise filter gradient
    (runs without oneDNN; slower than unfolding there, so tf_dp does not use it)."""
    (kh, kw), strides, _ = conv._window(layer)
    image = tf.transpose(x, [3, 1, 2, 0])
    grads = tf.reshape(tf.transpose(s, [1, 2, 0, 3]), [1, s.shape[1], s.shape[2], -1])
    stacked = tf.compat.v1.nn.depthwise_conv2d_native_backprop_filter(
        image, [kh, kw, x.shape[0], layer.filters], grads, [1, *strides, 1], layer.padding.upper())
    return tf.transpose(stacked, [2, 0, 1, 3])


def _unfolded(layer, x, s, gram: bool) -> DenseContribution:
    contribution = DenseContribution(conv._patches(layer, x), tf.reshape(s, [x.shape[0], -1, layer.filters]), False,
                                     flat=False)
    contribution._uses_gram_form = lambda: gram  # pin the form
    return contribution


def _explicit(layer, x, s):
    """Explicit A_iᵀS_i and their certified norms (tf_dp's form within EXPLICIT_FLOATS)."""
    return _unfolded(layer, x, s, gram=False).squared_norms()


def _gram_norms(layer, x, s):
    """float64 Gram norms plus the rounding bound (tf_dp's form beyond EXPLICIT_FLOATS)."""
    return _unfolded(layer, x, s, gram=True).squared_norms()


def _gram_norms_float32(layer, x, s):
    """The float32 Gram form tf_dp used before the floating-point audit (unsafe: cancellation)."""
    a, g = conv._patches(layer, x), tf.reshape(s, [x.shape[0], -1, layer.filters])
    return tf.reduce_sum(tf.einsum("ptd,pud->ptu", a, a) * tf.einsum("ptk,puk->ptu", g, g), axis=[1, 2])


ROUTES = {
    "batch filter gradient (non-private)": _batch_filter_gradient,
    "grouped conv filter gradient (tf_dp, C_in = 1, oneDNN)": conv._grouped_filter_gradient,
    "depthwise filter gradient (C_in = 1, runs without oneDNN)": _depthwise,
    "patches + explicit A_iᵀS_i + bound (tf_dp, C_in > 1)": _explicit,
    "patches + float64 Gram norms + bound (tf_dp beyond memory)": _gram_norms,
    "patches + Gram norms, float32 (unsafe, before)": _gram_norms_float32,
}


def _available(name, x) -> bool:
    if "C_in = 1" in name and x.shape[-1] != 1:
        return False
    return "grouped" not in name or conv.grouped_conv_filter_gradient_available()


def _ms(function, x, s):
    function(x, s).numpy()
    start = time.perf_counter()
    for _ in range(FLAGS.calls):
        result = function(x, s)
    result.numpy()
    return (time.perf_counter() - start) / FLAGS.calls * 1000


def _layer_inputs(model):
    """(layer, input, output gradient) for every Conv2D, random values of the right shapes."""
    cases = []
    for layer in model.layers:
        if isinstance(layer, keras.layers.Conv2D):
            x = tf.random.normal([FLAGS.batch_size, *layer.input.shape[1:]])
            cases.append((layer, x, tf.random.normal(layer.compute_output_shape(x.shape))))
    return cases


def main(argv):
    del argv
    model = keras.Model(*cnn())
    rows = []
    print(f"batch {FLAGS.batch_size}, {os.cpu_count()} cores, median of {FLAGS.rounds} alternating rounds\n")
    print("| layer | route | ms | / batch filter gradient |\n|---|---|---|---|")
    for layer, x, s in _layer_inputs(model):
        routes = {name: tf.function(lambda x, s, f=f: f(layer, x, s)) for name, f in ROUTES.items()
                  if _available(name, x)}
        times = {name: [] for name in routes}
        for _ in range(FLAGS.rounds):
            for name, function in routes.items():
                times[name].append(_ms(function, x, s))
        base = times["batch filter gradient (non-private)"]
        for name, measured in times.items():
            ratio = statistics.median(t / b for t, b in zip(measured, base))
            rows.append({"layer": layer.name, "input": list(x.shape), "route": name,
                         "ms": statistics.median(measured), "ratio": ratio})
            print(f"| {layer.name} {tuple(x.shape[1:])} | {name} | {rows[-1]['ms']:.2f} | {ratio:.2f}x |", flush=True)
    write_json(FLAGS.output, {"date": time.strftime("%Y-%m-%d"), "batch_size": FLAGS.batch_size, "rows": rows},
               indent=2)


if __name__ == "__main__":
    app.run(main)
