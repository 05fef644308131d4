"""A fair study of DP-SGD, DP-AdamW, DP-AdamBC, DiSK, FIBER and BandMF (MF-DP-FTRL).

Protocol (identical for every optimizer; docs/fiber_study.md has the results):
  * Same step budget T for every optimizer and ε; Poisson batches of expected size L;
    σ calibrated (RDP, δ = 1e-5) by ``tf_dp.accounting.calibrate_noise_multiplier`` so
    that the T steps on the training rows meet ε. The MF-DP-FTRL baseline the FIBER paper
    names, ``bandmf_sgd`` / ``bandmf_adamw`` (momentum SGD / AdamW with
    ``noise=tf_dp.noise.BandMF(--bands)``, docs/algorithms.md §10), samples by cyclic Poisson
    over b groups and its σ is calibrated to the amplified BandMF event
    (``calibrate_bandmf_noise_multiplier``): same T, L and ε.
  * Equal tuning budget: ``--configs`` configurations per optimizer AT EACH ε, a Latin
    hypercube (seed 0) over the optimizer's search space (SPACES), each trained on the
    training rows minus a validation split carved from them and scored on that split.
    Tuning on private data costs privacy that is not accounted here, as in the papers.
  * The validation argmax is then trained on all training rows with ``--seeds`` seeds and
    scored on the test set (mean ± std). Seed s fixes the initial weights, the noise key and
    the Poisson batches (public seeds, for paired comparisons; the output says so).
  * Ablations (``--stage=ablation``, FIBER's tuned config at one ε, one component changed,
    no re-tuning): innovation filter vs EMA (gain ω), A_t·σ_w² vs stationary A(ω)·σ_w² vs
    full σ_w² vs no correction, ω tied to κ (DiSK's single gain) vs decoupled.
  * Diagnostic (``--stage=diagnostic``): on real FIBER training, Adam's second moment v̂ of
    g̃ per coordinate against A_t·σ_w², next to the same filter + second moment run on pure
    noise of variance σ_w² alongside (what v̂ would be with no signal at all).
  * Defaults (``--stage=defaults``): DP-AdamBC, FIBER, DiSK and DP-AdamW untuned (DEFAULT_TRIES:
    old / new variance floor, or two learning rates), on the validation split.
  * Borrowed (``--stage=borrowed``): the BandMF optimizers at their partner's tuned config
    (bandmf_sgd at DP-SGD's, bandmf_adamw at DP-AdamW's validation argmax, same seeds), labelled
    ``bandmf_sgd@dpsgd`` / ``bandmf_adamw@dpadamw``: a paired comparison of the noise alone
    when the full tuning sweep of the BandMF optimizers is too costly (it favours the partner).
    ``bandmf_fiber`` (FIBER with ``noise=BandMF(--bands)``, its noise-bias correction following
    the correlated noise, docs/algorithms.md §10.6; not in the default --optimizers) runs there
    at FIBER's tuned config: ``--stage=borrowed --optimizers=bandmf_fiber``.
  * Curves (``--stage=curves``): DP-SGD at its tuned config run for T/2, T, 2T and 4T steps, σ
    calibrated for each length (is T long enough for DP-SGD to plateau?).

Every run appends one JSON line to ``--output`` as it finishes, so a partial sweep still
yields tables (``--stage=report`` prints them) and a rerun resumes where it stopped.

    python benchmarks/fiber_study.py --task=mnist                      # main sweep
    python benchmarks/fiber_study.py --task=mnist --stage=ablation --epsilons=0.5
    python benchmarks/fiber_study.py --task=mnist --stage=report
    python benchmarks/fiber_study.py --quick --stage=all               # smoke run
    python benchmarks/fiber_study.py --task=mnist --stage=borrowed --optimizers=bandmf_sgd,bandmf_adamw --epsilons=2
"""

from __future__ import annotations

import json
import math
import os
import sys
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import tf_dp  # noqa: E402
from tf_dp import data as tf_dp_data  # noqa: E402
from tf_dp.accounting import calibrate_noise_multiplier  # noqa: E402
from tf_dp.accounting.bandmf import calibrate_bandmf_noise_multiplier  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/record.py, also when loaded by path
from record import append_jsonl  # noqa: E402  (writes the command, commit, machine and date)

FLAGS = flags.FLAGS
flags.DEFINE_string("task", "mnist", "mnist | fashion_mnist | tweets | transfer (Fashion-MNIST pre-training, "
                    "private MNIST fine-tuning).")
flags.DEFINE_enum("stage", "main", ["main", "ablation", "diagnostic", "curves", "defaults", "borrowed", "all",
                                    "report"],
                  "What to run ('all': main, diagnostic, ablation in turn).")
