"""A seeded noise key never keys a resumed model: no (key, step) pair may draw noise twice.

A file cannot know what was released from it after it was saved. If two copies of one
file were resumed with the same seed, both would draw the same noise at the same steps
and the difference of the two releases would cancel it. Each test compares with an
independent computation (the noise of independent draws, the uninterrupted run) and
failed on the code before the fix.
"""

import keras
import numpy as np
import pytest

import tf_dp

UNITS, L, SEED = 4000, 8, 2**40 + 17


def noise_only_model(seed=None):
    """Zero inputs and an MSE target equal to the prediction: every gradient is 0, so an
    update is pure noise, lr·N(0, σ²C²)/L per coordinate (lr = σ = C = 1)."""
    inputs = keras.Input((1,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(UNITS, kernel_initializer="zeros")(inputs))
    model.compile(optimizer=tf_dp.DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=1.0, seed=seed), loss="mse")
    return model


BATCH = np.zeros((L, 1), "float32"), np.zeros((L, UNITS), "float32")


def step(model) -> np.ndarray:
    """One DP step; returns its update of the bias (the step's noise z)."""
    before = model.trainable_variables[1].numpy().copy()
    model.train_on_batch(*BATCH, batch_size=L)
    return model.trainable_variables[1].numpy() - before


def independent_difference_norm() -> float:
    """E‖z_A − z_B‖ for independent draws: √(2n) · σC/L."""
    return np.sqrt(2 * UNITS) / L


def correlation(a, b) -> float:
    return float(np.corrcoef(a.ravel(), b.ravel())[0, 1])


def saved_after_seeded_steps(path, steps=2):
    model = noise_only_model(SEED)
    for _ in range(steps):
        step(model)
    model.save(path)
    return model


def _loaded_then_reseeded(path, _):
    model = keras.models.load_model(path)
    model.optimizer.seed = SEED  # what the README said to do to resume
    return model


def _load_weights_into_a_seeded_model(path, weights):
    model = noise_only_model(SEED)
    model.load_weights(weights)
    return model


def _new_seeded_optimizer_on_a_trained_model(path, _):
    model = keras.models.load_model(path)
    model.compile(optimizer=tf_dp.DPSGD(1.0, noise_multiplier=1.0, seed=SEED), loss="mse")
    return model


@pytest.mark.parametrize("resume", [_loaded_then_reseeded, _load_weights_into_a_seeded_model,
                                    _new_seeded_optimizer_on_a_trained_model])
def test_a_seeded_resume_is_refused_before_any_noise_and_seed_none_draws_independent_noise(tmp_path, resume):
    saved_after_seeded_steps(tmp_path / "run.keras").save_weights(tmp_path / "run.weights.h5")
    copy_a = resume(tmp_path / "run.keras", tmp_path / "run.weights.h5")
    weights = [w.copy() for w in copy_a.get_weights()]
    with pytest.raises(ValueError, match=r"seed = None.*allow_resume=True"):
        step(copy_a)
    for before, after in zip(weights, copy_a.get_weights()):
        np.testing.assert_array_equal(before, after)  # refused before any noise was drawn
    assert int(copy_a.privacy_ledger.steps.numpy()) == 2
    # The fix the error names: a fresh OS key. Two resumes of one file then release
    # independent noise: ‖z_A − z_B‖ is that of independent draws (sd of the norm ≈ 1 %).
    copy_b = resume(tmp_path / "run.keras", tmp_path / "run.weights.h5")
    copy_a.optimizer.seed = None
    copy_b.optimizer.seed = None
    z_a, z_b = step(copy_a), step(copy_b)
    assert np.linalg.norm(z_a - z_b) / independent_difference_norm() == pytest.approx(1.0, abs=0.05)


def test_fit_refuses_a_seeded_resume_before_its_first_step(tmp_path):
    saved_after_seeded_steps(tmp_path / "run.keras")
    model = _loaded_then_reseeded(tmp_path / "run.keras", None)
    bias = model.trainable_variables[1].numpy().copy()
    x, y = np.zeros((16, 1), "float32"), np.zeros((16, UNITS), "float32")
    with pytest.raises(ValueError, match="allow_resume"):
        model.fit(x, y, batch_size=L, epochs=1, verbose=0)
    np.testing.assert_array_equal(model.trainable_variables[1].numpy(), bias)
    assert int(model.privacy_ledger.steps.numpy()) == 2


