"""Plots of DP training: ε vs steps, accuracy vs ε, and accuracy–disparity Pareto fronts.

matplotlib is optional (``pip install "tf-dp[plots]"``) and imported only when a plot is
drawn. Without a display (Linux with neither ``DISPLAY`` nor ``WAYLAND_DISPLAY``, and no
``MPLBACKEND`` chosen), the Agg backend is selected before pyplot is first imported.

Every function returns the matplotlib ``Figure``, draws into ``ax`` if given (else a new
figure), and writes a PNG to ``path`` if given::

    from tf_dp import plots
    plots.plot_epsilon_vs_steps(model, path="epsilon.png")                 # from the ledger
    plots.plot_epsilon_vs_steps(num_examples=60_000, batch_size=256, noise_multiplier=[0.8, 1.1], steps=14_100)
    plots.plot_accuracy_vs_epsilon([{"name": "FIBER", "epsilon": 1, "accuracy": 0.91, "std": 0.01}, ...])
    plots.plot_pareto([{"name": "RaCO-DP", "accuracy": 0.82, "disparity": 0.01}, ...])
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional, Union

import numpy as np

from tf_dp.accounting import PrivacyLedger, compute_epsilon
from tf_dp.accounting.ledger import Phase, epsilon_of_phases

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

INSTALL_HINT = 'pip install "tf-dp[plots]"'
DEFAULT_DELTA = 1e-5
FIGSIZE = (5.5, 4.0)
DPI = 120

__all__ = ["pareto_front", "plot_accuracy_vs_epsilon", "plot_epsilon_vs_steps", "plot_pareto"]


# --------------------------------------------------------------------------- matplotlib
def _has_display() -> bool:
    if not sys.platform.startswith("linux"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def _pyplot():
    """matplotlib.pyplot, imported lazily; Agg when there is no display."""
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError(f"tf_dp.plots needs matplotlib, which is not installed: {INSTALL_HINT}") from error
    if "matplotlib.pyplot" not in sys.modules and not os.environ.get("MPLBACKEND") and not _has_display():
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _figure_and_axes(ax: Optional["Axes"]) -> tuple["Figure", "Axes", bool]:
    """(figure, axes, created): ``ax`` and its figure, or a new figure."""
    if ax is not None:
        return ax.figure, ax, False
    figure, ax = _pyplot().subplots(figsize=FIGSIZE)
    return figure, ax, True


def _finish(figure: "Figure", ax: "Axes", created: bool, title: Optional[str], path: Optional[str]) -> "Figure":
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[1]:
        ax.legend(fontsize=8, loc="best")
    if created:
        figure.tight_layout()
    if path:
        folder = os.path.dirname(os.fspath(path))
        if folder:
            os.makedirs(folder, exist_ok=True)
        figure.savefig(path, dpi=DPI)
    return figure


# --------------------------------------------------------------------------- ε vs steps
def step_grid(total_steps: int, num_points: int = 25) -> np.ndarray:
    """Up to ``num_points`` distinct, increasing step counts from 1 to ``total_steps``."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if num_points < 2:
        raise ValueError(f"num_points must be >= 2, got {num_points}")
    return np.unique(np.round(np.linspace(1, total_steps, num_points)).astype(np.int64))


def phases_until(phases: Sequence[Phase], step: int) -> list[Phase]:
    """The ledger's phases truncated after its first ``step`` DP steps."""
    kept, remaining = [], step
    for phase in phases:
        taken = min(phase.steps, remaining)
        if taken > 0:
            kept.append(dataclasses.replace(phase, steps=taken))
        remaining -= taken
    return kept


def _ledger_and_settings(source: Any) -> tuple[PrivacyLedger, dict]:
    """The ledger of a DP model (or a ledger itself) and the model's compile settings."""
    ledger = getattr(source, "privacy_ledger", source)
    if not isinstance(ledger, PrivacyLedger):
        raise TypeError(f"`source` must be a tf_dp DP model or a PrivacyLedger, got {type(source).__name__}.")
    settings = getattr(source, "privacy_settings", None) or {}
    return ledger, settings


def _ledger_curve(source: Any, delta: Optional[float], accountant: Optional[str],
                  num_points: int) -> tuple[np.ndarray, np.ndarray, float, str]:
    ledger, settings = _ledger_and_settings(source)
    delta = settings.get("delta", DEFAULT_DELTA) if delta is None else delta
    accountant = accountant or settings.get("accountant", "rdp")
    phases = ledger.phases()
    total = sum(phase.steps for phase in phases)
    if total == 0:
        raise ValueError("The privacy ledger has no DP step yet: train first, or pass num_examples, "
                         "batch_size, noise_multiplier and steps.")
    steps = step_grid(total, num_points)
    epsilons = np.array([epsilon_of_phases(phases_until(phases, int(t)), delta, accountant) for t in steps])
    return steps, epsilons, delta, accountant


