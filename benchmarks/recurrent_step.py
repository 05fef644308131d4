"""DP step time / plain Keras step time for keras.io's LSTM encoder-decoder (seq2seq).

Batch 64, 20 encoder and 20 decoder steps, 64 units, one-hot tokens (32 encoder, 40
decoder). Three models of the same architecture, timed alternately in one process with
``train_on_batch``: plain Keras, tf_dp with the recurrent ghost rule (recurrent.py), and
tf_dp with that rule switched off while its step is traced (the per-layer per-example
replay of each LSTM, the path before the rule). Prints the median of each and the ratios.

    python benchmarks/recurrent_step.py [--repeats 20] [--jit]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dp  # noqa: E402
from tf_dp.clipping import registry  # noqa: E402

BATCH, STEPS, UNITS, ENCODER_TOKENS, DECODER_TOKENS = 64, 20, 64, 32, 40


def seq2seq(model_class=keras.Model):
    """keras.io's character-level encoder-decoder: encoder LSTM states → decoder LSTM."""
    keras.utils.set_random_seed(0)
    encoder_in, decoder_in = keras.Input((STEPS, ENCODER_TOKENS)), keras.Input((STEPS, DECODER_TOKENS))
    _, h, c = keras.layers.LSTM(UNITS, return_state=True)(encoder_in)
    decoded = keras.layers.LSTM(UNITS, return_sequences=True)(decoder_in, initial_state=[h, c])
    outputs = keras.layers.Dense(DECODER_TOKENS)(decoded)
    return model_class([encoder_in, decoder_in], outputs)


def data():
    rng = np.random.default_rng(0)
    one_hot = lambda tokens: np.eye(tokens, dtype="float32")[rng.integers(0, tokens, (BATCH, STEPS))]  # noqa: E731
    return [one_hot(ENCODER_TOKENS), one_hot(DECODER_TOKENS)], rng.integers(0, DECODER_TOKENS, (BATCH, STEPS))


@contextlib.contextmanager
def without_recurrent_rule():
    """The LSTM ghost rule unregistered (the per-layer replay runs instead)."""
    saved = {cls: registry._RULES.pop(cls) for cls in (keras.layers.LSTM, keras.layers.RNN)}
    try:
        yield
    finally:
        registry._RULES.update(saved)


def compiled(model, jit: bool, dp: bool):
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0) if dp else keras.optimizers.SGD(0.1)
    model.compile(optimizer=optimizer, loss=loss, jit_compile=jit)
    return model


def step_seconds(model, x, y) -> float:
    start = time.perf_counter()
    model.train_on_batch(x, y, batch_size=BATCH) if isinstance(model, tf_dp.DPModel) else model.train_on_batch(x, y)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--jit", action="store_true", help="jit_compile=True for all three")
    args = parser.parse_args()
    x, y = data()
    models = {"plain": compiled(seq2seq(), args.jit, dp=False),
              "dp, recurrent rule": compiled(seq2seq(tf_dp.DPModel), args.jit, dp=True),
              "dp, per-layer replay": compiled(seq2seq(tf_dp.DPModel), args.jit, dp=True)}
    for name, model in models.items():  # trace (and warm up) each once
        with without_recurrent_rule() if "replay" in name else contextlib.nullcontext():
            step_seconds(model, x, y)
            step_seconds(model, x, y)
    times = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, model in models.items():
            times[name].append(step_seconds(model, x, y))
    medians = {name: float(np.median(t)) for name, t in times.items()}
    print(f"LSTM seq2seq, batch {BATCH}, {STEPS} steps, {UNITS} units, jit_compile={args.jit}, "
          f"median of {args.repeats} alternating steps")
    for name, seconds in medians.items():
        print(f"  {name:22s} {seconds * 1e3:8.1f} ms   {seconds / medians['plain']:5.2f}x plain")


if __name__ == "__main__":
    main()
