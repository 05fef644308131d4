"""Files saved by the mixin optimizers of earlier tf_dp load into DPOptimizer(inner) and resume.

tests/data/legacy_optimizers/ was written by tools/make_legacy_optimizer_files.py with the
old code (the mixin DPOptimizer over Keras' private hooks). Each file is checked against the
values the OLD code recorded when it saved it: ledger steps, ε, optimizer iterations and
every optimizer variable (moments, filter state, θ_{t−1}, C, σ), then trained 2 more steps.
The seeded reference steps show the noise is the old noise bit for bit (same Philox keys
and counters) for DPSGD and DPAdam.
"""

import json
import pathlib

import keras
import numpy as np
import pytest

import tf_dp

DATA = pathlib.Path(__file__).parents[1] / "data" / "legacy_optimizers"
NAMES = ["dpsgd", "dpadam", "dpadamw", "disk", "fiber", "fiber_ema", "dpsgd_ema"]
# What the old files hold beyond the new layout: FIBER(filter="ema") saved the innovation
# filter's 3-entry noise covariance (A_t first) and residuals it never used.
DROPPED = {"fiber_ema": ("smoothed_residual",)}
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
# Float32 rounding of weights ~0.78 across CPU kernels (a few ulps, 6e-8 each).
FLOAT_ROUNDING = 1e-6


def _role(path: str) -> str:
    """'FIBER/dense_8_kernel_momentum' → ('kernel', 'momentum') position-free key: the layer
    names of the fixture's process differ from this one's."""
    return path.split("/", 1)[1]


def _old_state(expected: dict, name: str) -> list:
    drop = DROPPED.get(name, ())
    return [(path, np.asarray(value)) for path, value in expected["variables"].items()
            if not any(path.endswith(d) for d in drop)]


@pytest.mark.parametrize("name", NAMES)
def test_legacy_file_loads_with_its_ledger_and_optimizer_state_and_resumes(name):
    expected = json.loads((DATA / f"{name}.json").read_text())
    model = keras.models.load_model(DATA / f"{name}.keras")
    optimizer = model.optimizer
    assert type(optimizer).__name__ == expected["class"]
    assert isinstance(optimizer, tf_dp.optimizers.DPOptimizer)
    assert int(model.privacy_ledger.steps.numpy()) == expected["ledger_steps"] == 2
    assert model.get_epsilon(1e-5) == pytest.approx(expected["epsilon"], rel=1e-12)
    assert int(optimizer.iterations.numpy()) == expected["iterations"] == 2
    for got, want in zip(model.get_weights(), expected["weights"]):
        np.testing.assert_array_equal(got, np.asarray(want, got.dtype))
    old = _old_state(expected, name)
    new = optimizer.variables
    assert len(new) == len(old), [v.path for v in new]
    for variable, (path, value) in zip(new, old):
        saved = value[:1] if path.endswith("filter_noise_covariance") and variable.shape == (1,) else value
        assert _role(variable.path).split("_")[-1] == _role(path).split("_")[-1], (variable.path, path)
        np.testing.assert_array_equal(variable.numpy(), saved.astype(variable.dtype), err_msg=path)
    assert any(np.any(v.numpy() != 0) for v in new[5:]), "the moment/filter state must not be all zero"
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(16, 4)).astype("float32"), rng.integers(0, 3, 16).astype("int32")
    model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=2, verbose=0)
    assert int(model.privacy_ledger.steps.numpy()) == 4 and int(optimizer.iterations.numpy()) == 4
    assert model.get_epsilon(1e-5) > expected["epsilon"]
    assert not np.array_equal(model.get_weights()[0], np.asarray(expected["weights"][0], "float32"))


def _tiny_model(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(5, activation="tanh")(inputs)
    return tf_dp.DPModel(inputs, keras.layers.Dense(3)(hidden))


@pytest.mark.parametrize("name, make", [
    ("dpsgd", lambda seed: tf_dp.DPSGD(0.1, momentum=0.9, l2_norm_clip=0.5, noise_multiplier=1.3, seed=seed)),
    ("dpadam", lambda seed: tf_dp.DPAdam(0.01, l2_norm_clip=0.5, noise_multiplier=1.3, seed=seed)),
])
def test_seeded_steps_are_bit_identical_to_the_mixin_optimizers(name, make):
    """Two seeded explicit-batch steps reproduce the weights the old code computed: bit for bit
    on the machine that recorded them; elsewhere within float32 rounding of the matmuls, whose
    reduction order differs with the CPU's kernels (measured ≤ 1.5e-8 on an AVX-512 AMD EPYC,
    below one ulp of these weights, ~0.78). Any change of the noise (a wrong key, counter, σ or
    C) moves them by ≥ 1e-2 (another seed: 0.015–0.038), 10⁴ times the tolerance."""
    reference = np.load(DATA / "reference_steps.npz")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 4)).astype("float32"), rng.integers(0, 3, 16).astype("int32")
    model = _tiny_model(1)
    model.compile(optimizer=make(2**40 + 5), loss=LOSS)
    for step in range(2):
        model.train_on_batch(x, y, batch_size=len(y))
        for i, w in enumerate(model.get_weights()):
            np.testing.assert_allclose(w, reference[f"{name}/step{step}/{i}"], rtol=0, atol=FLOAT_ROUNDING)
    other = _tiny_model(1)
    other.compile(optimizer=make(2**40 + 6), loss=LOSS)
    other.train_on_batch(x, y, batch_size=len(y))
    moved = max(np.max(np.abs(w - reference[f"{name}/step0/{i}"])) for i, w in enumerate(other.get_weights()))
    assert moved > 1e4 * FLOAT_ROUNDING  # the seed matters, far beyond the tolerance