def plot_epsilon_vs_steps(
    source: Any = None,
    *,
    num_examples: Optional[int] = None,
    batch_size: Optional[int] = None,
    noise_multiplier: Union[float, Sequence[float], None] = None,
    steps: Optional[int] = None,
    delta: Optional[float] = None,
    accountant: Optional[str] = None,
    num_points: int = 25,
    label: Optional[str] = None,
    title: Optional[str] = None,
    ax: Optional["Axes"] = None,
    path: Optional[str] = None,
) -> "Figure":
    """ε after each number of DP steps, on a grid of ``num_points`` steps.

    Either from ``source`` — a DP model (``model.privacy_ledger``; δ and accountant default
    to its compile settings) or a ``PrivacyLedger``: ε of the steps actually taken, all
    phases composed — or, without ``source``, for Poisson-sampled DP-SGD planned with
    ``num_examples`` N, ``batch_size`` L, ``noise_multiplier`` σ (one line per σ if a
    sequence) and ``steps`` T, by ``tf_dp.accounting.compute_epsilon``.

    Returns the Figure (one line per curve); writes a PNG to ``path`` if given.
    """
    figure, ax, created = _figure_and_axes(ax)
    if source is not None:
        if any(value is not None for value in (num_examples, batch_size, noise_multiplier, steps)):
            raise ValueError("Pass either `source` or (num_examples, batch_size, noise_multiplier, steps), not both.")
        grid, epsilons, delta, accountant = _ledger_curve(source, delta, accountant, num_points)
        ax.plot(grid, epsilons, marker=".", label=label or "privacy ledger")
    else:
        delta, accountant = DEFAULT_DELTA if delta is None else delta, accountant or "rdp"
        for sigma, curve_label in _planned_curves(noise_multiplier, label):
            grid, epsilons = _planned_curve(num_examples, batch_size, sigma, steps, delta, accountant, num_points)
            ax.plot(grid, epsilons, marker=".", label=curve_label)
    ax.set_xlabel("DP steps")
    ax.set_ylabel(f"ε (δ = {delta:g}, {accountant.upper()})")
    ax.set_ylim(bottom=0)
    return _finish(figure, ax, created, title, path)


def _planned_curves(noise_multiplier, label: Optional[str]) -> list[tuple[float, str]]:
    if noise_multiplier is None:
        raise ValueError("Pass a DP model or ledger as `source`, or num_examples, batch_size, noise_multiplier "
                         "and steps.")
    sigmas = [float(noise_multiplier)] if np.isscalar(noise_multiplier) else [float(s) for s in noise_multiplier]
    if not sigmas:
        raise ValueError("`noise_multiplier` is an empty sequence.")
    if label is not None and len(sigmas) == 1:
        return [(sigmas[0], label)]
    return [(sigma, f"σ = {sigma:g}") for sigma in sigmas]


def _planned_curve(num_examples, batch_size, sigma, steps, delta, accountant, num_points):
    if num_examples is None or batch_size is None or steps is None:
        raise ValueError("Without `source`, num_examples, batch_size, noise_multiplier and steps are all needed.")
    grid = step_grid(int(steps), num_points)
    epsilons = np.array([compute_epsilon(num_examples, batch_size, sigma, steps=int(t), delta=delta,
                                         accountant=accountant) for t in grid])
    return grid, epsilons


# --------------------------------------------------------------------------- results
def _require(results: Iterable[Mapping], keys: Sequence[str], what: str) -> list[Mapping]:
    results = list(results)
    if not results:
        raise ValueError(f"{what}: `results` is empty.")
    for index, result in enumerate(results):
        missing = [key for key in keys if key not in result]
        if missing:
            raise ValueError(f"{what}: results[{index}] lacks {missing}; each result needs {list(keys)}.")
    return results


def _by_name(results: Sequence[Mapping]) -> dict[str, list[Mapping]]:
    """Results grouped by ``name``, in order of first appearance."""
    groups: dict[str, list[Mapping]] = {}
    for result in results:
        groups.setdefault(str(result["name"]), []).append(result)
    return groups


def _is_private(result: Mapping) -> bool:
    epsilon = result["epsilon"]
    return epsilon is not None and math.isfinite(float(epsilon))


