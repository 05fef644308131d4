"""The key never leaves the optimizer: RaCO-DP's histogram is a second release the optimizer
performs (``DPOptimizer.release_sum``, docs/algorithms.md §5, B.3), on an allocated stream,
inside the drawing window, with the stated noise, fresh at every step."""

import ast
import math
import pathlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.harness import drawing_noise, reference_steps
from tf_dp.noise.release import SumNoise

ROOT = pathlib.Path(__file__).resolve().parents[2] / "tf_dp"
KEY_NAMES = {"noise_key", "_noise_key", "_key_guard", "NoiseKeyGuard", "key_guard"}
KEY_HOLDERS = {"NoiseKey", "secure_key"}  # may be named only where the key lives


def _names(tree) -> set:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update(alias.name.rsplit(".", 1)[-1] for alias in node.names)
            found.update((node.module or "").split(".") if isinstance(node, ast.ImportFrom) else ())
    return found


def test_no_module_outside_the_optimizers_reads_the_noise_key():
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith("optimizers/"):
            continue
        names = _names(ast.parse(path.read_text()))
        forbidden = KEY_NAMES | (set() if relative in ("noise/key.py", "noise/__init__.py") else KEY_HOLDERS)
        offenders += [f"{relative}: {name}" for name in sorted(names & forbidden)]
    assert not offenders, offenders
    assert not hasattr(tf_dp.DPSGD, "noise_key")  # no public accessor of the key


def test_release_sum_has_the_stated_std_for_laplace_and_gaussian():
    optimizer = tf_dp.DPSGD(0.1, noise_multiplier=1.0, seed=3)
    cells = 200_000
    for distribution, multiplier, sensitivity, kurtosis in (("laplace", 0.7, 2.0, 6.0), ("gaussian", 1.3, 0.5, 3.0)):
        noise = SumNoise(distribution, sensitivity, multiplier)
        # independently: Laplace(b) has variance 2b², the Gaussian σ²; b, σ = multiplier · sensitivity
        expected = multiplier * sensitivity * (math.sqrt(2.0) if distribution == "laplace" else 1.0)
        with drawing_noise(optimizer):
            draw = optimizer.release_sum(tf.zeros([cells]), noise, tf.constant(4, tf.int64)).numpy()
        ratio = np.var(draw) / expected**2
        # Var(s²)/σ⁴ ≈ (μ4/σ⁴ − 1)/n: the tolerance is 6 standard deviations of the estimate
        assert abs(ratio - 1.0) < 6 * math.sqrt((kurtosis - 1.0) / cells), (distribution, ratio)
        assert abs(np.mean(draw)) < 6 * expected / math.sqrt(cells)


def test_release_sum_is_refused_outside_the_drawing_window():
    optimizer = tf_dp.DPSGD(0.1, noise_multiplier=1.0, seed=3)
    with pytest.raises(RuntimeError, match="outside a DP step"):
        optimizer.release_sum(tf.zeros([3]), SumNoise("laplace", 1.0, 1.0), tf.constant(0, tf.int64))


def test_release_sum_stream_is_distinct_from_the_gradient_noise():
    # Same key, same step: the histogram's draw and the gradient's are independent (different streams).
    optimizer = tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=5)
    variable = keras.Variable(tf.zeros([50_000]))
    optimizer.build([variable])
    with drawing_noise(optimizer):
        histogram = optimizer.release_sum(tf.zeros([50_000]), SumNoise("gaussian", 1.0, 1.0),
                                          tf.constant(2, tf.int64)).numpy()
        optimizer.apply_private_gradients([tf.zeros([50_000])], [variable], 1.0, dp_step=tf.constant(2, tf.int64))
    gradient_noise = -variable.numpy() / 0.1  # SGD: θ ← θ − η·z
    assert abs(np.corrcoef(histogram, gradient_noise)[0, 1]) < 6 / math.sqrt(50_000)
    report = optimizer.noise_report()  # what reports read: public values, no key
    assert set(report) == {"noise_multiplier", "clip_bound", "averaged_noise_stddev"}
    assert float(report["averaged_noise_stddev"]) == pytest.approx(1.0 * 1.0 / 1.0)  # σ·C/L


def _raco_noise(histogram_noise, steps, groups=8, classes=10):
    """RaCO-DP's released histogram minus its clean counts, at every eager train step."""
    from tf_dp.models.data import poisson_dataset
    from tf_dp.raco import DemographicParity, RateConstrainedModel

    rng = np.random.default_rng(0)
    n = 400
    x = rng.normal(size=(n, 4)).astype("float32")
    y = rng.integers(0, classes, n).astype("int32")
    z = np.arange(n, dtype="int32") % groups
    keras.utils.set_random_seed(1)
    inputs = keras.Input((4,))
    model = RateConstrainedModel(inputs, keras.layers.Dense(classes, activation="softmax")(inputs))
    model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=0.0, seed=2),
                  loss="sparse_categorical_crossentropy", constraints=[DemographicParity(0.1)],
                  num_groups=groups, histogram_noise=histogram_noise, dual_learning_rate=0.0)
    model._prebuild(x, y)
    seen, counts, values = {}, model.histogram.counts, model.constraint_set.values
    model.histogram.counts = lambda *a, **k: seen.setdefault("clean", counts(*a, **k))
    model.constraint_set.values = lambda h: (seen.setdefault("noisy", h), values(h))[1]
    noises = []
    with reference_steps(model):
        for batch in poisson_dataset(x, y, n, 100, 160, 7, {"groups": z}).take(steps):
            seen.clear()
            model.train_step(batch)
            noises.append((seen["noisy"] - seen["clean"]).numpy().ravel())
    return np.array(noises), model


def test_raco_histogram_noise_has_the_stated_std_and_is_fresh_per_step():
    scale = 0.5
    noises, model = _raco_noise(scale, steps=30)
    assert int(model.privacy_ledger.steps.numpy()) == 30  # every step drew at its own counter
    expected = math.sqrt(2.0) * scale * 1.0  # Laplace(b): std √2·b, ℓ1 sensitivity 1, computed here
    cells = noises.size
    ratio = np.var(noises) / expected**2
    assert abs(ratio - 1.0) < 6 * math.sqrt(5.0 / cells), ratio  # Laplace: μ4 = 6σ⁴
    # fresh per step: no two steps' draws coincide, and consecutive steps are uncorrelated
    assert len({row.tobytes() for row in noises.astype(np.float32)}) == len(noises)
    lagged = np.corrcoef(noises[:-1].ravel(), noises[1:].ravel())[0, 1]
    assert abs(lagged) < 6 / math.sqrt(noises[1:].size), lagged