flags.DEFINE_list("epsilons", ["0.5", "8", "2", "1", "4"], "Target ε values, in the order they are run.")
flags.DEFINE_list("optimizers", ["dpsgd", "dpadamw", "dpadambc", "disk", "fiber", "bandmf_sgd", "bandmf_adamw"],
                  "Optimizers.")
flags.DEFINE_integer("bands", 4, "b of the BandMF optimizers (bandmf_sgd, bandmf_adamw, bandmf_fiber).")
flags.DEFINE_integer("configs", 12, "Tuning configurations per optimizer and ε.")
flags.DEFINE_integer("seeds", 3, "Seeds of the final runs.")
flags.DEFINE_integer("steps", 200, "Step budget T (every optimizer, every ε).")
flags.DEFINE_integer("batch_size", 64, "Expected Poisson batch size L.")
flags.DEFINE_integer("train_examples", 10_000, "Training rows (a fixed subset); the validation split is carved "
                     "from them.")
flags.DEFINE_integer("pretrain_examples", 20_000, "Public rows for the transfer task's pre-training.")
flags.DEFINE_float("validation_fraction", 0.2, "Share of the training rows held out for tuning.")
flags.DEFINE_float("clip", 1.0, "l2_norm_clip C.")
flags.DEFINE_float("delta", 1e-5, "δ.")
flags.DEFINE_string("output", "benchmarks/results/fiber_study.jsonl", "JSON lines, appended.")
flags.DEFINE_bool("quick", False, "Smoke run: tiny data, 2 configs, 1 seed, ε = 1, 6 steps.")
flags.DEFINE_list("ablations", None, "Ablation variants to run (default: all of ABLATIONS).")
flags.DEFINE_string("curve_optimizer", "dpsgd", "Optimizer of --stage=curves (at its tuned config).")
flags.DEFINE_integer("threads", 1, "TensorFlow intra-/inter-op threads.")

# Search spaces: name -> (low, high, scale). "step_scale" is lr/√floor: once v̂ − A·σ_w² falls
# below the floor (most coordinates in the noise-dominated regime) the bias-corrected step is
# lr·m̂/√floor, so (floor, lr/√floor) is the natural pair to sample jointly; lr = step_scale·√floor.
BIAS_CORRECTED = {"variance_floor": (1e-10, 1e-3, "log"), "step_scale": (0.01, 3.0, "log")}
FILTER_GEOMETRY = {"kappa": (0.5, 0.9, "linear"), "gamma": (0.3, 1.0, "linear")}  # DiSK's defaults 0.7 / 0.5 inside
SPACES = {
    "dpsgd": {"learning_rate": (3e-3, 1.0, "log")},  # momentum 0.9
    "dpadamw": {"learning_rate": (1e-4, 3e-2, "log")},
    "dpadambc": BIAS_CORRECTED,
    "disk": {"learning_rate": (1e-4, 3e-2, "log"), **FILTER_GEOMETRY},
    "fiber": {**BIAS_CORRECTED, **FILTER_GEOMETRY, "omega": (0.1, 1.0, "linear")},
    "bandmf_sgd": {"learning_rate": (3e-3, 1.0, "log")},  # DP-SGD's space (momentum 0.9)
    "bandmf_adamw": {"learning_rate": (1e-4, 3e-2, "log")},  # DP-AdamW's space
}
SPACES["bandmf_fiber"] = SPACES["fiber"]  # FIBER whose noise-bias correction follows BandMF's noise (§10.6)
BANDMF = ("bandmf_sgd", "bandmf_adamw", "bandmf_fiber")  # noise=BandMF(--bands): cyclic Poisson, amplified event
BANDMF_PARTNERS = {"bandmf_sgd": "dpsgd", "bandmf_adamw": "dpadamw", "bandmf_fiber": "fiber"}  # independent noise
# Ablation variants of FIBER: extra constructor arguments (None: ω tied to κ).
ABLATIONS = {
    "ema_filter": {"filter": "ema"},
    "stationary_correction": {"correction": "stationary"},
    "full_correction": {"correction": "full"},
    "no_correction": {"noise_bias_correction": False},
    "coupled_gain": None,
}


# ----------------------------------------------------------------------------- configurations
def latin_hypercube(space: dict, n: int, seed: int = 0) -> list[dict]:
    """n configurations; each dimension split into n equal strata (log or linear), one
    draw per stratum, strata shuffled independently per dimension."""
    rng = np.random.default_rng(seed)
    columns = {}
    for name, (low, high, scale) in sorted(space.items()):
        unit = (rng.permutation(n) + rng.uniform(size=n)) / n
        if scale == "log":
            columns[name] = np.exp(np.log(low) + unit * (np.log(high) - np.log(low)))
        else:
            columns[name] = low + unit * (high - low)
    return [with_learning_rate({k: float(v[i]) for k, v in columns.items()}) for i in range(n)]


