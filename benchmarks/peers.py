"""ms/step of tf_dp against peer DP libraries, same model, same batch, same run.

Each peer runs in its own interpreter (tensorflow-privacy, Opacus and jax_privacy in the venvs
made by benchmarks/peers_setup.sh, tf_dp in the interpreter running this script). Every worker
builds its model, warms up (traces/compiles) and then waits; the driver asks the workers
in turn, round after round, to time `--steps` steps, rotating the order each round so that
no worker always runs first or last on a shared machine. Only one worker runs at a time.
The figure reported per worker is the median over rounds; the ratio to tf_dp is the median
of per-round ratios.

    bash benchmarks/peers_setup.sh                         # once: /tmp/venv_tfp, /tmp/venv_opacus, /tmp/venv_jaxp
    python benchmarks/peers.py                             # MLP and CNN, batch 256
    python benchmarks/peers.py --models=mlp --rounds=9 --cpus=0,1
    python benchmarks/peers.py --models=transformer      # the transformer of benchmarks/step_time.py

DP settings everywhere: per-example clipping to L2 norm 1.0, Gaussian noise σ = 1.0
(std σ·C on the summed clipped gradients), SGD lr 0.1, batch 256, sparse categorical
cross-entropy from logits, random inputs: MNIST-shaped images with 10 classes (mlp, cnn) or
[batch, 64] tokens from a vocabulary of 5000 with 2 classes (transformer). A worker that
fails to start is recorded with its error message.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import traceback

from absl import app, flags
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/record.py, also when loaded by path
from record import write_json  # noqa: E402  (writes the command, commit, machine and date)

FLAGS = flags.FLAGS
MODELS = ("mlp", "cnn", "transformer")
flags.DEFINE_list("models", ["mlp", "cnn"], "Any of mlp (784-512-512-10), cnn (tensorflow-privacy tutorial CNN), "
                  "transformer (one attention block, as in benchmarks/step_time.py).")
flags.register_validator("models", lambda v: set(v) <= set(MODELS), f"--models takes values from {MODELS}")
flags.DEFINE_list("workers", None, "Workers to run (default: all). See WORKERS.")
flags.DEFINE_integer("batch_size", 256, "Batch size.")
flags.DEFINE_integer("rounds", 7, "Alternating rounds.")
flags.DEFINE_integer("steps", 30, "Steps per timing (at most; fewer for slow workers, see --timing_seconds).")
flags.DEFINE_float("timing_seconds", 1.5, "A worker whose warm step is slow times max(2, this / step time) steps "
                   "per round instead of --steps.")
flags.DEFINE_integer("threads", 0, "If > 0, intra-op threads of TF and torch (inter-op 1 then); 1 also makes XLA's CPU "
                     "runtime single-threaded in the JAX workers (other values leave JAX at its default). 0: defaults.")
flags.DEFINE_integer("warmup", 5, "Warm-up steps (tracing/compilation) before any timing.")
flags.DEFINE_string("tfp_python", "/tmp/venv_tfp/bin/python", "Interpreter of the tensorflow-privacy venv.")
flags.DEFINE_string("opacus_python", "/tmp/venv_opacus/bin/python", "Interpreter of the Opacus venv.")
flags.DEFINE_string("jaxp_python", "/tmp/venv_jaxp/bin/python", "Interpreter of the jax_privacy venv.")
flags.DEFINE_string("cpus", "", "If set, run every worker under `taskset -c CPUS`.")
flags.DEFINE_string("output", "benchmarks/results/peers/peers.json", "Where to write the JSON results.")
flags.DEFINE_bool("run_unsupported", False, "Also start the (worker, model) pairs of UNSUPPORTED.")
flags.DEFINE_string("worker", None, "(internal) run as this worker.")
flags.DEFINE_string("model", "mlp", "(internal) the worker's model.")

L2_NORM_CLIP = 1.0
NOISE_MULTIPLIER = 1.0
LEARNING_RATE = 0.1
VOCABULARY, TOKENS = 5000, 64  # the transformer's

# name -> (interpreter flag, description). "tf_dp" is the reference of the ratios.
WORKERS = {
    "tf_dp": ("main", "tf_dp.DPModel + tf_dp.DPSGD, ghost clipping (default), no XLA (default on CPU)"),
    "tf_dp_xla": ("main", "tf_dp.DPModel + tf_dp.DPSGD, ghost clipping, jit_compile=True"),
    "keras_plain": ("main", "plain Keras 3 SGD step (non-private reference)"),
    "tfp_dpsgd": ("tfp", "tensorflow-privacy DPKerasSGDOptimizer, num_microbatches=batch (pfor jacobian, "
                         "then a while_loop over microbatches through its DP query)"),
    "tfp_vec": ("tfp", "tensorflow-privacy VectorizedDPKerasSGDOptimizer, num_microbatches=batch"),
    "tfp_fast": ("tfp", "tensorflow-privacy DPModel, num_microbatches=None, layer registry: the default one (Dense, "
                        "Embedding) plus EinsumDense, LayerNormalization and MultiHeadAttention (fast/ghost clipping "
                        "when all trainable layers are registered, as for mlp and transformer; the cnn's Conv2D is "
                        "not, so it falls back to vectorized per-example gradients: see fast_clipping, unregistered), "
                        "use_xla=True (its default)"),
    "tfp_fast_noxla": ("tfp", "as tfp_fast with use_xla=False"),
    "tfp_plain": ("tfp", "plain tf.keras 2.15 SGD step (non-private reference)"),
    "opacus_hooks": ("opacus", "Opacus PrivacyEngine.make_private, grad_sample_mode='hooks' (default); the transformer "
                               "uses opacus.layers.DPMultiheadAttention and runs sequence-first with "
                               "make_private(batch_first=False), since Opacus 1.6.0's DPMultiheadAttention mixes up "
                               "heads and tokens with batch_first=True; parameter counts equal the Keras models'"),
    "opacus_ghost": ("opacus", "as opacus_hooks with grad_sample_mode='ghost' (ghost norms for the layer types with a "
                               "norm sampler; the others, e.g. the transformer's LayerNorm, through per-sample "
                               "gradients: see ghost_fallback)"),
    "torch_plain": ("opacus", "plain PyTorch SGD step on the Opacus workers' modules (non-private reference)"),
    "jaxp_keras": ("jaxp", "jax_privacy 2.0 keras_api.make_private on the same Keras 3 model, JAX backend (jit): "
                           "per-example gradients by jax.vmap over the whole batch (microbatch_size=None), clipped "
                           "each to C, rescale_to_unit_norm=False, Gaussian noise std sigma*C on the sum, divided by "
                           "the batch size; noise_multiplier given (no calibration); train_on_batch, which its "
                           "fit-time budget check does not wrap"),
    "jax_plain": ("jaxp", "plain Keras 3 SGD step on the JAX backend (jit) in the jax_privacy venv (non-private "
                          "reference)"),
}
# (worker, model) pairs not started (recorded as failed with the reason) unless --run_unsupported.
_JACOBIAN_OOM = ("not started (--run_unsupported starts it): its tape.jacobian over 256 microbatches back-propagates "
                 "the whole batch once per example, so e.g. the attention's [256, 256, 4, 64, 64] intermediates take "
                 "4 GiB each; in a trial at batch 256 it held 22 GB after warm-up and the OOM killer ended it when "
                 "the next worker started (24 GB machine, workers alive side by side)")
UNSUPPORTED = {("tfp_dpsgd", "transformer"): _JACOBIAN_OOM, ("tfp_vec", "transformer"): _JACOBIAN_OOM}
DEFAULT_WORKERS = ["tf_dp", "keras_plain", "tfp_dpsgd", "tfp_vec", "tfp_fast", "tfp_fast_noxla", "tfp_plain",
                   "opacus_hooks", "opacus_ghost", "torch_plain", "jaxp_keras", "jax_plain"]


# ----------------------------------------------------------------------------- workers
# A worker builds `step()` (one synchronous training step on a fixed batch), runs the
# warm-up, prints "READY <json>" and then answers "run N" with "<json>" until "quit".

def _data(model, batch, channels_last=True):
    import numpy as np
    rng = np.random.default_rng(0)
    if model == "transformer":
        return rng.integers(0, VOCABULARY, (batch, TOKENS), dtype=np.int32), rng.integers(0, 2, batch)
    shape = (batch, 28, 28, 1) if channels_last else (batch, 1, 28, 28)
    return rng.random(shape, dtype=np.float32), rng.integers(0, 10, batch)


def _keras_graph(keras, model):
    """(inputs, outputs) of the model, for Keras 3 and tf_keras alike."""
    L = keras.layers
    if model == "transformer":  # as transformer() in benchmarks/step_time.py
        inputs = keras.Input((TOKENS,), dtype="int32")
        x = L.Embedding(VOCABULARY, 64)(inputs)
        x = L.LayerNormalization()(x + L.MultiHeadAttention(num_heads=4, key_dim=16)(x, x))
        x = L.LayerNormalization()(x + L.Dense(64)(L.Dense(128, activation="relu")(x)))
        return inputs, L.Dense(2)(L.GlobalAveragePooling1D()(x))
    if model == "mlp":
        layers = [L.Flatten(), L.Dense(512, activation="relu"), L.Dense(512, activation="relu"), L.Dense(10)]
    else:
        layers = [L.Conv2D(16, 8, strides=2, padding="same", activation="relu"), L.MaxPooling2D(2, 1),
                  L.Conv2D(32, 4, strides=2, padding="valid", activation="relu"), L.MaxPooling2D(2, 1),
                  L.Flatten(), L.Dense(32, activation="relu"), L.Dense(10)]
    inputs = out = keras.Input((28, 28, 1))
    for layer in layers:
        out = layer(out)
    return inputs, out


def _tf_threads(tf):
    if FLAGS.threads > 0:
        tf.config.threading.set_intra_op_parallelism_threads(FLAGS.threads)
        tf.config.threading.set_inter_op_parallelism_threads(1)


def _main_worker(name, model, batch):
    import keras
    import tensorflow as tf
    _tf_threads(tf)
    import tf_dp
    x, y = _data(model, batch)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    inputs, out = _keras_graph(keras, model)
    if name == "keras_plain":
        m = keras.Model(inputs, out)
        m.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss=loss, jit_compile=False)
    else:
        m = tf_dp.DPModel(inputs, out)
        m.compile(optimizer=tf_dp.DPSGD(LEARNING_RATE, l2_norm_clip=L2_NORM_CLIP, noise_multiplier=NOISE_MULTIPLIER,
                                        seed=0),
                  loss=loss, jit_compile=(name == "tf_dp_xla"), clipping_engine="ghost")
    info = {"tensorflow": tf.__version__, "keras": keras.__version__, "tf_dp": getattr(tf_dp, "__version__", "?"),
            "params": m.count_params()}
    if isinstance(m, tf_dp.DPModel):
        return (lambda: m.train_on_batch(x, y, batch_size=len(y))), info
    return (lambda: m.train_on_batch(x, y)), info


def _tfp_registry():
    """The default layer registry plus every other Keras layer that tensorflow-privacy 0.9.0 has a
    fast-clipping function for."""
    import tensorflow as tf
    from tensorflow_privacy.privacy.fast_gradient_clipping import layer_registry
    from tensorflow_privacy.privacy.fast_gradient_clipping.registry_functions import (
        einsum_dense, layer_normalization, multi_head_attention)
    registry = layer_registry.make_default_layer_registry()
    registry.insert(tf.keras.layers.EinsumDense, einsum_dense.einsum_layer_computation)
    registry.insert(tf.keras.layers.LayerNormalization, layer_normalization.layer_normalization_computation)
    registry.insert(tf.keras.layers.MultiHeadAttention, multi_head_attention.multi_head_attention_layer_computation)
    return registry


def _tfp_worker(name, model, batch):
    import tensorflow as tf
    _tf_threads(tf)
    import tensorflow_privacy
    keras = tf.keras
    x, y = _data(model, batch)
    inputs, outputs = _keras_graph(keras, model)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    from importlib import metadata
    info = {"tensorflow": tf.__version__, "keras": metadata.version("keras"),
            "tensorflow_privacy": tensorflow_privacy.__version__}
    if name.startswith("tfp_fast"):
        from tensorflow_privacy.privacy.keras_models import dp_keras_model
        registry = _tfp_registry()
        m = dp_keras_model.DPModel(
            l2_norm_clip=L2_NORM_CLIP, noise_multiplier=NOISE_MULTIPLIER, num_microbatches=None,
            use_xla=(name == "tfp_fast"), layer_registry=registry, inputs=inputs, outputs=outputs)
        m.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss=loss)
        # False (vectorized per-example gradients instead) when a trainable layer is unregistered.
        info["fast_clipping"] = bool(m._enable_fast_peg_computation)
        info["unregistered"] = sorted({type(layer).__name__ for layer in m.layers
                                       if layer.trainable_variables and not registry.is_elem(layer)})
    elif name in ("tfp_dpsgd", "tfp_vec"):
        from tensorflow_privacy import DPKerasSGDOptimizer, VectorizedDPKerasSGDOptimizer
        m = keras.Model(inputs, outputs)
        opt = (DPKerasSGDOptimizer if name == "tfp_dpsgd" else VectorizedDPKerasSGDOptimizer)(
            l2_norm_clip=L2_NORM_CLIP, noise_multiplier=NOISE_MULTIPLIER, num_microbatches=batch,
            learning_rate=LEARNING_RATE)
        m.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=tf.losses.Reduction.NONE))
    else:
        m = keras.Model(inputs, outputs)
        m.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss=loss)
    info["params"] = m.count_params()
    return (lambda: m.train_on_batch(x, y)), info


def _torch_transformer(nn):
    from opacus.layers import DPMultiheadAttention

    class Transformer(nn.Module):
        # Sequence-first inside ([tokens, batch, features]), and so make_private(batch_first=False):
        # Opacus 1.6.0's DPMultiheadAttention(batch_first=True) mixes up heads and tokens.
        batch_first = False

        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(VOCABULARY, 64)
            self.attention = DPMultiheadAttention(64, 4)
            self.norm1, self.norm2 = nn.LayerNorm(64, eps=1e-3), nn.LayerNorm(64, eps=1e-3)  # Keras' epsilon
            self.feed_forward = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
            self.head = nn.Linear(64, 2)

        def forward(self, tokens):
            x = self.embedding(tokens.t())
            x = self.norm1(x + self.attention(x, x, x, need_weights=False)[0])
            x = self.norm2(x + self.feed_forward(x))
            # keepdim: the head's input keeps the batch on dimension 1, as Opacus is told.
            return self.head(x.mean(0, keepdim=True))[0]

    return Transformer()


def _torch_model(nn, model):
    if model == "transformer":
        return _torch_transformer(nn)
    if model == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                             nn.Linear(512, 10))
    # Keras "same" with kernel 8, stride 2 on 28x28 pads 3 on each side (output 14x14).
    return nn.Sequential(nn.Conv2d(1, 16, 8, stride=2, padding=3), nn.ReLU(), nn.MaxPool2d(2, 1),
                         nn.Conv2d(16, 32, 4, stride=2), nn.ReLU(), nn.MaxPool2d(2, 1),
                         nn.Flatten(), nn.Linear(32 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, 10))


def _ghost_fallback(net):
    """Parametrized module types that Opacus' ghost mode handles with per-sample gradients."""
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    return sorted({type(m).__name__ for m in net.modules() if list(m.parameters(recurse=False))
                   and type(m) not in GradSampleModuleFastGradientClipping.NORM_SAMPLERS})


