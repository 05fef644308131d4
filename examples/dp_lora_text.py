"""DP fine-tuning of LoRA adapters only vs all weights: a small transformer on tweets.

A one-block transformer text classifier (Embedding → MultiHeadAttention → LayerNorm →
Dense feed-forward → LayerNorm → average pooling → Dense head) for the 3-class tweets
task (``tf_dp.data.load_tweets``). There is no public text corpus here to pre-train on,
so both runs start from the SAME random initial weights and are trained with DP-Adam at
the SAME ε (σ calibrated by ``compile(target_epsilon=...)``), batch size and epochs:

  (i)  full: every weight is trained;
  (ii) LoRA: Keras' ``layer.enable_lora(rank)`` on every Dense/EinsumDense kernel (the
       attention's query/key/value/output projections, the feed-forward and the head);
       only the factors ``lora_kernel_a``/``lora_kernel_b`` are trained, everything else
       (embedding, biases, LayerNorms, the base kernels) is frozen.

tf_dp clips per example over all trainable variables. Dense with LoRA and EinsumDense
have no ghost rule, so those layers are replayed per example by ``tf.vectorized_map``
(tf_dp's per-layer fallback). The script reports trainable parameters, test accuracy, ε
and ms/step of both runs; ms/step is timed after training on throwaway copies of both
models (same σ and L), in alternating rounds so that load from other jobs hits both alike.

Frozen variables (the base kernel after ``enable_lora``, frozen biases) stay out of the
per-example norm: tf_dp clips only what is trained.

Each run draws its own noise key and Poisson batches from OS entropy; ``--noise_seed``
reproduces both runs bit for bit but voids the guarantee (examples/_seeds.py).

    python examples/dp_lora_text.py                          # ε = 8, 3 epochs, rank 4
    python examples/dp_lora_text.py --rank=8 --target_epsilon=3
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

import tf_dp  # noqa: E402
from _seeds import define_seed_flags, noise_seed, warn_if_fixed_noise  # noqa: E402
from _timing import BatchClock, random_subset, time_steps  # noqa: E402
from tf_dp.clipping import ghost_rule_for  # noqa: E402
from tf_dp.data import load_tweets  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("epochs", 3, "Epochs (⌈N/L⌉ Poisson steps each), the same for both runs.")
flags.DEFINE_integer("train_examples", None, "Train on N tweets drawn at random (the split is sorted by class).")
flags.DEFINE_integer("test_examples", None, "Evaluate on N test tweets drawn at random (smoke tests).")
flags.DEFINE_integer("rank", 4, "LoRA rank r.")
flags.DEFINE_float("target_epsilon", 8.0, "ε of each run (σ calibrated for the planned steps).")
flags.DEFINE_float("delta", 1e-5, "δ of the (ε, δ) guarantee.")
flags.DEFINE_integer("batch_size", 256, "Expected Poisson batch size L.")
flags.DEFINE_float("l2_norm_clip", 1.0, "Per-example clip bound C.")
flags.DEFINE_float("learning_rate", 3e-3, "DP-Adam learning rate of the full fine-tuning run.")
flags.DEFINE_float("lora_learning_rate", 1e-2, "DP-Adam learning rate of the LoRA run.")
flags.DEFINE_integer("vocabulary_size", 10_000, "Vocabulary incl. padding and out-of-vocabulary ids.")
flags.DEFINE_integer("embed_dim", 32, "Model width d.")
flags.DEFINE_integer("num_heads", 2, "Attention heads (key_dim = d / heads).")
flags.DEFINE_integer("ff_dim", 64, "Hidden width of the feed-forward block.")
define_seed_flags("Seed of the initial weights and the random subsets (public: data-independent).")
flags.DEFINE_integer("timing_rounds", 3, "Alternating timing rounds after training (0: report fit's own median).")
flags.DEFINE_integer("timing_steps", 20, "Steps per timing round.")

LORA_LAYERS = (keras.layers.Dense, keras.layers.EinsumDense)


@dataclass(frozen=True)
class Variant:
    """One fine-tuning protocol: all weights or LoRA factors only."""

    name: str
    lora: bool
    learning_rate: float


@dataclass
class RunResult:
    """What one fine-tuning run reports."""

    name: str
    trainable_params: int
    ms_per_step: float
    accuracy: float
    epsilon: float
    sigma: float
    steps: int

    def summary(self) -> str:
        return (f"{self.name}: params = {self.trainable_params}, ms/step = {self.ms_per_step:.1f}, "
                f"test accuracy = {self.accuracy:.4f}, epsilon = {self.epsilon:.3f}")


def transformer_classifier(vocabulary_size: int, sequence_length: int, num_classes: int) -> tf_dp.DPModel:
    """Embedding + one post-LayerNorm transformer block + average pooling + Dense head."""
    width, heads = FLAGS.embed_dim, FLAGS.num_heads
    inputs = keras.Input((sequence_length,), dtype="int32")
    x = keras.layers.Embedding(vocabulary_size, width, mask_zero=True, name="embedding")(inputs)
    attended = keras.layers.MultiHeadAttention(heads, width // heads, name="attention")(x, x)
    x = keras.layers.LayerNormalization(name="norm_1")(keras.layers.Add()([x, attended]))
    hidden = keras.layers.Dense(FLAGS.ff_dim, activation="relu", name="ff_in")(x)
    fed_forward = keras.layers.Dense(width, name="ff_out")(hidden)
    x = keras.layers.LayerNormalization(name="norm_2")(keras.layers.Add()([x, fed_forward]))
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    return tf_dp.DPModel(inputs, keras.layers.Dense(num_classes, name="head")(x))


def _leaf_layers(model: keras.Model) -> list:
    return [layer for layer in model._flatten_layers(include_self=False) if not layer._layers]


def enable_lora_only(model: keras.Model, rank: int) -> None:
    """LoRA on every Dense/EinsumDense kernel; every other weight frozen."""
    for layer in _leaf_layers(model):
        if isinstance(layer, LORA_LAYERS):
            layer.enable_lora(rank)
            for variable in list(layer._trainable_variables):
                if "lora_kernel" not in variable.path:
                    variable.trainable = False
        else:
            layer.trainable = False


def build_variant(variant: Variant, make_model, initial_weights: list) -> tf_dp.DPModel:
    """A fresh model with ``initial_weights``; LoRA-only trainable if ``variant.lora``."""
    model = make_model()
    model.set_weights(initial_weights)
    if variant.lora:
        enable_lora_only(model, FLAGS.rank)
    return model


def clipping_paths(model: keras.Model) -> str:
    """Which trainable layers tf_dp clips by a ghost rule and which by the vectorized_map fallback."""
    trainable = {id(v) for v in model.trainable_variables}
    ghost, fallback = [], []
    for layer in _leaf_layers(model):
        if any(id(v) in trainable for v in layer.trainable_variables):
            (ghost if ghost_rule_for(layer) is not None else fallback).append(layer.name)
    return f"ghost rules: {', '.join(ghost) or 'none'}; per-layer vectorized_map: {', '.join(fallback) or 'none'}"


def count_params(variables) -> int:
    return int(sum(np.prod(v.shape) for v in variables))


def compile_dp(model: tf_dp.DPModel, learning_rate: float, noise_multiplier: Optional[float] = None) -> None:
    """DP-Adam; σ calibrated to --target_epsilon unless ``noise_multiplier`` is given."""
    model.compile(
        optimizer=tf_dp.DPAdam(learning_rate, l2_norm_clip=FLAGS.l2_norm_clip, noise_multiplier=noise_multiplier,
                               seed=noise_seed()),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"], delta=FLAGS.delta,
        target_epsilon=None if noise_multiplier is not None else FLAGS.target_epsilon,
    )


def fine_tune(variant: Variant, model: tf_dp.DPModel, train, test) -> RunResult:
    """DP fine-tuning at --target_epsilon; ms/step here is the median inside this fit."""
    compile_dp(model, variant.learning_rate)
    params = count_params(model.trainable_variables)
    print(f"--- {variant.name}: {params} trainable parameters in {len(model.trainable_variables)} variables",
          flush=True)
    print(f"    per-example norms by {clipping_paths(model)}", flush=True)
    clock = BatchClock()
    model.fit(*train, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs, callbacks=[clock],
              sampling_seed=noise_seed(), verbose=2)
    accuracy = model.evaluate(*test, batch_size=512, verbose=0, return_dict=True)["accuracy"]
    result = RunResult(variant.name, params, clock.ms_per_step(), float(accuracy), model.get_epsilon(),
                       float(model.optimizer.noise_multiplier), int(model.privacy_ledger.steps.numpy()))
    print(f"result {result.summary()} (sigma = {result.sigma:.4f}, {result.steps} steps; "
          f"ms/step during training)", flush=True)
    return result


def retime(variants: list[Variant], results: list[RunResult], make_model, initial_weights: list, train) -> None:
    """Replaces each result's ms/step by the alternating-rounds timing of a throwaway copy at
    the same σ (the trained models and their ledgers stay untouched)."""
    copies = {}
    for variant, result in zip(variants, results):
        copies[variant.name] = build_variant(variant, make_model, initial_weights)
        compile_dp(copies[variant.name], variant.learning_rate, noise_multiplier=result.sigma)
    timings = time_steps(copies, train, FLAGS.batch_size, FLAGS.timing_rounds, FLAGS.timing_steps)
    for result in results:
        result.ms_per_step = timings[result.name]
    print(f"timing: median of {FLAGS.timing_rounds} alternating rounds of {FLAGS.timing_steps} steps, "
          f"L = {FLAGS.batch_size}", flush=True)


def main(argv):
    del argv
    warn_if_fixed_noise()
    keras.utils.set_random_seed(FLAGS.seed)
    data = load_tweets(vocabulary_size=FLAGS.vocabulary_size)
    train = random_subset(data.x_train, data.y_train, FLAGS.train_examples, FLAGS.seed)
    test = random_subset(data.x_test, data.y_test, FLAGS.test_examples, FLAGS.seed)
    make_model = functools.partial(transformer_classifier, len(data.feature_names), data.x_train.shape[1],
                                   len(data.class_names))
    initial_weights = make_model().get_weights()
    variants = [Variant("full", False, FLAGS.learning_rate),
                Variant(f"lora(rank={FLAGS.rank})", True, FLAGS.lora_learning_rate)]
    results = [fine_tune(v, build_variant(v, make_model, initial_weights), train, test) for v in variants]
    if FLAGS.timing_rounds:
        retime(variants, results, make_model, initial_weights, train)
    full, lora = results
    warn_if_fixed_noise()
    print(f"final: {full.summary()}; {lora.summary()}; "
          f"LoRA/full step time = {lora.ms_per_step / full.ms_per_step:.2f}x "
          f"(delta = {FLAGS.delta:g}, {len(train[1])} train tweets, {full.steps} Poisson steps each)")


if __name__ == "__main__":
    app.run(main)