def with_learning_rate(config: dict) -> dict:
    """Resolves lr = step_scale·√floor for the bias-corrected spaces."""
    if "step_scale" in config:
        config = dict(config, learning_rate=config["step_scale"] * math.sqrt(config["variance_floor"]))
    return config


def lr_decades(configs: list[dict]) -> float:
    rates = [c["learning_rate"] for c in configs]
    return math.log10(max(rates) / min(rates))


def make_optimizer(name: str, config: dict, sigma: float, seed: int, extra: dict | None = None):
    common = dict(l2_norm_clip=FLAGS.clip, noise_multiplier=sigma, seed=seed)
    lr = config["learning_rate"]
    if name == "dpsgd":
        return tf_dp.DPSGD(lr, momentum=0.9, **common)
    if name == "dpadamw":
        return tf_dp.DPAdamW(lr, **common)
    if name == "bandmf_sgd":
        return tf_dp.DPSGD(lr, momentum=0.9, noise=tf_dp.noise.BandMF(FLAGS.bands), **common)
    if name == "bandmf_adamw":
        return tf_dp.DPAdamW(lr, noise=tf_dp.noise.BandMF(FLAGS.bands), **common)
    if name == "dpadambc":
        return tf_dp.DPAdamW(lr, noise_bias_correction=True, variance_floor=config["variance_floor"], **common)
    if name == "disk":
        return tf_dp.DiSK(lr, kappa=config["kappa"], gamma=config["gamma"], base="adamw", **common)
    if name in ("fiber", "bandmf_fiber"):
        if name == "bandmf_fiber":
            extra = dict(extra or {}, noise=tf_dp.noise.BandMF(FLAGS.bands))
        return tf_dp.FIBER(lr, kappa=config["kappa"], gamma=config["gamma"], omega=config["omega"],
                           variance_floor=config["variance_floor"], **{**common, **(extra or {})})
    raise ValueError(name)


# ----------------------------------------------------------------------------- data and models
class Data:
    """Training rows (with the tuning split carved from them) and the test set."""

    def __init__(self, x, y, x_test, y_test, classes, pretrain=None):
        self.x, self.y, self.x_test, self.y_test, self.classes, self.pretrain = x, y, x_test, y_test, classes, pretrain
        missing = sorted(set(range(classes)) - set(np.asarray(y).tolist()))
        if missing:
            raise ValueError(f"the {len(y)} training rows lack classes {missing}: take a random subset (sorted data).")
        cut = int(round(len(y) * (1 - FLAGS.validation_fraction)))
        order = np.random.default_rng(0).permutation(len(y))
        self.tune_rows, self.valid_rows = order[:cut], order[cut:]

    def split(self, phase: str):
        """(x_train, y_train, x_eval, y_eval) for 'tune' (validation) or 'test'."""
        if phase == "tune":
            return self.x[self.tune_rows], self.y[self.tune_rows], self.x[self.valid_rows], self.y[self.valid_rows]
        return self.x, self.y, self.x_test, self.y_test


def load_task(task: str, train_examples: int) -> Data:
    if task in ("mnist", "fashion_mnist"):
        split = tf_dp_data.load_mnist() if task == "mnist" else tf_dp_data.load_fashion_mnist()
        return Data(split.x_train[:train_examples], split.y_train[:train_examples], split.x_test, split.y_test, 10)
    if task == "tweets":
        # The training split is sorted by class (its first 10,000 rows are all class 0): a fixed
        # random subset (seed 0, public) instead of the first rows.
        split = tf_dp_data.load_tweets(vocabulary_size=5000)
        rows = np.random.default_rng(0).permutation(len(split.y_train))[:train_examples]
        return Data(split.x_train[rows], split.y_train[rows], split.x_test, split.y_test, 3)
    if task == "transfer":
        # Public pre-training on Fashion-MNIST (same 28×28 grey format, disjoint content), private
        # fine-tuning of the whole network on MNIST: the "public features, private task" setting.
        public, private = tf_dp_data.load_fashion_mnist(), tf_dp_data.load_mnist()
        rows = FLAGS.pretrain_examples
        return Data(private.x_train[:train_examples], private.y_train[:train_examples], private.x_test,
                    private.y_test, 10, pretrain=(public.x_train[:rows], public.y_train[:rows]))
    raise ValueError(task)