def test_a_seed_set_after_the_ledger_moved_is_refused_but_fits_since_step_0_continue():
    model = noise_only_model(SEED)
    first = step(model)
    second = step(model)  # the same key since step 0 continues: a new counter, new noise
    assert abs(correlation(first, second)) < 5 / np.sqrt(UNITS)
    model.optimizer.seed = SEED  # re-keyed at step 2: generation 0 again, a resume of this model's state
    with pytest.raises(ValueError, match="allow_resume"):
        step(model)


def test_in_process_rollback_re_keys_and_a_forward_jump_to_another_runs_file_is_refused(tmp_path):
    # Another run with the same seed, at step 3: its own continuation draws (seed, step 3).
    other = noise_only_model(SEED)
    for _ in range(3):
        step(other)
    other.save_weights(tmp_path / "other.weights.h5")
    model = noise_only_model(SEED)
    step(model)
    model.save_weights(tmp_path / "step1.weights.h5")
    abandoned = step(model)
    model.load_weights(tmp_path / "step1.weights.h5")  # rolled back in this process: re-keyed, not refused
    replayed = step(model)
    assert abs(correlation(abandoned, replayed)) < 5 / np.sqrt(UNITS)
    model.load_weights(tmp_path / "other.weights.h5")  # ahead of what this key drew: a resume
    with pytest.raises(ValueError, match="allow_resume"):
        step(model)


def test_the_opt_in_seeded_resume_is_reproducible_bit_for_bit_and_warns(tmp_path):
    straight = saved_after_seeded_steps(tmp_path / "run.keras")
    expected = [step(straight) for _ in range(2)]
    for _ in range(2):  # resumed twice from one file: the same noise both times (why it voids DP)
        resumed = keras.models.load_model(tmp_path / "run.keras")
        with pytest.warns(UserWarning, match="VOIDS the DP guarantee"):
            resumed.optimizer.set_seed(SEED, allow_resume=True)
        for z_expected in expected:
            np.testing.assert_array_equal(step(resumed), z_expected)


def test_set_seed_arguments_are_checked():
    optimizer = tf_dp.DPSGD(0.1, noise_multiplier=1.0)
    with pytest.raises(TypeError, match="allow_resume"):
        optimizer.set_seed(SEED, allow_resume="yes")
    with pytest.raises(ValueError, match="allow_resume"):
        optimizer.set_seed(None, allow_resume=True)


# -- a callback that rolls the ledger back or sets a seed DURING fit (an attacker's review found the
# guard ran only at the first batch): the guard now runs before every execution of the train function.
def _rollback_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer=tf_dp.DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=1000.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_a_rollback_inside_fit_redraws_no_released_noise(tmp_path):
    """Independent check: the update drawn at step 2 on the first pass and again after a
    mid-fit load_weights (ledger 4 → 2) must carry independent noise: their difference has norm
    ≈ √2·σC·lr/L·√8 ≈ 500 (kernel 4×2), not ≤ 2C·lr/L = 0.25 (the same noise, cancelled)."""
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    path, kernels = str(tmp_path / "at_step_2.weights.h5"), {}

    class Rollback(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            kernels.setdefault(int(self.model.privacy_ledger.steps.numpy()), []).append(
                self.model.get_weights()[0].copy())
            if batch == 1:
                self.model.save_weights(path)
            if batch == 3:
                self.model.load_weights(path)

    model = _rollback_model()
    model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=6, verbose=0, callbacks=[Rollback()])
    first, second = (k - kernels[2][0] for k in kernels[3][:2])
    assert np.linalg.norm(first - second) > 50.0


def test_a_seed_set_by_a_callback_inside_fit_on_a_trained_model_is_refused():
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    model = _rollback_model()
    model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=2, verbose=0)

    class Reseed(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0:
                self.model.optimizer.seed = 2**40 + 7

    before = int(model.privacy_ledger.steps.numpy())
    with pytest.raises(ValueError, match="seeded resume"):
        model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=2, verbose=0, callbacks=[Reseed()])
    assert int(model.privacy_ledger.steps.numpy()) == before
