"""ms/step of a DP-SGD step vs a plain Keras step for keras-hub models (small configs).

Models (built from constructors; nothing is downloaded): GPT2CausalLM and GemmaCausalLM
(causal LMs, output head tied to the token embedding, per-token padding mask as sample
weight) and BertTextClassifier (an encoder classifier), batch 64 × 64 tokens. For each
(model, clipping engine) a child process builds a plain Keras copy and a tf_dp DPModel
of the same config, traces both, then times them in alternating rounds; the figure is
the median of per-round ratios (robust to drift of a shared machine). A child that
crashes (TensorFlow aborts inside vectorized_map on some of these models) is recorded as
a crash with its return code and last error line, not retried.

    python benchmarks/keras_hub_models.py                        # ghost and vectorized, ≈ 5–10 min
    python benchmarks/keras_hub_models.py --models=gpt2 --engines=ghost
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/record.py, also when loaded by path
from record import write_json  # noqa: E402  (writes the command, commit, machine and date)

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["gpt2", "gemma", "bert"], "keras-hub models to time.")
flags.DEFINE_list("engines", ["ghost", "vectorized"], "tf_dp clipping engines.")
flags.DEFINE_integer("batch_size", 64, "Batch size.")
flags.DEFINE_integer("sequence_length", 64, "Tokens per example.")
flags.DEFINE_integer("vocabulary_size", 5000, "Vocabulary size.")
flags.DEFINE_integer("rounds", 3, "Alternating rounds.")
flags.DEFINE_integer("steps", 5, "Steps per timing.")
flags.DEFINE_integer("timeout", 300, "Seconds allowed per (model, engine) child process.")
flags.DEFINE_string("case", None, "Internal: time one model:engine in this process and print JSON.")
flags.DEFINE_bool("list_fallbacks", False, "With --case: only list the layers replayed per example.")
flags.DEFINE_string("output", "benchmarks/results/keras_hub_models.json", "Where to write the JSON results.")

CONFIGS = {
    "gpt2": "GPT2CausalLM: 2 layers, width 128, 4 heads, FFN 512, tied head",
    "gemma": "GemmaCausalLM: 2 layers, width 128, 4 query heads / 1 KV head (head_dim 32), FFN 256, tied head",
    "bert": "BertTextClassifier: 2 layers, width 128, 4 heads, FFN 512, 2 classes",
    "llama": "LlamaCausalLM: 2 layers, width 128, 4 query heads / 1 KV head, FFN 256, tied head",
    "vit": "ViTImageClassifier: 32x32x3 images, patch 4, 2 layers, width 128, 4 heads, MLP 512, 10 classes",
    "t5": "T5Backbone (encoder-decoder, 2 layers, width 128, 4 heads, FFN 512) with a mean-pooled 2-class head",
}


def build(name: str):
    """(task model, inputs dict, targets, sample weights or None)."""
    import keras_hub
    import numpy as np

    vocabulary, length, batch = FLAGS.vocabulary_size, FLAGS.sequence_length, FLAGS.batch_size
    rng = np.random.default_rng(0)
    ids = rng.integers(1, vocabulary, (batch, length + 1)).astype("int32")
    lengths = rng.integers(length // 4, length + 2, batch)
    real = (np.arange(length + 1)[None] < lengths[:, None]).astype("int32")
    ids *= real
    if name == "gpt2":
        backbone = keras_hub.models.GPT2Backbone(vocabulary_size=vocabulary, num_layers=2, num_heads=4, hidden_dim=128,
                                                 intermediate_dim=512, max_sequence_length=length, dropout=0.0)
        task = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    elif name == "gemma":
        backbone = keras_hub.models.GemmaBackbone(vocabulary_size=vocabulary, num_layers=2, num_query_heads=4,
                                                  num_key_value_heads=1, hidden_dim=128, intermediate_dim=256,
                                                  head_dim=32, dropout=0.0)
        task = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    elif name == "bert":
        backbone = keras_hub.models.BertBackbone(vocabulary_size=vocabulary, num_layers=2, num_heads=4, hidden_dim=128,
                                                 intermediate_dim=512, max_sequence_length=length, dropout=0.0)
        task = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2, preprocessor=None, dropout=0.0)
        x = {"token_ids": ids[:, :-1], "segment_ids": np.zeros_like(ids[:, :-1]), "padding_mask": real[:, :-1]}
        return task, x, rng.integers(0, 2, batch).astype("int32"), None
    elif name == "llama":
        backbone = keras_hub.models.LlamaBackbone(vocabulary_size=vocabulary, num_layers=2, num_query_heads=4,
                                                  num_key_value_heads=1, hidden_dim=128, intermediate_dim=256,
                                                  tie_word_embeddings=True, dropout=0.0)
        task = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    elif name == "vit":
        backbone = keras_hub.models.ViTBackbone(image_shape=(32, 32, 3), patch_size=4, num_layers=2, num_heads=4,
                                                hidden_dim=128, mlp_dim=512, dropout_rate=0.0, attention_dropout=0.0)
        task = keras_hub.models.ViTImageClassifier(backbone=backbone, num_classes=10, preprocessor=None, dropout=0.0)
        images = rng.normal(size=(batch, 32, 32, 3)).astype("float32")
        return task, images, rng.integers(0, 10, batch).astype("int32"), None
    elif name == "t5":
        import keras

        backbone = keras_hub.models.T5Backbone(vocabulary_size=vocabulary, num_layers=2, num_heads=4, hidden_dim=128,
                                               intermediate_dim=512, key_value_dim=32, dropout=0.0)
        x = {"encoder_token_ids": ids[:, :-1], "encoder_padding_mask": real[:, :-1],
             "decoder_token_ids": ids[:, 1:], "decoder_padding_mask": real[:, 1:]}
        inputs = {k: keras.Input((length,), dtype="int32", name=k) for k in x}
        pooled = keras.layers.GlobalAveragePooling1D()(backbone(inputs)["decoder_sequence_output"])
        task = keras.Model(inputs, keras.layers.Dense(2)(pooled))
        return task, x, rng.integers(0, 2, batch).astype("int32"), None
    else:
        raise ValueError(f"unknown model {name!r}")
    x = {"token_ids": ids[:, :-1], "padding_mask": real[:, :-1]}
    return task, x, ids[:, 1:], real[:, 1:].astype("float32")


def fallback_layers(model, x, y, w) -> list:
    """The layers the ghost engine replays per example on this model: no rule applies, a
    call the rule does not model (seen by tracing one example through the taps), or a weight
    read outside its own layer (whole-model route)."""
    import tensorflow as tf

    from tf_dp.clipping.engine import _trainable_units
    from tf_dp.clipping.tap import LayerTap

    units = _trainable_units(model)
    tap = LayerTap(units, batch_size=1)
    with tap:
        model(tf.nest.map_structure(lambda t: t[:1], x), training=True)
    shared = {id(layer) for layer in tap.shared_layers()}
    found = []
    for layer, rule in tap.units:
        why = ("no rule" if rule is tap.fallback else "call not modelled" if id(layer) in tap.replayed
               else "weight read elsewhere" if id(layer) in shared else None)
        if why:
            found.append(f"{type(layer).__name__} {layer.name} ({why})")
    return found


def time_case(name: str, engine: str) -> dict:
    import keras

    import tf_dp

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    plain, x, y, w = build(name)
    plain.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss)
    task, _, _, _ = build(name)
    private = tf_dp.DPModel(task.input, task.output)
    private.compile(optimizer=tf_dp.DPSGD(0.01, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0), loss=loss,
                    clipping_engine=engine)
    run_plain = lambda: plain.train_on_batch(x, y, sample_weight=w)  # noqa: E731
    run_private = lambda: private.train_on_batch(x, y, sample_weight=w, batch_size=FLAGS.batch_size)  # noqa: E731

    def ms(step, count):
        start = time.perf_counter()
        for _ in range(count):
            step()
        return (time.perf_counter() - start) / count * 1000

    ms(run_plain, 2)
    ms(run_private, 2)  # trace outside the timings
    plain_times, dp_times = [], []
    for _ in range(FLAGS.rounds):
        dp_times.append(ms(run_private, FLAGS.steps))
        plain_times.append(ms(run_plain, FLAGS.steps))
    return {"model": name, "config": CONFIGS[name], "engine": engine, "status": "ok",
            "fallback_layers": fallback_layers(private, x, y, w),
            "parameters": int(private.count_params()), "plain_ms": statistics.median(plain_times),
            "dp_ms": statistics.median(dp_times),
            "ratio": statistics.median(d / p for d, p in zip(dp_times, plain_times))}


def run_child(name: str, engine: str) -> dict:
    flags_passed = [f"--{key}={getattr(FLAGS, key)}" for key in
                    ("batch_size", "sequence_length", "vocabulary_size", "rounds", "steps")]
    command = [sys.executable, os.path.abspath(__file__), f"--case={name}:{engine}", *flags_passed]
    base = {"model": name, "config": CONFIGS[name], "engine": engine}
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=FLAGS.timeout)
    except subprocess.TimeoutExpired:
        return {**base, "status": "timeout", "detail": f"no result within {FLAGS.timeout} s"}
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode == 0 and lines:
        return json.loads(lines[-1])
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if "Error" in line or "Fatal" in line or "Check failed" in line]
    detail = errors[-1] if errors else (lines[-1] if lines else "")
    return {**base, "status": "crash", "returncode": result.returncode, "detail": detail.strip()[:300]}


def main(argv):
    del argv
    if FLAGS.case:
        name, engine = FLAGS.case.split(":")
        if FLAGS.list_fallbacks:
            import tf_dp

            task, x, y, w = build(name)
            print(json.dumps({"model": name, "fallback_layers": fallback_layers(tf_dp.DPModel(task.input, task.output),
                                                                               x, y, w)}), flush=True)
            return
        print(json.dumps(time_case(name, engine)), flush=True)
        return
    print(f"batch {FLAGS.batch_size} x {FLAGS.sequence_length} tokens, vocabulary {FLAGS.vocabulary_size}, "
          f"{os.cpu_count()} cores, median of {FLAGS.rounds} alternating rounds of {FLAGS.steps} steps\n")
    print("| model | engine | parameters | plain ms | DP-SGD ms | DP-SGD / plain | layers replayed per example |")
    print("|---|---|---|---|---|---|---|", flush=True)
    results = []
    for name in FLAGS.models:
        for engine in FLAGS.engines:
            r = run_child(name, engine)
            results.append(r)
            if r["status"] == "ok":
                print(f"| {name} | {engine} | {r['parameters']} | {r['plain_ms']:.1f} | {r['dp_ms']:.1f} | "
                      f"{r['ratio']:.2f}x | {', '.join(r.get('fallback_layers', [])) or 'none'} |", flush=True)
            else:
                print(f"| {name} | {engine} | — | — | {r['status']} (return code {r.get('returncode')}) | "
                      f"{r['detail'][:80]} |", flush=True)
    write_json(FLAGS.output, {"date": time.strftime("%Y-%m-%d"), "batch_size": FLAGS.batch_size,
                              "sequence_length": FLAGS.sequence_length, "results": results}, indent=2)


if __name__ == "__main__":
    app.run(main)