def tutorial_cnn(classes: int) -> tf_dp.DPModel:
    """The CNN of tensorflow-privacy's MNIST tutorial (as examples/mnist_dpsgd.py)."""
    layers = keras.layers
    inputs = keras.Input((28, 28, 1))
    x = layers.Conv2D(16, 8, strides=2, padding="same", activation="relu")(inputs)
    x = layers.MaxPooling2D(2, 1)(x)
    x = layers.Conv2D(32, 4, strides=2, padding="valid", activation="relu")(x)
    x = layers.MaxPooling2D(2, 1)(x)
    x = layers.Dense(32, activation="relu")(layers.Flatten()(x))
    return tf_dp.DPModel(inputs, layers.Dense(classes)(x))


def small_transformer(classes: int, vocabulary: int = 5000, width: int = 64) -> tf_dp.DPModel:
    """One attention block (as benchmarks/step_time.py's transformer)."""
    layers = keras.layers
    inputs = keras.Input((40,), dtype="int32")
    x = layers.Embedding(vocabulary, width)(inputs)
    x = layers.LayerNormalization()(x + layers.MultiHeadAttention(num_heads=4, key_dim=16)(x, x))
    x = layers.LayerNormalization()(x + layers.Dense(width)(layers.Dense(2 * width, activation="relu")(x)))
    return tf_dp.DPModel(inputs, layers.Dense(classes)(layers.GlobalAveragePooling1D()(x)))


_PRETRAINED = {}


def build_model(task: str, data: Data, seed: int) -> tf_dp.DPModel:
    keras.utils.set_random_seed(seed)
    model = small_transformer(data.classes) if task == "tweets" else tutorial_cnn(data.classes)
    if data.pretrain is not None:
        model.set_weights(pretrained_weights(data, seed))
    return model


def pretrained_weights(data: Data, seed: int):
    """Non-private Adam on the public set, 1 epoch, once per seed (cached)."""
    if seed not in _PRETRAINED:
        keras.utils.set_random_seed(seed)
        plain = keras.Model(*_functional_io(tutorial_cnn(data.classes)))
        plain.compile(optimizer=keras.optimizers.Adam(1e-3), loss=_loss())
        x, y = data.pretrain
        plain.fit(x, y, batch_size=128, epochs=1, verbose=0)
        _PRETRAINED[seed] = plain.get_weights()
    return _PRETRAINED[seed]


def _functional_io(model):
    return model.inputs, model.outputs


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


# ----------------------------------------------------------------------------- one run
def noise_multiplier(epsilon: float, num_examples: int, name: str = "dpsgd") -> float:
    """σ whose T steps meet ε: DP-SGD's Poisson event, or the BandMF optimizers' amplified event
    PoissonSampled(q_b = b·L/N, G(σ)) composed ⌈T/b⌉ times (docs/algorithms.md §10.3)."""
    if name in BANDMF:
        return calibrate_bandmf_noise_multiplier(epsilon, num_examples, FLAGS.batch_size, FLAGS.bands,
                                                 steps=FLAGS.steps, delta=FLAGS.delta)
    return calibrate_noise_multiplier(epsilon, num_examples, FLAGS.batch_size, steps=FLAGS.steps, delta=FLAGS.delta)


def train(task, data, phase, name, config, epsilon, seed, extra=None, steps=None, callbacks=()):
    """Trains one configuration; returns (model, record)."""
    x, y, x_eval, y_eval = data.split(phase)
    sigma = noise_multiplier(epsilon, len(y), name)
    model = build_model(task, data, seed)
    optimizer = make_optimizer(name, config, sigma, seed, extra)
    model.compile(optimizer=optimizer, loss=_loss(), metrics=["accuracy"], delta=FLAGS.delta)
    start, cpu_start = time.perf_counter(), time.process_time()
    model.fit(x, y, batch_size=FLAGS.batch_size, epochs=1, steps_per_epoch=steps or FLAGS.steps, verbose=0,
              sampling_seed=seed, callbacks=list(callbacks))
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    loss, accuracy = model.evaluate(x_eval, y_eval, verbose=0, batch_size=1000)
    accuracy = float(accuracy) if np.isfinite(loss) else 0.0
    bands = {"bands": FLAGS.bands} if name in BANDMF else {}
    return model, {"accuracy": accuracy, "sigma": sigma, "epsilon_spent": float(model.get_epsilon()), **bands,
                   "seconds": seconds, "ms_per_step": 1000 * seconds / (steps or FLAGS.steps),
                   "cpu_ms_per_step": 1000 * cpu_seconds / (steps or FLAGS.steps)}