def plot_accuracy_vs_epsilon(
    results: Iterable[Mapping],
    *,
    log_x: bool = True,
    ylabel: str = "test accuracy",
    title: Optional[str] = None,
    ax: Optional["Axes"] = None,
    path: Optional[str] = None,
) -> "Figure":
    """Accuracy against ε, one line per method.

    ``results``: dicts ``{"name", "epsilon", "accuracy"}`` with optional ``"std"`` (drawn
    as a ±std band). Points of a method are joined in order of ε. A result with
    ``epsilon`` None or infinite (non-private) is drawn as a dashed horizontal line
    "<name> (non-private)" instead.

    Returns the Figure: ``ax.lines`` holds one line per method with private results plus
    one per non-private baseline; writes a PNG to ``path`` if given.
    """
    results = _require(results, ("name", "epsilon", "accuracy"), "plot_accuracy_vs_epsilon")
    figure, ax, created = _figure_and_axes(ax)
    for name, group in _by_name(results).items():
        private = sorted((r for r in group if _is_private(r)), key=lambda r: float(r["epsilon"]))
        color = _accuracy_line(ax, name, private) if private else None
        for baseline in (r for r in group if not _is_private(r)):
            ax.axhline(float(baseline["accuracy"]), linestyle="--", linewidth=1, color=color,
                       label=f"{name} (non-private)")
    if log_x and any(_is_private(r) and float(r["epsilon"]) > 0 for r in results):
        _log_axis_at(ax, sorted({float(r["epsilon"]) for r in results if _is_private(r) and float(r["epsilon"]) > 0}))
    ax.set_xlabel("ε")
    ax.set_ylabel(ylabel)
    return _finish(figure, ax, created, title, path)


def _accuracy_line(ax: "Axes", name: str, points: Sequence[Mapping]) -> str:
    """Draws one method's line (and ±std band); returns its colour."""
    epsilons = np.array([float(r["epsilon"]) for r in points])
    accuracies = np.array([float(r["accuracy"]) for r in points])
    (line,) = ax.plot(epsilons, accuracies, marker="o", label=name)
    if any(r.get("std") is not None for r in points):
        std = np.array([float(r.get("std") or 0.0) for r in points])
        ax.fill_between(epsilons, accuracies - std, accuracies + std, color=line.get_color(), alpha=0.2, linewidth=0)
    return line.get_color()


def _log_axis_at(ax: "Axes", ticks: Sequence[float]) -> None:
    """Log-scaled x axis labelled with plain numbers at ``ticks`` (the ε values)."""
    from matplotlib.ticker import FixedLocator, NullLocator, StrMethodFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator(list(ticks)))
    ax.xaxis.set_major_formatter(StrMethodFormatter("{x:g}"))
    ax.xaxis.set_minor_locator(NullLocator())


def pareto_front(results: Iterable[Mapping]) -> list[Mapping]:
    """The results no other result dominates (accuracy ≥ and disparity ≤, one strictly),
    sorted by disparity."""
    ranked = sorted(results, key=lambda r: (float(r["disparity"]), -float(r["accuracy"])))
    front, best = [], -math.inf
    for result in ranked:
        if float(result["accuracy"]) > best:
            front.append(result)
            best = float(result["accuracy"])
    return front


def plot_pareto(
    results: Iterable[Mapping],
    *,
    frontier: bool = True,
    xlabel: str = "disparity (e.g. demographic-parity gap)",
    ylabel: str = "test accuracy",
    title: Optional[str] = None,
    ax: Optional["Axes"] = None,
    path: Optional[str] = None,
) -> "Figure":
    """Accuracy (y) against disparity (x), one marker series per method, plus the Pareto
    front over all results as a dashed step line.

    ``results``: dicts ``{"name", "accuracy", "disparity"}``, optionally
    ``"accuracy_std"``/``"disparity_std"`` (error bars) and ``"label"`` (a note written next
    to the point, e.g. the constraint γ).

    Returns the Figure: ``ax.lines`` holds one marker-only line per method (its points in
    order of disparity), then the front if ``frontier``; writes a PNG to ``path`` if given.
    """
    results = _require(results, ("name", "accuracy", "disparity"), "plot_pareto")
    figure, ax, created = _figure_and_axes(ax)
    for name, group in _by_name(results).items():
        _pareto_series(ax, name, sorted(group, key=lambda r: float(r["disparity"])))
    if frontier:
        front = pareto_front(results)
        ax.plot([float(r["disparity"]) for r in front], [float(r["accuracy"]) for r in front], linestyle="--",
                drawstyle="steps-post", color="black", alpha=0.5, linewidth=1, label="Pareto front")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return _finish(figure, ax, created, title, path)


def _pareto_series(ax: "Axes", name: str, points: Sequence[Mapping]) -> None:
    x = np.array([float(r["disparity"]) for r in points])
    y = np.array([float(r["accuracy"]) for r in points])
    (line,) = ax.plot(x, y, marker="o", linestyle="none", label=name)
    xerr, yerr = _optional_column(points, "disparity_std"), _optional_column(points, "accuracy_std")
    if xerr is not None or yerr is not None:
        ax.errorbar(x, y, xerr=xerr, yerr=yerr, fmt="none", ecolor=line.get_color(), alpha=0.6, capsize=0)
    for result, xi, yi in zip(points, x, y):
        if result.get("label") is not None:
            ax.annotate(str(result["label"]), (xi, yi), xytext=(3, 3), textcoords="offset points", fontsize=7,
                        color=line.get_color())


def _optional_column(points: Sequence[Mapping], key: str) -> Optional[np.ndarray]:
    if not any(r.get(key) is not None for r in points):
        return None
    return np.array([float(r.get(key) or 0.0) for r in points])
