"""tf_dp.plots: PNGs are written, the Figures hold the expected lines and points, ε grows with steps."""

import sys

import keras
import numpy as np
import pytest

import tf_dp
from tf_dp import plots
from tf_dp.accounting import compute_epsilon

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def pyplot():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    yield plt
    plt.close("all")


def assert_png(path):
    assert path.exists() and path.stat().st_size > 1000
    assert path.read_bytes()[:8] == PNG_MAGIC


def strictly_increasing(values) -> bool:
    return bool(np.all(np.diff(np.asarray(values, dtype=float)) > 0))


def trained_model(fits=((1.0, 2),)) -> tf_dp.DPModel:
    """A tiny DP model trained on random data; one ledger phase per (σ, epochs) in ``fits``."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=fits[0][0], seed=0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), delta=1e-3)
    x = np.random.default_rng(0).normal(size=(200, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    for sigma, epochs in fits:
        model.optimizer.noise_multiplier = sigma
        model.fit(x, y, batch_size=50, epochs=epochs, verbose=0, sampling_seed=0)
    return model


# ------------------------------------------------------------------------- ε vs steps
def test_epsilon_vs_steps_planned_one_increasing_line_per_sigma(pyplot, tmp_path):
    path = tmp_path / "out" / "epsilon.png"
    figure = plots.plot_epsilon_vs_steps(num_examples=60_000, batch_size=256, noise_multiplier=[0.8, 1.1],
                                         steps=2_000, num_points=8, path=str(path))
    assert_png(path)
    (ax,) = figure.axes
    assert len(ax.lines) == 2
    (steps_08, eps_08), (steps_11, eps_11) = (line.get_data() for line in ax.lines)
    assert list(steps_08) == list(steps_11) and len(steps_08) == 8
    assert steps_08[0] == 1 and steps_08[-1] == 2_000
    assert strictly_increasing(steps_08) and strictly_increasing(eps_08) and strictly_increasing(eps_11)
    assert np.all(eps_08 > eps_11)  # less noise, more privacy loss
    assert eps_11[-1] == pytest.approx(compute_epsilon(60_000, 256, 1.1, steps=2_000))
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["σ = 0.8", "σ = 1.1"]


def test_epsilon_vs_steps_from_ledger_composes_phases(pyplot, tmp_path):
    model = trained_model(fits=((1.0, 2), (2.0, 2)))  # 8 steps at σ = 1, then 8 at σ = 2
    assert len(model.privacy_ledger.phases()) == 2
    path = tmp_path / "ledger.png"
    figure = plots.plot_epsilon_vs_steps(model, num_points=16, path=str(path))
    assert_png(path)
    (line,) = figure.axes[0].lines
    steps, epsilons = line.get_data()
    assert list(steps) == list(range(1, 17))
    assert strictly_increasing(epsilons)
    assert epsilons[-1] == pytest.approx(model.get_epsilon())  # the model's δ = 1e-3 is the default
    # the first phase alone is plain DP-SGD accounting
    assert epsilons[7] == pytest.approx(compute_epsilon(200, 50, 1.0, steps=8, delta=1e-3))
    # σ = 2 spends less per step than σ = 1
    assert epsilons[15] - epsilons[7] < epsilons[7] - epsilons[0]
    # a bare ledger gives the same curve (at an explicit δ)
    bare = plots.plot_epsilon_vs_steps(model.privacy_ledger, delta=1e-3, num_points=16)
    assert np.allclose(bare.axes[0].lines[0].get_ydata(), epsilons)


def test_epsilon_vs_steps_refuses_bad_input(pyplot):
    inputs = keras.Input((4,))
    untrained = tf_dp.DPModel(inputs, keras.layers.Dense(2)(inputs))
    with pytest.raises(ValueError, match="no DP step"):
        plots.plot_epsilon_vs_steps(untrained)
    with pytest.raises(ValueError, match="not both"):
        plots.plot_epsilon_vs_steps(untrained, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="num_examples"):
        plots.plot_epsilon_vs_steps(noise_multiplier=1.0, steps=10)
    with pytest.raises(TypeError, match="PrivacyLedger"):
        plots.plot_epsilon_vs_steps(object())


def test_step_grid_is_distinct_increasing_and_ends_at_total():
    assert list(plots.step_grid(5, 25)) == [1, 2, 3, 4, 5]
    grid = plots.step_grid(14_100, 25)
    assert len(grid) == 25 and grid[0] == 1 and grid[-1] == 14_100 and strictly_increasing(grid)


# ------------------------------------------------------------------------- accuracy vs ε
RESULTS = [
    {"name": "FIBER", "epsilon": 8, "accuracy": 0.95, "std": 0.004},
    {"name": "FIBER", "epsilon": 1, "accuracy": 0.90, "std": 0.010},
    {"name": "FIBER", "epsilon": 4, "accuracy": 0.94, "std": 0.006},
    {"name": "DP-AdamW", "epsilon": 1, "accuracy": 0.85},
    {"name": "DP-AdamW", "epsilon": 4, "accuracy": 0.91},
    {"name": "DP-AdamW", "epsilon": 8, "accuracy": 0.93},
    {"name": "DP-AdamW", "epsilon": float("inf"), "accuracy": 0.98},
]


def test_accuracy_vs_epsilon_one_line_per_method_sorted_by_epsilon(pyplot, tmp_path):
    path = tmp_path / "accuracy.png"
    figure = plots.plot_accuracy_vs_epsilon(RESULTS, title="MNIST", path=str(path))
    assert_png(path)
    ax = figure.axes[0]
    assert [line.get_label() for line in ax.lines] == ["FIBER", "DP-AdamW", "DP-AdamW (non-private)"]
    fiber, adamw, baseline = ax.lines
    assert list(fiber.get_xdata()) == [1, 4, 8] and list(fiber.get_ydata()) == [0.90, 0.94, 0.95]
    assert list(adamw.get_xdata()) == [1, 4, 8] and list(adamw.get_ydata()) == [0.85, 0.91, 0.93]
    assert list(baseline.get_ydata()) == [0.98, 0.98]  # horizontal line at the non-private accuracy
    assert len(ax.collections) == 1  # the ±std band of FIBER only
    assert ax.get_xscale() == "log" and ax.get_title() == "MNIST"


def test_accuracy_vs_epsilon_into_given_axes_and_refuses_incomplete_results(pyplot):
    figure, ax = pyplot.subplots()
    assert plots.plot_accuracy_vs_epsilon(RESULTS[:3], ax=ax, log_x=False) is figure
    assert len(ax.lines) == 1 and ax.get_xscale() == "linear"
    with pytest.raises(ValueError, match="lacks"):
        plots.plot_accuracy_vs_epsilon([{"name": "x", "accuracy": 0.5}])
    with pytest.raises(ValueError, match="empty"):
        plots.plot_accuracy_vs_epsilon([])


# ------------------------------------------------------------------------- Pareto
PARETO = [
    {"name": "DP-SGD", "accuracy": 0.837, "disparity": 0.200},
    {"name": "penalty", "accuracy": 0.823, "disparity": 0.046, "label": "λ=1"},
    {"name": "penalty", "accuracy": 0.800, "disparity": 0.060, "label": "λ=3"},  # dominated
    {"name": "RaCO-DP", "accuracy": 0.820, "disparity": 0.004, "label": "γ=0.05", "accuracy_std": 0.002},
    {"name": "RaCO-DP", "accuracy": 0.830, "disparity": 0.080, "label": "γ=0.1", "accuracy_std": 0.003},
]


def test_pareto_front_keeps_non_dominated_points_by_disparity():
    front = plots.pareto_front(PARETO)
    assert [(r["name"], r["disparity"]) for r in front] == [
        ("RaCO-DP", 0.004), ("penalty", 0.046), ("RaCO-DP", 0.080), ("DP-SGD", 0.200)]
    tie = [{"accuracy": 0.8, "disparity": 0.1}, {"accuracy": 0.9, "disparity": 0.1}]
    assert plots.pareto_front(tie) == [tie[1]]


def test_pareto_plot_one_marker_series_per_method_plus_front(pyplot, tmp_path):
    path = tmp_path / "pareto.png"
    figure = plots.plot_pareto(PARETO, path=str(path))
    assert_png(path)
    ax = figure.axes[0]
    assert [line.get_label() for line in ax.lines] == ["DP-SGD", "penalty", "RaCO-DP", "Pareto front"]
    *methods, front = ax.lines
    assert [len(line.get_xdata()) for line in methods] == [1, 2, 2]
    assert all(line.get_linestyle() == "None" for line in methods)  # markers only
    assert list(methods[1].get_xdata()) == [0.046, 0.060]  # sorted by disparity
    assert list(front.get_xdata()) == [0.004, 0.046, 0.080, 0.200]
    assert sorted(t.get_text() for t in ax.texts) == ["γ=0.05", "γ=0.1", "λ=1", "λ=3"]
    assert len(plots.plot_pareto(PARETO, frontier=False).axes[0].lines) == 3


# ------------------------------------------------------------------------- no matplotlib
def test_missing_matplotlib_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib → ImportError
    with pytest.raises(ImportError, match=r'pip install "tf-dp\[plots\]"'):
        plots.plot_accuracy_vs_epsilon(RESULTS)