# ----------------------------------------------------------------------------- results file
def run_keys() -> dict:
    """What makes two records comparable: the task and its sizes."""
    return {"task": FLAGS.task, "steps": FLAGS.steps, "batch_size": FLAGS.batch_size,
            "train_examples": FLAGS.train_examples}


def append(record: dict) -> None:
    print(json.dumps(append_jsonl(FLAGS.output, {**run_keys(), **record})), flush=True)


def read_records(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def matching(records, **keys) -> list[dict]:
    return [r for r in records if all(r.get(k) == v for k, v in keys.items())]


def best_config(records, **keys) -> dict:
    """The validation argmax among the tuning records (first on ties)."""
    tuned = matching(records, kind="tune", **keys)
    return max(tuned, key=lambda r: r["accuracy"])["config"]


# ----------------------------------------------------------------------------- stages
def tune_and_test(task, data, name, epsilon, configs, variant=None, extra=None):
    """Tuning on the validation split, then the seeds on the test set; returns the chosen config."""
    label = variant or name
    done = matching(read_records(FLAGS.output), optimizer=label, epsilon=epsilon, **run_keys())  # resume
    tuned = {r["index"] for r in done if r["kind"] == "tune"}
    for index, config in enumerate(configs):
        if index not in tuned:
            _, result = train(task, data, "tune", name, config, epsilon, seed=0, extra=extra)
            append({"kind": "tune", "optimizer": label, "epsilon": epsilon, "index": index, "config": config, **result})
    chosen = best_config(read_records(FLAGS.output), optimizer=label, epsilon=epsilon, **run_keys())
    tested = {r["seed"] for r in done if r["kind"] == "test"}
    for seed in sorted(set(range(FLAGS.seeds)) - tested):
        _, result = train(task, data, "test", name, chosen, epsilon, seed=seed, extra=extra)
        append({"kind": "test", "optimizer": label, "epsilon": epsilon, "seed": seed, "config": chosen, **result})
    return chosen


def run_main(task, data, epsilons):
    for epsilon in epsilons:
        for name in FLAGS.optimizers:
            tune_and_test(task, data, name, epsilon, latin_hypercube(SPACES[name], FLAGS.configs, seed=0))


def run_borrowed(task, data, epsilons):
    """Each BandMF optimizer at its partner's tuned config (no tuning of its own), the same test
    seeds as the partner's test runs: paired, the noise being the only change."""
    records = read_records(FLAGS.output)
    for epsilon in epsilons:
        for name in [n for n in FLAGS.optimizers if n in BANDMF]:
            partner = BANDMF_PARTNERS[name]
            label, config = f"{name}@{partner}", best_config(records, optimizer=partner, epsilon=epsilon, **run_keys())
            done = {r["seed"] for r in matching(records, kind="test", optimizer=label, epsilon=epsilon, **run_keys())}
            for seed in sorted(set(range(FLAGS.seeds)) - done):
                _, result = train(task, data, "test", name, config, epsilon, seed=seed)
                append({"kind": "test", "optimizer": label, "epsilon": epsilon, "seed": seed, "config": config,
                        **result})


def ablation_config(base: dict, variant: str) -> dict:
    """FIBER's tuned config; ω = κ for the coupled gain (DiSK's single gain)."""
    return dict(base, omega=base["kappa"]) if ABLATIONS[variant] is None else base


def run_ablation(task, data, epsilons):
    """Each variant changes one component of FIBER's tuned config (no re-tuning); the
    reference is the main sweep's FIBER test runs (same config and seeds)."""
    records = read_records(FLAGS.output)
    for epsilon in epsilons:
        base = best_config(records, optimizer="fiber", epsilon=epsilon, **run_keys())
        for variant in FLAGS.ablations or ABLATIONS:
            extra, config = ABLATIONS[variant], ablation_config(base, variant)
            done = {r["seed"] for r in matching(records, kind="test", optimizer=f"ablation:{variant}", epsilon=epsilon,
                                                **run_keys())}  # resume
            for seed in sorted(set(range(FLAGS.seeds)) - done):
                _, result = train(task, data, "test", "fiber", config, epsilon, seed=seed, extra=extra)
                append({"kind": "test", "optimizer": f"ablation:{variant}", "epsilon": epsilon, "seed": seed,
                        "config": config, **result})


class PremiseProbe(keras.callbacks.Callback):
    """Every ``every`` steps: FIBER's v̂ per coordinate against A_t·σ_w², and the same filter
    and second moment run on pure noise N(0, σ_w²) alongside (no signal)."""

    def __init__(self, sigma_w: float, omega: float, beta_2: float, floor: float, every: int, seed: int = 0):
        super().__init__()
        self.sigma_w, self.omega, self.beta_2, self.floor, self.every = sigma_w, omega, beta_2, floor, every
        self.rng, self.rows, self.step = np.random.default_rng(seed), [], 0
        self.noise = None

    def on_train_batch_end(self, batch, logs=None):
        optimizer = self.model.optimizer
        if self.noise is None:
            size = sum(int(np.prod(v.shape)) for v in self.model.trainable_variables)
            self.noise = [np.zeros(size) for _ in range(3)]  # g̃, r, v of the noise-only companion
        self.step += 1
        filtered, residual, velocity = self.noise
        residual = (1 - self.omega) * residual + self.omega * (
            self.rng.normal(0, self.sigma_w, filtered.size) - filtered)
        filtered = filtered + residual
        velocity = self.beta_2 * velocity + (1 - self.beta_2) * filtered**2
        self.noise = [filtered, residual, velocity]
        if self.step % self.every == 0:
            self.rows.append(self.measure(optimizer, filtered, velocity))

    def measure(self, optimizer, noise_filtered, noise_velocity):
        correction = 1 - self.beta_2**self.step
        v_hat = np.concatenate([v.numpy().ravel() for v in optimizer.inner_optimizer._velocities]) / correction
        g_tilde = np.concatenate([v.numpy().ravel() for v in optimizer._filtered_gradients])
        noise_v_hat = noise_velocity / correction
        a_t = float(optimizer.filter_attenuation().numpy())
        target = a_t * self.sigma_w**2
        return {"step": self.step, "A_t": a_t, "A_t_sigma_w2": target,
                "noise_only_filtered_var_over_target": float(np.var(noise_filtered) / target),
                "noise_only_v_hat_median_over_target": float(np.median(noise_v_hat) / target),
                "v_hat_median_over_target": float(np.median(v_hat) / target),
                "v_hat_p90_over_target": float(np.quantile(v_hat, 0.9) / target),
                "g_tilde_sq_mean_over_target": float(np.mean(g_tilde**2) / target),
                "share_at_floor": float(np.mean(v_hat - target < self.floor)),
                "noise_only_share_below_target": float(np.mean(noise_v_hat - target < 0))}


def run_diagnostic(task, data, epsilons):
    records = read_records(FLAGS.output)
    for epsilon in epsilons:
        config = best_config(records, optimizer="fiber", epsilon=epsilon, **run_keys())
        sigma = noise_multiplier(epsilon, len(data.y))
        probe = PremiseProbe(sigma * FLAGS.clip / FLAGS.batch_size, config["omega"], 0.999, config["variance_floor"],
                             every=max(1, FLAGS.steps // 10))
        _, result = train(task, data, "test", "fiber", config, epsilon, seed=0, callbacks=[probe])
        append({"kind": "diagnostic", "optimizer": "fiber", "epsilon": epsilon, "config": config, "probe": probe.rows,
                **result})


def run_curves(task, data, epsilons):
    records = read_records(FLAGS.output)
    for epsilon in epsilons:
        name = FLAGS.curve_optimizer
        config = best_config(records, optimizer=name, epsilon=epsilon, **run_keys())
        for steps in [FLAGS.steps // 2, FLAGS.steps, 2 * FLAGS.steps, 4 * FLAGS.steps]:
            # σ is calibrated for each length, so each point is a complete run at ε.
            saved = FLAGS.steps
            FLAGS.steps = steps
            try:
                _, result = train(task, data, "test", name, config, epsilon, seed=0)
            finally:
                FLAGS.steps = saved
            append({"kind": "curve", "optimizer": name, "epsilon": epsilon, "curve_steps": steps, "config": config,
                    **result})


# Untuned first tries, scored on the validation split: κ = 0.7, γ = 0.5, ω = 0.5
# throughout; DP-AdamBC and FIBER at lr = 1e-3 with the old and the new default variance floor;
# DiSK and DP-AdamW at Keras' lr = 1e-3 and at 5e-3 (the study's tuned optimum at every ε on MNIST).
DEFAULT_TRIES = {
    "dpadambc": {"old_floor": {"variance_floor": 5e-8}, "new_floor": {"variance_floor": 5e-6}},
    "fiber": {"old_floor": {"variance_floor": 5e-8}, "new_floor": {"variance_floor": 5e-6}},
    "disk": {"lr_1e-3": {"learning_rate": 1e-3}, "lr_5e-3": {"learning_rate": 5e-3}},
    "dpadamw": {"lr_1e-3": {"learning_rate": 1e-3}, "lr_5e-3": {"learning_rate": 5e-3}},
}


def run_defaults(task, data, epsilons):
    done = {(r["optimizer"], r["epsilon"], r["try"]) for r in matching(read_records(FLAGS.output), kind="defaults",
                                                                       **run_keys())}
    for epsilon in epsilons:
        for name, tries in DEFAULT_TRIES.items():
            for label, change in tries.items():
                if (name, epsilon, label) in done:
                    continue
                config = {"learning_rate": 1e-3, "kappa": 0.7, "gamma": 0.5, "omega": 0.5, **change}
                _, result = train(task, data, "tune", name, config, epsilon, seed=0)
                append({"kind": "defaults", "optimizer": name, "epsilon": epsilon, "try": label, "config": config,
                        **result})


# ----------------------------------------------------------------------------- report
def summary(records, keys: dict) -> dict:
    """{(optimizer, ε): (mean, std, n, CPU ms/step)} over the test seeds."""
    table = {}
    for r in matching(records, kind="test", **keys):
        table.setdefault((r["optimizer"], r["epsilon"]), []).append(r)
    return {key: (statistics.mean(a["accuracy"] for a in runs), statistics.pstdev([a["accuracy"] for a in runs]),
                  len(runs), statistics.median(a["cpu_ms_per_step"] for a in runs)) for key, runs in table.items()}


def markdown(records, keys: dict) -> str:
    table = summary(records, keys)
    names = sorted({k[0] for k in table}, key=lambda n: (n.startswith("ablation"), n))
    epsilons = sorted({k[1] for k in table})
    lines = ["| ε | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for epsilon in epsilons:
        cells = [f"{100 * table[(n, epsilon)][0]:.2f} ± {100 * table[(n, epsilon)][1]:.2f} (n={table[(n, epsilon)][2]})"
                 if (n, epsilon) in table else "–" for n in names]
        lines.append(f"| {epsilon:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chosen_configs(records, keys: dict) -> str:
    """The validation argmax per optimizer and ε, with its validation accuracy and the spread."""
    lines = ["| optimizer | ε | validation acc. (best / median of the grid) | chosen configuration |",
             "|---|---|---|---|"]
    groups = {}
    for r in matching(records, kind="tune", **keys):
        groups.setdefault((r["optimizer"], r["epsilon"]), []).append(r)
    for (name, epsilon), runs in sorted(groups.items()):
        top = max(runs, key=lambda r: r["accuracy"])
        config = ", ".join(f"{k}={v:.3g}" for k, v in sorted(top["config"].items()))
        lines.append(f"| {name} | {epsilon:g} | {100 * top['accuracy']:.1f} / "
                     f"{100 * statistics.median(r['accuracy'] for r in runs):.1f} (n={len(runs)}) | {config} |")
    return "\n".join(lines)


def diagnostics(records, keys: dict) -> str:
    lines = ["| ε | step | A_t | median v̂ / A_tσ_w² | p90 v̂ / A_tσ_w² | mean g̃² / A_tσ_w² | noise-only: Var / A_tσ_w², "
             "median v̂ / A_tσ_w² | share of coordinates at the floor |", "|---|---|---|---|---|---|---|---|"]
    for r in matching(records, kind="diagnostic", **keys):
        for row in r["probe"]:
            lines.append(f"| {r['epsilon']:g} | {row['step']} | {row['A_t']:.3f} | "
                         f"{row['v_hat_median_over_target']:.3f} | "
                         f"{row['v_hat_p90_over_target']:.3f} | {row['g_tilde_sq_mean_over_target']:.3f} | "
                         f"{row['noise_only_filtered_var_over_target']:.3f}, "
                         f"{row['noise_only_v_hat_median_over_target']:.3f} | "
                         f"{100 * row['share_at_floor']:.1f} % |")
    return "\n".join(lines)


def curves(records, keys: dict) -> str:
    """Test accuracy of the curve optimizer at its tuned config against the step budget."""
    runs = matching(records, kind="curve", **{k: v for k, v in keys.items() if k != "steps"})
    budgets = sorted({r["curve_steps"] for r in runs})
    lines = ["| ε | " + " | ".join(f"T = {b}" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for epsilon in sorted({r["epsilon"] for r in runs}):
        cells = {r["curve_steps"]: f"{100 * r['accuracy']:.2f}" for r in runs if r["epsilon"] == epsilon}
        lines.append(f"| {epsilon:g} | " + " | ".join(cells.get(b, "–") for b in budgets) + " |")
    return "\n".join(lines)


def untuned(records, keys: dict) -> str:
    """Validation accuracy of the untuned first tries (DEFAULT_TRIES) by ε."""
    runs = matching(records, kind="defaults", **keys)
    epsilons = sorted({r["epsilon"] for r in runs})
    lines = ["| optimizer, try | " + " | ".join(f"ε = {e:g}" for e in epsilons) + " |",
             "|---|" + "---|" * len(epsilons)]
    for name, label in sorted({(r["optimizer"], r["try"]) for r in runs}):
        cells = {r["epsilon"]: f"{100 * r['accuracy']:.1f}"
                 for r in runs if (r["optimizer"], r["try"]) == (name, label)}
        lines.append(f"| {name}, {label} | " + " | ".join(cells.get(e, "–") for e in epsilons) + " |")
    return "\n".join(lines)


# The seed's claims as paired comparisons (same seed: same initialization, batches and noise stream).
CLAIM_PAIRS = [("fiber", "disk"), ("disk", "dpadamw"), ("fiber", "dpadamw"), ("dpadambc", "dpadamw"),
               ("fiber", "dpsgd"),
               ("bandmf_sgd", "dpsgd"), ("bandmf_adamw", "dpadamw"), ("fiber", "bandmf_adamw"),
               ("bandmf_sgd@dpsgd", "dpsgd"), ("bandmf_adamw@dpadamw", "dpadamw"), ("fiber", "bandmf_adamw@dpadamw"),
               ("bandmf_fiber@fiber", "fiber"), ("bandmf_fiber@fiber", "bandmf_sgd@dpsgd"),
               ("fiber", "ablation:ema_filter"), ("fiber", "ablation:coupled_gain"),
               ("fiber", "ablation:full_correction"), ("fiber", "ablation:stationary_correction")]


def paired(records, keys: dict) -> str:
    """Per ε: mean paired difference (points) of the test runs, and on how many seeds the first wins."""
    runs = {(r["optimizer"], r["epsilon"], r["seed"]): r["accuracy"] for r in matching(records, kind="test", **keys)}
    epsilons = sorted({k[1] for k in runs})
    lines = ["| pair | " + " | ".join(f"ε = {e:g}" for e in epsilons) + " |", "|---|" + "---|" * len(epsilons)]
    for first, second in CLAIM_PAIRS:
        cells = []
        for epsilon in epsilons:
            seeds = sorted(s for (n, e, s) in runs if n == first and e == epsilon and (second, epsilon, s) in runs)
            deltas = [100 * (runs[first, epsilon, s] - runs[second, epsilon, s]) for s in seeds]
            cells.append(f"{statistics.mean(deltas):+.2f} ({sum(d > 0 for d in deltas)}/{len(deltas)})"
                         if deltas else "–")
        if any(cell != "–" for cell in cells):
            lines.append(f"| {first} − {second} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(records, keys: dict) -> str:
    return "\n\n".join([markdown(records, keys), paired(records, keys), chosen_configs(records, keys),
                        diagnostics(records, keys), curves(records, keys), untuned(records, keys)])


# Seeds are public and fixed (seed s sets the initial weights, the noise key and the Poisson batches), for
# reproducible paired comparisons: said in the output, since such runs' ε is no guarantee for their weights.
FIXED_SEEDS_NOTE = ("note: fixed public seeds (seed s fixes the initial weights, the noise key and the "
                    "Poisson batches) "
                    "for reproducible paired comparisons: the accuracies are of fixed-seed runs, whose epsilon is "
                    "that of the procedure, not a privacy guarantee for these weights (anyone can regenerate the "
                    "noise). Private training: leave the seeds None (examples/_seeds.py).")


# What --quick sets (a smoke run).
QUICK = dict(configs=2, seeds=1, steps=6, batch_size=16, train_examples=300, pretrain_examples=300, epsilons=["1"])


def main(argv):
    del argv
    print(FIXED_SEEDS_NOTE, flush=True)
    tf.config.threading.set_intra_op_parallelism_threads(FLAGS.threads)
    tf.config.threading.set_inter_op_parallelism_threads(FLAGS.threads)
    if FLAGS.quick:
        for name, value in QUICK.items():
            setattr(FLAGS, name, value)
    epsilons = [float(e) for e in FLAGS.epsilons]
    if FLAGS.stage == "report":
        print(report(read_records(FLAGS.output), run_keys()))
        return
    data = load_task(FLAGS.task, FLAGS.train_examples)
    stages = {"main": run_main, "diagnostic": run_diagnostic, "ablation": run_ablation, "curves": run_curves,
              "defaults": run_defaults, "borrowed": run_borrowed}
    for stage in ["main", "diagnostic", "ablation"] if FLAGS.stage == "all" else [FLAGS.stage]:
        stages[stage](FLAGS.task, data, epsilons)
    print(markdown(read_records(FLAGS.output), run_keys()))


if __name__ == "__main__":
    app.run(main)