def _opacus_worker(name, model, batch):
    import torch
    from torch import nn
    torch.manual_seed(0)
    if FLAGS.threads > 0:
        torch.set_num_threads(FLAGS.threads)
    xn, yn = _data(model, batch, channels_last=False)
    x, y = torch.from_numpy(xn), torch.from_numpy(yn).long()
    if not x.is_floating_point():
        x = x.long()
    net = _torch_model(nn, model)
    opt = torch.optim.SGD(net.parameters(), lr=LEARNING_RATE)
    criterion = nn.CrossEntropyLoss()
    info = {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "params": sum(p.numel() for p in net.parameters())}
    if name != "torch_plain":
        import opacus
        from opacus import PrivacyEngine
        info["opacus"] = opacus.__version__
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)
        engine = PrivacyEngine()
        mode = name.split("_", 1)[1]
        kwargs = dict(module=net, optimizer=opt, data_loader=loader, noise_multiplier=NOISE_MULTIPLIER,
                      max_grad_norm=L2_NORM_CLIP, grad_sample_mode=mode, batch_first=getattr(net, "batch_first", True))
        if mode == "ghost":
            info["ghost_fallback"] = _ghost_fallback(net)
            net, opt, criterion, loader = engine.make_private(criterion=criterion, **kwargs)
        else:
            net, opt, loader = engine.make_private(**kwargs)

    def step():
        opt.zero_grad()
        loss = criterion(net(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    return step, info


def _jax_environment():
    """Keras 3 on the JAX backend, on the CPU; with --threads=1, XLA's CPU runtime single-threaded.
    Set before keras or jax is imported (the worker's interpreter has imported neither)."""
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if FLAGS.threads == 1:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false "
                                   "intra_op_parallelism_threads=1").strip()


def _jaxp_private(m, batch):
    """``m`` made private by jax_privacy's Keras API with the benchmark's C, σ and batch."""
    from jax_privacy import keras_api
    # ε and train_steps only gate fit() (train_on_batch is not wrapped): ε is set far above what
    # 10,000 steps at σ = 1 spend, so the given σ passes DPKerasConfig's check unchanged.
    config = keras_api.DPKerasConfig(
        epsilon=1000.0, delta=1e-5, clipping_norm=L2_NORM_CLIP, batch_size=batch, gradient_accumulation_steps=1,
        train_steps=10_000, train_size=60_000, noise_multiplier=NOISE_MULTIPLIER, rescale_to_unit_norm=False,
        microbatch_size=None)
    return keras_api.make_private(m, config)


def _jaxp_worker(name, model, batch):
    _jax_environment()
    import jax
    import keras
    from importlib import metadata
    x, y = _data(model, batch)
    inputs, out = _keras_graph(keras, model)
    m = keras.Model(inputs, out)
    info = {"jax": jax.__version__, "keras": keras.__version__, "backend": keras.config.backend(),
            "xla_flags": os.environ.get("XLA_FLAGS", "")}
    if name == "jaxp_keras":
        info["jax_privacy"] = metadata.version("jax_privacy")
        m = _jaxp_private(m, batch)
    m.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    info["params"] = m.count_params()
    first = m.trainable_variables[0]

    def step():
        m.train_on_batch(x, y)
        first.value.block_until_ready()  # the update dispatched asynchronously has run

    return step, info


def run_worker(name, model, batch, warmup):
    kind = WORKERS[name][0]
    build = {"main": _main_worker, "tfp": _tfp_worker, "opacus": _opacus_worker, "jaxp": _jaxp_worker}[kind]
    try:
        step, info = build(name, model, batch)
        for i in range(warmup):  # a slow worker (> 1 s/step) stops warming up after 2 steps
            start = time.perf_counter()
            step()
            info["warm_ms"] = (time.perf_counter() - start) * 1000
            if i >= 1 and info["warm_ms"] > 1000:
                break
    except Exception as e:  # recorded by the driver as this worker's result
        print("FAILED " + json.dumps({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}),
              flush=True)
        return
    print("READY " + json.dumps(info), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        n = int(cmd[1])
        start = time.perf_counter()
        for _ in range(n):
            step()
        print(json.dumps({"ms": (time.perf_counter() - start) / n * 1000}), flush=True)


# ----------------------------------------------------------------------------- driver
class Worker:
    def __init__(self, name, model):
        self.name, self.model = name, model
        kind = WORKERS[name][0]
        python = {"main": sys.executable, "tfp": FLAGS.tfp_python, "opacus": FLAGS.opacus_python,
                  "jaxp": FLAGS.jaxp_python}[kind]
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.pathsep.join(
            p for p in [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        os.environ.get("PYTHONPATH", "")] if p))
        if kind == "tfp":
            env["TF_USE_LEGACY_KERAS"] = "1"
        cmd = [python, os.path.abspath(__file__), f"--worker={name}", f"--model={model}",
               f"--batch_size={FLAGS.batch_size}", f"--warmup={FLAGS.warmup}", f"--threads={FLAGS.threads}"]
        if FLAGS.cpus:
            cmd = ["taskset", "-c", FLAGS.cpus] + cmd
        self.error, self.info, self.times, self.proc = None, {}, [], None
        if not os.path.exists(python):
            self.error = f"interpreter {python} not found (run benchmarks/peers_setup.sh)"
            return
        if (name, model) in UNSUPPORTED and not FLAGS.run_unsupported:
            self.error = UNSUPPORTED[name, model]
            return
        self.stderr = open(os.path.join(_results_dir(), f"{name}_{model}.stderr.log"), "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     text=True, env=env)
        self._ready()

    def _ready(self):
        for line in self.proc.stdout:
            if line.startswith("READY "):
                self.info = json.loads(line[6:])
                return
            if line.startswith("FAILED "):
                self.error = json.loads(line[7:])["error"]
                self.close()
                return
        self._died("while starting")

    def _died(self, when):
        self.proc.wait()
        self.stderr.flush()
        with open(self.stderr.name) as f:
            tail = f.read().strip().splitlines()[-5:]
        killed = " (SIGKILL: out of memory?)" if self.proc.returncode == -9 else ""
        self.error = f"worker exited with code {self.proc.returncode}{killed} {when}: " + " | ".join(tail)
        self.proc = None

    @property
    def steps(self):
        warm = self.info.get("warm_ms") or 1.0
        return max(2, min(FLAGS.steps, round(FLAGS.timing_seconds * 1000 / warm)))

    def run(self):
        try:
            self.proc.stdin.write(f"run {self.steps}\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if line:
            self.times.append(json.loads(line)["ms"])
        else:
            self._died("while timing")

    def close(self):
        if self.proc is not None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass
            self.proc.wait()
            self.proc = None


def _results_dir():
    d = os.path.dirname(FLAGS.output) or "."
    os.makedirs(d, exist_ok=True)
    return d


def measure(model, names):
    workers = []
    for name in names:  # started one at a time so that warm-ups do not overlap
        print(f"[{model}] starting {name} ...", flush=True)
        w = Worker(name, model)
        print(f"[{model}] {name}: {'FAILED ' + w.error if w.error else 'ready ' + json.dumps(w.info)}", flush=True)
        workers.append(w)
    live = [w for w in workers if w.error is None]
    for r in range(FLAGS.rounds):
        order = live[r % len(live):] + live[:r % len(live)] if live else []
        for w in order:
            w.run()
        live = [w for w in live if w.error is None]
        print(f"[{model}] round {r + 1}/{FLAGS.rounds}: " + ", ".join(f"{w.name} {w.times[-1]:.1f}" for w in live),
              flush=True)
    for w in workers:
        w.close()
    ref = next((w for w in workers if w.name == "tf_dp" and w.error is None), None)
    rows = []
    for w in workers:
        row = {"model": model, "worker": w.name, "description": WORKERS[w.name][1], "batch_size": FLAGS.batch_size,
               "versions": w.info, "error": w.error}
        if w.error is None:
            row["ms_per_step"] = statistics.median(w.times)
            row["ms_all_rounds"] = w.times
            row["steps_per_round"] = w.steps
            if ref is not None:
                row["ratio_to_tf_dp"] = statistics.median(a / b for a, b in zip(w.times, ref.times))
        rows.append(row)
    return rows


def main(argv):
    del argv
    if FLAGS.worker:
        run_worker(FLAGS.worker, FLAGS.model, FLAGS.batch_size, FLAGS.warmup)
        return
    names = FLAGS.workers or DEFAULT_WORKERS
    unknown = set(names) - set(WORKERS)
    if unknown:
        raise app.UsageError(f"unknown workers {sorted(unknown)}; known: {sorted(WORKERS)}")
    results = [row for model in FLAGS.models for row in measure(model, names)]
    print(f"\nbatch {FLAGS.batch_size}, clip {L2_NORM_CLIP}, sigma {NOISE_MULTIPLIER}, {os.cpu_count()} cores"
          f"{', taskset -c ' + FLAGS.cpus if FLAGS.cpus else ''}"
          f"{', ' + str(FLAGS.threads) + ' intra-op thread(s)' if FLAGS.threads else ', default threads'}; "
          f"median of {FLAGS.rounds} alternating rounds of up to {FLAGS.steps} steps; "
          f"ratio = median of per-round (worker / tf_dp) ms\n")
    print("| model | worker | ms/step | ratio to tf_dp | versions / error |")
    print("|---|---|---|---|---|")
    for r in results:
        if r["error"]:
            print(f"| {r['model']} | {r['worker']} | failed | - | {r['error'][:300]} |")
        else:
            ratio = f"{r['ratio_to_tf_dp']:.2f}x" if "ratio_to_tf_dp" in r else "-"
            vers = ", ".join(f"{k} {v}" for k, v in r["versions"].items() if k != "warm_ms")
            print(f"| {r['model']} | {r['worker']} | {r['ms_per_step']:.1f} | {ratio} | {vers} |")
    write_json(FLAGS.output, {"date": time.strftime("%Y-%m-%d"), "cpu_count": os.cpu_count(), "cpus": FLAGS.cpus,
                              "threads": FLAGS.threads, "rounds": FLAGS.rounds, "steps": FLAGS.steps,
                              "l2_norm_clip": L2_NORM_CLIP, "noise_multiplier": NOISE_MULTIPLIER,
                              "results": results}, indent=2)
    print(f"\nwrote {FLAGS.output}")


if __name__ == "__main__":
    app.run(main)
