"""RaCO-DP fairness benchmark: demographic parity under differential privacy (docs/algorithms.md §5).

Data sets (sensitive attribute; expected Poisson batch L; q = L/N_train):
  Adult (sex; 4096; 0.126), Taiwan credit default (sex; 3072; 0.128),
  COMPAS (race: African-American vs Caucasian; 512; 0.121),
  Parkinson's speech (gender; 64; 0.318 — only 201 training subjects, so the batch is ~64
  and q exceeds the 0.15 used elsewhere).
Models: logistic regression and an MLP with one hidden layer of 32 ReLU units (softmax out).

Methods, all trained by ``tf_dp.raco.RateConstrainedModel`` so that every method releases the
same noisy histogram and spends exactly the same (ε, δ) in the same number of steps:
  unconstrained   DemographicParity(1.0), dual learning rate 0: DP-SGD; λ stays 0.
  penalty (λ)     a FIXED penalty λ·|DP gap| read off the noisy histogram (post-processing):
                  per step λ_j = λ/2 on the constraints with Γ_j(Ĥ) > 0, 0 on the others.
                  (A constant λ on all four two-sided constraints of a 2-group demographic
                  parity cancels — their Γ_j sum to 0 — which is why the library's
                  ``fixed_penalty=λ`` also weights only violated constraints.)
  RaCO-DP (γ)     DemographicParity(γ) with projected dual ascent.

Privacy (examples/raco_adult.py): C = 3, δ = 1e-4, σ = 4, Laplace histogram scale 2 (b = 0.5);
the number of steps is the largest whose joint (Gaussian + Laplace, same Poisson batch) PLD ε
meets the target (``tf_dp.raco.calibrate_steps``), capped at ``--max_epochs`` epochs
(⌊max_epochs·N/L⌋ steps). When capped, the realized ε (``model.get_epsilon()``) is below the
target and is reported. A single step at σ = 4, scale 2 already costs ε ≈ 0.2, so targets
below 1 (ε = 0.1) multiply σ and the histogram scale by ``--small_epsilon_noise_factor`` (8:
σ = 32, scale 16, ≈ 20 steps on the large sets). Non-private ("inf"): σ = 0, histogram scale
1e-6, the capped number of steps. δ = 1e-4 (the paper's) is ≥ 1/N on Adult and credit, which
tf_dp warns about; it is kept for comparability with the paper.

Step sizes: primal DP-SGD 1.0 (0.3 for Parkinson's), softmax temperature 1, dual
η_λ = min(5, --dual_budget / T) with dual_budget = 40 (η_λ = 5 of examples/raco_adult.py
oscillates and collapses over ~160 steps). These were picked on TRAINING splits only (Adult for
η_λ; unconstrained DP runs for the Parkinson's learning rate). Seeds drive the weight init, the
Poisson sampling and the noise; every method sees the same seeds (common random numbers).

Reported: test accuracy and test demographic-parity gap |P(ŷ=1|z=0) − P(ŷ=1|z=1)| of hard
(argmax) predictions, mean ± std over seeds. Also: ms/step of RaCO-DP vs plain tf_dp.DPModel
(same model, same pre-sampled batches, train_step as a tf.function with and without XLA;
median of per-round ratios of alternating timings), measured first in the same run.

    python benchmarks/raco_fairness.py                 # full run: 768 trainings, ~14 min CPU on one core
    python benchmarks/raco_fairness.py --quick         # ~1 min smoke run (24 trainings)
    python benchmarks/raco_fairness.py --timing_only   # step-time comparison only

Outputs (benchmarks/results/raco/): raco_fairness[_quick].json and .md (rewritten after every
(data set, model, ε) group, so an interrupted run keeps its results), pareto_<data>_<model>.png
(test accuracy vs test gap, colour = ε, marker = method, labels = γ/λ), raco_step_time.*.
Data sources and licences: Adult and Taiwan credit (UCI, CC BY 4.0), Parkinson's speech (Sakar
et al. 2019, UCI, CC BY 4.0), COMPAS (ProPublica, github.com/propublica/compas-analysis).
"""

from __future__ import annotations

import math
import os
import sys
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import tf_dp  # noqa: E402
from tf_dp import raco  # noqa: E402
from tf_dp.data import load_adult, load_compas, load_credit_default, load_parkinsons  # noqa: E402
from tf_dp.models.data import poisson_dataset  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/record.py, also when loaded by path
from record import write_json  # noqa: E402  (writes the command, commit, machine and date)

