"""Every clipping route runs where TensorFlow runs, with oneDNN on or off.

TensorFlow leaves oneDNN off on many CPUs (AMD, AVX2-only Intel, ARM, macOS); there the
grouped convolution's filter gradient has no kernel. ``TF_ENABLE_ONEDNN_OPTS`` is read
once, when TensorFlow loads, so each setting runs in its own subprocess.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A DP clipping step on the tutorial CNN and the ScatterNet head (examples/mnist_dpsgd.py), and on grouped
# Conv1D/Conv2D layers, against per-example gradients by a GradientTape loop. Prints JSON.
SCRIPT = textwrap.dedent("""
    import json, sys
    import keras, numpy as np, tensorflow as tf
    sys.path[:0] = [{root!r}]
    from tests.harness import flat_norms, loop_per_example_gradients, sparse_ce
    from tf_dp.clipping import clipped_gradient_sum

    def tutorial_cnn():
        inputs = keras.Input((28, 28, 1))
        x = keras.layers.Conv2D(16, 8, strides=2, padding="same", activation="relu")(inputs)
        x = keras.layers.MaxPooling2D(2, 1)(x)
        x = keras.layers.Conv2D(32, 4, strides=2, padding="valid", activation="relu")(x)
        x = keras.layers.MaxPooling2D(2, 1)(x)
        x = keras.layers.Dense(32, activation="relu")(keras.layers.Flatten()(x))
        return keras.Model(inputs, keras.layers.Dense(10)(x)), (28, 28, 1)

    def scatternet_head():  # the main job's model on 81 x 7 x 7 scattering features
        inputs = keras.Input((7, 7, 81))
        x = keras.layers.GroupNormalization(27, center=False, scale=False)(inputs)
        x = keras.layers.Conv2D(16, 3, strides=2, padding="same", activation="tanh")(x)
        x = keras.layers.Conv2D(32, 3, padding="same", activation="tanh")(x)
        x = keras.layers.Dense(32, activation="tanh")(keras.layers.Flatten()(x))
        return keras.Model(inputs, keras.layers.Dense(10)(x)), (7, 7, 81)

    def grouped(rank):
        shape = (12, 4) if rank == 1 else (9, 9, 4)
        conv = keras.layers.Conv1D if rank == 1 else keras.layers.Conv2D
        inputs = keras.Input(shape)
        x = conv(6, 3, groups=2, padding="same", activation="tanh", name="grouped_%dd" % rank)(inputs)
        x = conv(4, 2, strides=2, groups=2, use_bias=False)(x)
        return keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(x))), shape

    def check(build, engine):
        keras.utils.set_random_seed(7)
        model, shape = build()
        batch = 5
        x = np.random.rand(batch, *shape).astype("float32")
        y = np.random.randint(0, 3, batch).astype("int32")
        loop = loop_per_example_gradients(model, x, y)
        norms = flat_norms(loop)
        clip = float(np.median(norms))
        try:
            result = clipped_gradient_sum(model, sparse_ce, tf.constant(x), tf.constant(y), tf.ones(batch), clip,
                                          engine=engine)
            got = np.sqrt(result.squared_norms.numpy())
            sums = [g.numpy() for g in result.clipped_sums]
        except Exception as error:  # reported, not raised: the parent asserts
            return {{"error": type(error).__name__ + ": " + str(error)[:1000]}}
        want = [sum(min(1.0, clip / norms[i]) * loop[i][v] for i in range(batch)) for v in range(len(sums))]
        norm_error = float(np.max(np.abs(got - norms) / norms))
        sum_error = max(float(np.max(np.abs(g - w)) / (np.max(np.abs(w)) + 1e-12)) for g, w in zip(sums, want))
        return {{"norm_error": norm_error, "sum_error": sum_error}}

    report = {{"ghost cnn": check(tutorial_cnn, "ghost"), "vectorized cnn": check(tutorial_cnn, "vectorized"),
              "ghost scatternet": check(scatternet_head, "ghost")}}
    for rank in (1, 2):
        report["ghost grouped %dd" % rank] = check(lambda: grouped(rank), "ghost")
        report["vectorized grouped %dd" % rank] = check(lambda: grouped(rank), "vectorized")
    print("REPORT" + json.dumps(report))
""")


def _run(onednn: str) -> dict:
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=onednn, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    script = SCRIPT.format(root=ROOT)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("REPORT"):])


@pytest.fixture(scope="module", params=["0", "1"], ids=["onednn_off", "onednn_on"])
def report(request):
    return _run(request.param)


@pytest.mark.parametrize("case", ["ghost cnn", "vectorized cnn", "ghost scatternet", "ghost grouped 1d",
                                  "ghost grouped 2d"])
def test_clipping_step_matches_per_example_loop(report, case):
    result = report[case]
    assert "error" not in result, result
    assert result["norm_error"] < 1e-4 and result["sum_error"] < 1e-4, result


@pytest.mark.parametrize("case", ["vectorized grouped 1d", "vectorized grouped 2d"])
def test_vectorized_engine_on_grouped_conv_runs_or_names_the_layer(report, case):
    # The whole-model vectorized_map has no route of its own for a grouped convolution
    # without its kernel: it must either match the loop or refuse, naming the layer.
    result = report[case]
    if "error" in result:
        assert "grouped_" in result["error"] and "ghost" in result["error"], result
    else:
        assert result["norm_error"] < 1e-4 and result["sum_error"] < 1e-4, result


def test_grouped_kernel_probe_is_cached_and_agrees_with_the_kernel():
    import tensorflow as tf

    from tf_dp.clipping import kernels

    available = kernels.grouped_conv_filter_gradient_available()
    assert kernels.grouped_conv_filter_gradient_available() is available  # one probe per process
    image, grads = tf.ones([1, 3, 3, 2]), tf.ones([1, 2, 2, 2])
    try:
        tf.compat.v1.nn.conv2d_backprop_filter(image, [2, 2, 1, 2], grads, [1, 1, 1, 1], "VALID")
        runs = True
    except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError):
        runs = False
    assert available is runs
