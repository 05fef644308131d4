"""Writes tests/data/legacy_optimizers/: .keras files saved by the mixin optimizers of tf_dp 0.x.

Run once with the tf_dp whose saved files must keep loading (the mixin DPOptimizer, before
the DPOptimizer(inner) wrapper): ``python tools/make_legacy_optimizer_files.py``. For each of
DPSGD(momentum=0.9), DPAdam, DPAdamW, DiSK(base="adamw"), FIBER (and
its filter="ema" ablation, and DPSGD with use_ema) it trains a tiny DPModel
for 2 Poisson steps with ``fit`` and writes

* ``<name>.keras``: the saved model (ledger, weights, optimizer state);
* ``<name>.json``: what the loader must find in it — ledger steps, ε at δ = 1e-5, optimizer
  iterations, and every optimizer variable by its path (the values, as lists).

It also writes ``reference_steps.npz``: the weights after one seeded ``train_on_batch`` of
DPSGD and DPAdam on a fixed model and batch, so the new code can show its noise is bit for
bit the old one (same Philox keys and counters). tests/optimizers/test_legacy_optimizers.py reads both.
"""

from __future__ import annotations

import json
import os
import pathlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dp  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "data" / "legacy_optimizers"
DELTA = 1e-5
SEED = 2**40 + 17  # a large seed (a small one warns); lab fixture only
REFERENCE_SEED = 2**40 + 5


def optimizers() -> dict:
    common = dict(l2_norm_clip=1.0, noise_multiplier=1.0)
    return {
        "dpsgd": lambda: tf_dp.DPSGD(0.1, momentum=0.9, **common),
        "dpadam": lambda: tf_dp.DPAdam(0.01, noise_bias_correction=True, **common),
        "dpadamw": lambda: tf_dp.DPAdamW(0.01, **common),
        "disk": lambda: tf_dp.DiSK(0.01, base="adamw", noise_bias_correction=True, **common),
        "fiber": lambda: tf_dp.FIBER(0.01, omega=0.4, **common),
        "fiber_ema": lambda: tf_dp.FIBER(0.01, omega=0.4, filter="ema", **common),
        "dpsgd_ema": lambda: tf_dp.DPSGD(0.1, use_ema=True, ema_momentum=0.9, **common),
    }


def tiny_model(seed: int = 0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(5, activation="tanh")(inputs)
    return tf_dp.DPModel(inputs, keras.layers.Dense(3)(hidden))


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(16, 4)).astype("float32"), rng.integers(0, 3, 16).astype("int32")


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def write_trained_file(name: str, make) -> None:
    model = tiny_model()
    model.compile(optimizer=make(), loss=LOSS, delta=DELTA)
    x, y = data()
    model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=2, verbose=0, sampling_seed=3)
    model.save(OUT / f"{name}.keras")
    expected = {
        "class": type(model.optimizer).__name__,
        "ledger_steps": int(model.privacy_ledger.steps.numpy()),
        "epsilon": model.get_epsilon(DELTA),
        "iterations": int(model.optimizer.iterations.numpy()),
        "variables": {v.path: np.asarray(v.numpy()).tolist() for v in model.optimizer.variables},
        "weights": [w.tolist() for w in model.get_weights()],
    }
    (OUT / f"{name}.json").write_text(json.dumps(expected, indent=1))


def reference_steps() -> dict:
    """One seeded explicit-batch step of DPSGD and DPAdam: the weights after it."""
    x, y = data()
    out = {}
    for name, make in {"dpsgd": lambda: tf_dp.DPSGD(0.1, momentum=0.9, l2_norm_clip=0.5, noise_multiplier=1.3,
                                                     seed=REFERENCE_SEED),
                       "dpadam": lambda: tf_dp.DPAdam(0.01, l2_norm_clip=0.5, noise_multiplier=1.3,
                                                       seed=REFERENCE_SEED)}.items():
        model = tiny_model(1)
        model.compile(optimizer=make(), loss=LOSS)
        for step in range(2):
            model.train_on_batch(x, y, batch_size=len(y))
            for i, w in enumerate(model.get_weights()):
                out[f"{name}/step{step}/{i}"] = w
    return out


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, make in optimizers().items():
        write_trained_file(name, make)
    np.savez(OUT / "reference_steps.npz", **reference_steps())
    print(f"wrote {sorted(p.name for p in OUT.iterdir())}")


if __name__ == "__main__":
    main()