FLAGS = flags.FLAGS
flags.DEFINE_bool("quick", False, "Smoke run (~2 min): logistic, ε ∈ {1, inf}, 1 seed, one γ and one λ.")
flags.DEFINE_list("datasets", ["adult", "credit", "compas", "parkinsons"], "Data sets.")
flags.DEFINE_list("models", ["logistic", "mlp"], "Models.")
flags.DEFINE_list("epsilons", ["0.1", "1", "10", "inf"], "Target ε values; 'inf' = non-private (σ = 0).")
flags.DEFINE_list("gammas", ["0.02", "0.05", "0.1", "0.15"], "RaCO-DP demographic-parity bounds γ.")
flags.DEFINE_list("penalties", ["0.3", "1", "3"], "Fixed-penalty weights λ (penalty λ·|gap|).")
flags.DEFINE_integer("seeds", 3, "Seeds 0..seeds-1.")
flags.DEFINE_integer("max_epochs", 20, "Cap on the number of steps: ⌊max_epochs·N/L⌋.")
flags.DEFINE_float("delta", 1e-4, "δ.")
flags.DEFINE_float("noise_multiplier", 4.0, "σ for targets ε ≥ 1.")
flags.DEFINE_float("histogram_noise", 2.0, "Laplace scale 1/b for targets ε ≥ 1.")
flags.DEFINE_float("small_epsilon_noise_factor", 8.0, "σ and histogram scale are multiplied by this for ε < 1.")
flags.DEFINE_float("nonprivate_histogram_noise", 1e-6, "Histogram scale of the non-private runs (must be > 0).")
flags.DEFINE_float("l2_norm_clip", 3.0, "C.")
flags.DEFINE_float("learning_rate", 1.0, "Primal DP-SGD learning rate.")
flags.DEFINE_float("parkinsons_learning_rate", 0.3, "Primal lr on Parkinson's (chosen on its train split).")
flags.DEFINE_float("dual_budget", 40.0, "η_λ = min(max_dual_learning_rate, dual_budget / steps).")
flags.DEFINE_float("max_dual_learning_rate", 5.0, "Largest η_λ (the value of examples/raco_adult.py).")
flags.DEFINE_float("temperature", 1.0, "Softmax temperature of the histogram.")
flags.DEFINE_list("timing_models", ["logistic", "mlp"], "Models whose RaCO-DP / DP-SGD step time is measured (Adult).")
flags.DEFINE_list("timing_modes", ["graph", "xla"], "graph: train_step as a tf.function (Keras' CPU default); "
                  "xla: the same with jit_compile=True.")
flags.DEFINE_integer("timing_rounds", 9, "Alternating timing rounds.")
flags.DEFINE_integer("timing_steps", 30, "Steps per timing.")
flags.DEFINE_bool("timing_only", False, "Only the step-time comparison (writes raco_step_time.{json,md}).")
flags.DEFINE_integer("threads", 1, "TensorFlow intra/inter-op threads (the target machine gives one core).")
flags.DEFINE_string("output_dir", "benchmarks/results/raco", "Where JSON, Markdown and PNGs go.")

BATCH_SIZES = {"adult": 4096, "credit": 3072, "compas": 512, "parkinsons": 64}
SENSITIVE = {"adult": "sex", "credit": "sex", "compas": "race", "parkinsons": "gender"}
LABELS = {"adult": "Adult", "credit": "Taiwan credit", "compas": "COMPAS", "parkinsons": "Parkinson's"}
METHOD_LABELS = {"unconstrained": "DP-SGD (unconstrained)", "penalty": "fixed penalty λ", "raco": "RaCO-DP γ"}


def load(name: str):
    if name == "adult":
        return load_adult("sex")
    if name == "credit":
        return load_credit_default()
    if name == "compas":
        return load_compas("race")
    if name == "parkinsons":
        return load_parkinsons()
    raise ValueError(f"unknown data set {name!r}")


def epsilon_label(epsilon: float) -> str:
    return "non-private" if math.isinf(epsilon) else f"ε={epsilon:g}"


# ----------------------------------------------------------------------------- privacy plan
def privacy_plan(num_examples: int, batch_size: int, target: float) -> dict:
    """σ, histogram scale and the number of steps for one target ε (module docstring)."""
    cap = max(1, int(FLAGS.max_epochs * num_examples // batch_size))
    if math.isinf(target):
        return {"target_epsilon": None, "noise_multiplier": 0.0, "histogram_noise": FLAGS.nonprivate_histogram_noise,
                "calibrated_steps": None, "steps": cap, "capped": True}
    factor = 1.0 if target >= 1 else FLAGS.small_epsilon_noise_factor
    sigma, scale = FLAGS.noise_multiplier * factor, FLAGS.histogram_noise * factor
    # max_steps = cap + 1 tells "exactly the cap fits" from "more than the cap would fit".
    calibrated = raco.calibrate_steps(target, num_examples, batch_size, sigma, scale, delta=FLAGS.delta,
                                      max_steps=cap + 1)
    return {"target_epsilon": target, "noise_multiplier": sigma, "histogram_noise": scale,
            "calibrated_steps": calibrated if calibrated <= cap else f">{cap}", "steps": min(calibrated, cap),
            "capped": calibrated > cap}


def dual_learning_rate(steps: int) -> float:
    return min(FLAGS.max_dual_learning_rate, FLAGS.dual_budget / steps)


# ----------------------------------------------------------------------------- training
class FixedHingePenalty:
    """Stands in for a compiled model's ``constraint_set``: the Lagrangian weights are
    λ_j = λ/2 · 1[Γ_j(Ĥ) > γ_j] from the noisy histogram (post-processing, no privacy cost),
    so with DemographicParity(0) on 2 groups the primal objective is mean loss + λ·|gap|.
    Everything else (partitions, Γ, bounds) is the wrapped ConstraintSet's."""

    def __init__(self, base, penalty: float):
        self._base, self._penalty = base, float(penalty)

    def __getattr__(self, name):
        return getattr(self._base, name)

    def __len__(self):
        return len(self._base)

    def coefficients(self, histogram, multipliers):
        del multipliers  # fixed: no dual variable
        active = tf.cast(self._base.values(histogram) > self._base.bounds, histogram.dtype)
        return self._base.coefficients(histogram, 0.5 * self._penalty * active)


def build(num_features: int, model_kind: str, cls=raco.RateConstrainedModel):
    inputs = keras.Input((num_features,))
    hidden = inputs if model_kind == "logistic" else keras.layers.Dense(32, activation="relu")(inputs)
    return cls(inputs, keras.layers.Dense(2, activation="softmax")(hidden))


def optimizer(learning_rate: float, sigma: float, seed: int):
    return tf_dp.DPSGD(learning_rate, l2_norm_clip=FLAGS.l2_norm_clip, noise_multiplier=sigma, seed=seed)


def train_one(data, model_kind: str, plan: dict, method: str, value: float, seed: int, learning_rate: float) -> dict:
    keras.utils.set_random_seed(seed)
    model = build(data.x_train.shape[1], model_kind)
    bound = {"unconstrained": 1.0, "penalty": 0.0, "raco": value}[method]
    dual = dual_learning_rate(plan["steps"]) if method == "raco" else 0.0
    model.compile(
        optimizer=optimizer(learning_rate, plan["noise_multiplier"], seed), loss="sparse_categorical_crossentropy",
        delta=FLAGS.delta, accountant="pld", constraints=[raco.DemographicParity(bound)], num_groups=2,
        histogram_noise=plan["histogram_noise"], dual_learning_rate=dual, histogram_temperature=FLAGS.temperature,
    )
    if method == "penalty":
        model.constraint_set = FixedHingePenalty(model.constraint_set, value)
    history = model.fit(data.x_train, data.y_train, groups=data.sensitive_train, batch_size=plan["batch_size"],
                        epochs=1, steps_per_epoch=plan["steps"], sampling_seed=seed, verbose=0)
    predicted = np.asarray(model(data.x_test, training=False)).argmax(axis=1)  # eager: no predict() retracing
    groups = data.sensitive_test
    epsilon = history.history.get("epsilon", [model.get_epsilon()])[-1]  # PrivacyReport: model.get_epsilon()
    return {
        "accuracy": float((predicted == data.y_test).mean()),
        "gap": float(abs(predicted[groups == 0].mean() - predicted[groups == 1].mean())),
        "epsilon": float(epsilon), "max_lambda": float(np.max(model.multipliers.numpy())),
        "steps_taken": int(model.privacy_ledger.steps.numpy()),
    }


def methods() -> list[tuple[str, float | None]]:
    return ([("unconstrained", None)] + [("penalty", float(v)) for v in FLAGS.penalties]
            + [("raco", float(v)) for v in FLAGS.gammas])


def mean_std(values) -> tuple[float, float]:
    values = np.asarray(values, dtype=float)
    return float(values.mean()), float(values.std(ddof=1)) if len(values) > 1 else 0.0


# ----------------------------------------------------------------------------- step time
def measure_step_time(data, model_kind: str, batch_size: int, mode: str) -> dict:
    """ms/step of RaCO-DP (γ = 0.1) vs plain tf_dp.DPModel: same architecture, σ, C, batch.

    mode "graph": each model's ``train_step`` as a tf.function (Keras' default on CPU) on the
    SAME pre-sampled Poisson batches (the Python Poisson sampler is excluded); "xla": the same
    with ``jit_compile=True``. Each round times both models, in alternating order; reported:
    medians, and the median of the per-round ratios.
    """
    n = len(data.y_train)
    models = {}
    for name, cls in (("dpsgd", tf_dp.DPModel), ("raco", raco.RateConstrainedModel)):
        keras.utils.set_random_seed(0)
        model = build(data.x_train.shape[1], model_kind, cls)
        extra = {} if name == "dpsgd" else {
            "constraints": [raco.DemographicParity(0.1)], "num_groups": 2, "histogram_noise": FLAGS.histogram_noise,
            "dual_learning_rate": 1.0}
        model.compile(optimizer=optimizer(FLAGS.learning_rate, FLAGS.noise_multiplier, 0),
                      loss="sparse_categorical_crossentropy", delta=FLAGS.delta, accountant="pld",
                      jit_compile=mode == "xla", **extra)
        groups = {"groups": data.sensitive_train} if name == "raco" else {}
        model.fit(data.x_train, data.y_train, batch_size=batch_size, epochs=1, steps_per_epoch=1, verbose=0,
                  sampling_seed=0, **groups)  # builds model and optimizer
        models[name] = (model, tf.function(model.train_step, jit_compile=mode == "xla"))
    steps = FLAGS.timing_steps
    stream = poisson_dataset(data.x_train, data.y_train, n, batch_size, None, 1,
                             extras={"groups": data.sensitive_train.astype(np.int32)})
    batches = list(stream.take(steps * FLAGS.timing_rounds + 1))
    for _, step in models.values():  # trace (and XLA-compile) outside the timings
        step(batches[0])

    def ms_per_step(name, round_index):
        model, step = models[name]
        offset = 1 + round_index * steps
        start = time.perf_counter()
        for batch in batches[offset:offset + steps]:
            step(batch)
        model.optimizer.iterations.numpy()  # wait for the last step
        return (time.perf_counter() - start) / steps * 1000

    times = {"dpsgd": [], "raco": []}
    for round_index in range(FLAGS.timing_rounds):
        for name in (("dpsgd", "raco") if round_index % 2 == 0 else ("raco", "dpsgd")):
            times[name].append(ms_per_step(name, round_index))
    ratios = [r / d for r, d in zip(times["raco"], times["dpsgd"])]
    return {"dataset": "adult", "model": model_kind, "mode": mode, "batch_size": batch_size,
            "dpsgd_ms": statistics.median(times["dpsgd"]), "raco_ms": statistics.median(times["raco"]),
            "ratio": statistics.median(ratios), "ratios": ratios, "dpsgd_times": times["dpsgd"],
            "raco_times": times["raco"]}


# ----------------------------------------------------------------------------- reporting
def fmt(mean: float, std: float) -> str:
    return f"{mean:.3f}±{std:.3f}"


def settings_table(plans: dict, sizes: dict) -> list[str]:
    lines = ["| data set | N train / test | L | q | lr | target | σ | hist. scale | steps (calibrated) | "
             "realized ε | η_λ (RaCO) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for dataset, by_epsilon in plans.items():
        for key, plan in by_epsilon.items():
            realized = plan.get("realized_epsilon")
            realized = "∞" if realized is None or math.isinf(realized) else f"{realized:.3f}"
            calibrated = "–" if plan["calibrated_steps"] is None else plan["calibrated_steps"]
            lines.append(
                f"| {LABELS[dataset]} | {sizes[dataset][0]} / {sizes[dataset][1]} | {plan['batch_size']} | "
                f"{plan['batch_size'] / sizes[dataset][0]:.3f} | {plan['learning_rate']:g} | {key} | "
                f"{plan['noise_multiplier']:g} | {plan['histogram_noise']:g} | {plan['steps']} ({calibrated}) | "
                f"{realized} | {dual_learning_rate(plan['steps']):.3g} |")
    return lines


def results_table(summary: list[dict], epsilon_keys: list[str]) -> list[str]:
    header = "| data set | model | method | γ / λ | " + " | ".join(f"{k}: acc / gap" for k in epsilon_keys) + " |"
    lines = [header, "|" + "---|" * (4 + len(epsilon_keys))]
    rows: dict = {}
    for s in summary:
        rows.setdefault((s["dataset"], s["model"], s["method"], s["value"]), {})[s["epsilon_key"]] = s
    for (dataset, model_kind, method, value), cells in rows.items():
        parameter = "–" if value is None else f"{value:g}"
        texts = []
        for key in epsilon_keys:
            s = cells.get(key)
            texts.append("–" if s is None else f"{fmt(s['accuracy_mean'], s['accuracy_std'])} / "
                                               f"{fmt(s['gap_mean'], s['gap_std'])}")
        lines.append(f"| {LABELS[dataset]} | {model_kind} | {METHOD_LABELS[method]} | {parameter} | "
                     + " | ".join(texts) + " |")
    return lines


def timing_table(timings: list[dict]) -> list[str]:
    lines = ["| model (Adult) | timing | L | DP-SGD ms/step | RaCO-DP ms/step | RaCO-DP / DP-SGD (median of rounds) |",
             "|---|---|---|---|---|---|"]
    for t in timings:
        lines.append(f"| {t['model']} | {t['mode']} | {t['batch_size']} | {t['dpsgd_ms']:.2f} | {t['raco_ms']:.2f} | "
                     f"{t['ratio']:.2f}x |")
    return lines


def pareto_plot(summary: list[dict], dataset: str, model_kind: str, epsilon_keys: list[str], plans: dict, path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(epsilon_keys, ["tab:red", "tab:orange", "tab:green", "tab:blue", "tab:purple"]))
    markers = {"unconstrained": "*", "penalty": "s", "raco": "o"}
    figure, axes = plt.subplots(figsize=(7.5, 5.5))
    for key in epsilon_keys:
        for method in markers:
            points = sorted((s for s in summary if s["dataset"] == dataset and s["model"] == model_kind
                             and s["epsilon_key"] == key and s["method"] == method),
                            key=lambda s: -1 if s["value"] is None else s["value"])
            if not points:
                continue
            axes.errorbar([p["gap_mean"] for p in points], [p["accuracy_mean"] for p in points],
                          xerr=[p["gap_std"] for p in points], yerr=[p["accuracy_std"] for p in points],
                          color=colors[key], marker=markers[method], markersize=11 if method == "unconstrained" else 6,
                          linestyle="-" if method == "raco" else ("--" if method == "penalty" else "none"),
                          linewidth=1, capsize=2, alpha=0.85)
            for p in points:
                if p["value"] is not None:
                    axes.annotate(f"{p['value']:g}", (p["gap_mean"], p["accuracy_mean"]), fontsize=6,
                                  xytext=(3, 3), textcoords="offset points", color=colors[key])
    from matplotlib.lines import Line2D

    realized = {k: plans[dataset][k].get("realized_epsilon") for k in epsilon_keys}
    def legend_label(key):
        value = realized[key]
        return key if value is None or math.isinf(value) else f"{key} (realized {value:.2f})"

    handles = [Line2D([], [], color=colors[k], marker="o", linestyle="-", label=legend_label(k)) for k in epsilon_keys]
    handles += [Line2D([], [], color="gray", marker=markers[m], linestyle="none", label=METHOD_LABELS[m])
                for m in markers]
    axes.legend(handles=handles, fontsize=8, loc="best")
    axes.set_xlabel("test demographic-parity gap |P(ŷ=1|z=0) − P(ŷ=1|z=1)|")
    axes.set_ylabel("test accuracy")
    axes.set_title(f"{LABELS[dataset]} ({SENSITIVE[dataset]}), {model_kind}: accuracy vs DP gap "
                   f"(mean ± std, {FLAGS.seeds} seeds)", fontsize=10)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# ----------------------------------------------------------------------------- main
def apply_quick():
    FLAGS.models = ["logistic"]
    FLAGS.epsilons = ["1", "inf"]
    FLAGS.gammas = ["0.05"]
    FLAGS.penalties = ["1"]
    FLAGS.seeds = 1
    FLAGS.timing_models = ["logistic"]
    FLAGS.timing_rounds = 3
    FLAGS.timing_steps = 10


def write_outputs(path_stem: str, started: float, cpu_started: float, sizes, plans, summary, runs, timings,
                  epsilon_keys, complete: bool) -> str:
    """Markdown and JSON of everything so far (rewritten after every group: a crash keeps the results)."""
    elapsed, cpu = time.time() - started, time.process_time() - cpu_started
    status = "" if complete else " — PARTIAL (run in progress or interrupted)"
    lines = [f"# RaCO-DP fairness benchmark{' (quick)' if FLAGS.quick else ''}{status}", "",
             f"{time.strftime('%Y-%m-%d')}, {FLAGS.threads} TF thread(s), {elapsed / 60:.1f} min wall, "
             f"{cpu / 60:.1f} min CPU (this process). Demographic parity (2 groups); test accuracy / test DP gap "
             f"of hard predictions, mean±std over {FLAGS.seeds} seed(s). δ = {FLAGS.delta:g}, "
             f"C = {FLAGS.l2_norm_clip:g}, max_epochs = {FLAGS.max_epochs}.", "", FIXED_SEEDS_NOTE, "",
             "## Privacy settings", "", *settings_table(plans, sizes), "",
             "## Accuracy / gap", "", *results_table(summary, epsilon_keys), "",
             "## Step time (RaCO-DP vs plain tf_dp.DPModel)", "", *timing_table(timings), ""]
    markdown = "\n".join(lines)
    with open(path_stem + ".md", "w") as f:
        f.write(markdown)
    json_safe = lambda v: None if isinstance(v, float) and math.isinf(v) else v  # noqa: E731
    payload = {
        "date": time.strftime("%Y-%m-%d"), "complete": complete, "elapsed_seconds": elapsed, "cpu_seconds": cpu,
        "threads": FLAGS.threads,
        "flags": {f: json_safe(getattr(FLAGS, f)) for f in (
            "quick", "datasets", "models", "epsilons", "gammas", "penalties", "seeds", "max_epochs", "delta",
            "noise_multiplier", "histogram_noise", "small_epsilon_noise_factor", "nonprivate_histogram_noise",
            "l2_norm_clip", "learning_rate", "parkinsons_learning_rate", "dual_budget", "max_dual_learning_rate",
            "temperature", "timing_models", "timing_modes", "timing_rounds", "timing_steps")},
        "batch_sizes": BATCH_SIZES, "sensitive_attributes": SENSITIVE, "sizes": sizes,
        "plans": {d: {k: {f: json_safe(v) for f, v in p.items()} for k, p in by.items()} for d, by in plans.items()},
        "summary": [{k: json_safe(v) for k, v in s.items()} for s in summary],
        "runs": [{k: json_safe(v) for k, v in r.items()} for r in runs], "step_time": timings,
    }
    write_json(path_stem + ".json", payload)
    return markdown


# Seeds are public and fixed (seed s sets the initial weights, the noise key and the Poisson batches), for
# reproducible paired comparisons: said in the output, since such runs' ε is no guarantee for their weights.
FIXED_SEEDS_NOTE = ("note: fixed public seeds (seed s fixes the initial weights, the noise key and the "
                    "Poisson batches) "
                    "for reproducible paired comparisons: the accuracies are of fixed-seed runs, whose epsilon is "
                    "that of the procedure, not a privacy guarantee for these weights (anyone can regenerate the "
                    "noise). Private training: leave the seeds None (examples/_seeds.py).")


def main(argv):
    del argv
    print(FIXED_SEEDS_NOTE, flush=True)
    if FLAGS.quick:
        apply_quick()
    if FLAGS.timing_only:
        FLAGS.datasets = ["adult"]
    tf.config.threading.set_intra_op_parallelism_threads(FLAGS.threads)
    tf.config.threading.set_inter_op_parallelism_threads(FLAGS.threads)
    started, cpu_started = time.time(), time.process_time()
    epsilons = [float(e) for e in FLAGS.epsilons]
    epsilon_keys = [epsilon_label(e) for e in epsilons]
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    suffix = "_quick" if FLAGS.quick else ""
    stem = os.path.join(FLAGS.output_dir, f"raco_fairness{suffix}")

    datasets = {name: load(name) for name in FLAGS.datasets}
    sizes = {name: (len(d.y_train), len(d.y_test)) for name, d in datasets.items()}
    print(f"loaded {', '.join(f'{n} {s[0]}/{s[1]}' for n, s in sizes.items())} in {time.time() - started:.0f}s",
          flush=True)

    adult = datasets["adult"] if "adult" in datasets else load("adult")
    timings = [measure_step_time(adult, model_kind, BATCH_SIZES["adult"], mode)
               for model_kind in FLAGS.timing_models for mode in FLAGS.timing_modes]
    keras.backend.clear_session()
    print("\n".join(timing_table(timings)), flush=True)
    if FLAGS.timing_only:
        lines = ["# RaCO-DP step time vs plain tf_dp.DPModel (Adult)", "",
                 f"{time.strftime('%Y-%m-%d')}, {FLAGS.threads} TF thread(s), {FLAGS.timing_rounds} alternating rounds "
                 f"of {FLAGS.timing_steps} steps; median per-round ratio.", "", *timing_table(timings), ""]
        with open(os.path.join(FLAGS.output_dir, "raco_step_time.md"), "w") as f:
            f.write("\n".join(lines))
        write_json(os.path.join(FLAGS.output_dir, "raco_step_time.json"),
                   {"date": time.strftime("%Y-%m-%d"), "threads": FLAGS.threads, "rounds": FLAGS.timing_rounds,
                    "steps": FLAGS.timing_steps, "step_time": timings})
        return

    plans: dict = {}
    for name, data in datasets.items():
        batch_size = min(BATCH_SIZES[name], len(data.y_train))
        learning_rate = FLAGS.parkinsons_learning_rate if name == "parkinsons" else FLAGS.learning_rate
        plans[name] = {}
        for epsilon, key in zip(epsilons, epsilon_keys):
            plan = privacy_plan(len(data.y_train), batch_size, epsilon)
            plan.update(batch_size=batch_size, learning_rate=learning_rate)
            plans[name][key] = plan

    runs, summary = [], []
    for name, data in datasets.items():
        for model_kind in FLAGS.models:
            for key in epsilon_keys:
                plan = plans[name][key]
                group_start = time.time()
                for method, value in methods():
                    results = [train_one(data, model_kind, plan, method, value, seed, plan["learning_rate"])
                               for seed in range(FLAGS.seeds)]
                    for seed, result in enumerate(results):
                        runs.append({"dataset": name, "model": model_kind, "epsilon_key": key, "method": method,
                                     "value": value, "seed": seed, **result})
                    plan["realized_epsilon"] = results[0]["epsilon"]
                    accuracy, gap = mean_std([r["accuracy"] for r in results]), mean_std([r["gap"] for r in results])
                    summary.append({
                        "dataset": name, "model": model_kind, "epsilon_key": key, "method": method, "value": value,
                        "accuracy_mean": accuracy[0], "accuracy_std": accuracy[1], "gap_mean": gap[0],
                        "gap_std": gap[1], "realized_epsilon": results[0]["epsilon"], "steps": plan["steps"],
                        "max_lambda_mean": float(np.mean([r["max_lambda"] for r in results])),
                    })
                    assert all(r["steps_taken"] == plan["steps"] for r in results)
                keras.backend.clear_session()
                done = [s for s in summary if s["dataset"] == name and s["model"] == model_kind
                        and s["epsilon_key"] == key]
                best = ", ".join(f"{s['method']}{'' if s['value'] is None else s['value']:}: "
                                 f"{s['accuracy_mean']:.3f}/{s['gap_mean']:.3f}" for s in done)
                print(f"[{time.time() - started:5.0f}s] {name} {model_kind} {key} steps={plan['steps']} "
                      f"ε={plan['realized_epsilon']:.3f} ({time.time() - group_start:.0f}s): {best}", flush=True)
                write_outputs(stem, started, cpu_started, sizes, plans, summary, runs, timings, epsilon_keys, False)
            pareto_plot(summary, name, model_kind, epsilon_keys, plans,
                        os.path.join(FLAGS.output_dir, f"pareto_{name}_{model_kind}{suffix}.png"))

    markdown = write_outputs(stem, started, cpu_started, sizes, plans, summary, runs, timings, epsilon_keys, True)
    print("\n" + markdown)
    print(f"wrote {stem}.{{json,md}} and pareto_*{suffix}.png in {(time.time() - started) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    app.run(main)
