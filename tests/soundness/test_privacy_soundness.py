"""What a released artifact contains, and whether the ledger records what ran.

Each test compares with an independent computation (the bytes of the saved files,
dp_accounting directly, a hand-computed worst case) and failed on the code before the fix.
"""

import os
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf
from dp_accounting import dp_event

import tf_dp
from tf_dp.accounting import epsilon_of_event

FEATURES, CLASSES, N = 6, 3, 200


def data(n=N):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, FEATURES)).astype("float32"), rng.integers(0, CLASSES, n).astype("int32")


def model_with(optimizer, **compile_kwargs):
    inputs = keras.Input((FEATURES,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(CLASSES)(inputs))
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  **compile_kwargs)
    return model


def noise_only_model(units=4000):
    """Zero inputs and an MSE target equal to the prediction: every gradient is 0, so an update is pure noise."""
    inputs = keras.Input((1,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(units, kernel_initializer="zeros")(inputs))
    return model, np.zeros((8, 1), "float32"), np.zeros((8, units), "float32")


def bias(model):
    return model.trainable_variables[1].numpy().copy()


def files_under(path):
    if os.path.isfile(path):
        return [path]
    return [os.path.join(root, name) for root, _, names in os.walk(path) for name in names]


def artifact_bytes(path) -> bytes:
    """Every byte a user could share: the files, and the members of zip files (.keras)."""
    chunks = []
    for name in files_under(path):
        with open(name, "rb") as f:
            chunks.append(f.read())
        if zipfile.is_zipfile(name):
            with zipfile.ZipFile(name) as archive:
                chunks += [archive.read(member) for member in archive.namelist()]
    return b"".join(chunks)


# ------------------------------------------------------------------ §1 noise key
@pytest.mark.parametrize("seed", [None, 987654321123])
def test_no_artifact_contains_the_noise_key_or_seed(tmp_path, seed):
    x, y = data()
    model = model_with(tf_dp.DPSGD(0.1, noise_multiplier=1.0, seed=seed))
    model.fit(x, y, batch_size=20, epochs=1, verbose=0, sampling_seed=424242424242)
    key = int(model.optimizer._noise_key().numpy())
    model.save(tmp_path / "model.keras")
    model.save_weights(tmp_path / "model.weights.h5")
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(str(tmp_path / "checkpoint" / "ckpt"))
    model.export(str(tmp_path / "saved_model"), verbose=False)
    blob = artifact_bytes(str(tmp_path))
    for secret in {key, seed, 424242424242} - {None}:
        assert np.int64(secret).tobytes() not in blob, f"{secret} found as int64"
        assert str(secret).encode() not in blob, f"{secret} found as text"
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert loaded.optimizer.seed is None
    assert int(loaded.optimizer._noise_key().numpy()) != key  # a resumed run draws a fresh key


def test_a_seed_passed_again_reproduces_the_noise():
    model, x, y = noise_only_model()
    model.compile(optimizer=tf_dp.DPSGD(1.0, noise_multiplier=1.0, seed=5), loss="mse")
    twin, _, _ = noise_only_model()
    twin.compile(optimizer=tf_dp.DPSGD(1.0, noise_multiplier=1.0), loss="mse")
    twin.optimizer.seed = 5
    model.train_on_batch(x, y, batch_size=8)
    twin.train_on_batch(x, y, batch_size=8)
    np.testing.assert_array_equal(bias(model), bias(twin))


# ------------------------------------------------------------ §8 noise counter
def _correlation(a, b):
    return float(np.corrcoef(a.ravel(), b.ravel())[0, 1])


def seeded_on_a_trained_model(seed):
    """A new optimizer keyed by ``seed`` for a model that has trained: refused unless opted in."""
    optimizer = tf_dp.DPSGD(1.0, noise_multiplier=1.0)
    with pytest.warns(UserWarning, match="VOIDS"):
        optimizer.set_seed(seed, allow_resume=True)
    return optimizer


def test_a_recompile_with_the_same_seed_draws_new_noise():
    model, x, y = noise_only_model()
    model.compile(optimizer=tf_dp.DPSGD(1.0, noise_multiplier=1.0, seed=11), loss="mse")
    start = bias(model)
    model.train_on_batch(x, y, batch_size=8)
    first = bias(model) - start
    model.compile(optimizer=seeded_on_a_trained_model(11), loss="mse")
    start = bias(model)
    model.train_on_batch(x, y, batch_size=8)
    second = bias(model) - start
    # Independent normals: the sample correlation of n = 4000 pairs has sd 1/sqrt(n) ≈ 0.016.
    assert abs(_correlation(first, second)) < 5 / np.sqrt(first.size)


def test_gradient_accumulation_micro_steps_draw_independent_noise():
    model, x, y = noise_only_model()
    model.compile(optimizer=tf_dp.DPSGD(1.0, noise_multiplier=1.0, seed=3, gradient_accumulation_steps=2),
                  loss="mse")
    start = bias(model)
    model.train_on_batch(x, y, batch_size=8)
    first_noise = -model.optimizer._accumulated_gradients[1].numpy()  # ĝ₁ (accumulated, not yet applied)
    model.train_on_batch(x, y, batch_size=8)
    update = bias(model) - start  # −(ĝ₁ + ĝ₂)/2
    second_noise = 2 * update - first_noise
    assert int(model.privacy_ledger.steps.numpy()) == 2
    assert abs(_correlation(first_noise, -second_noise)) < 5 / np.sqrt(update.size)


# ------------------------------------------------------- §3 explicit batches
def _linear_model(clip=1.0, sigma=0.0, seed=0):
    """θ ∈ R², ℓ_i = −y_i (θ·x_i): the per-example gradient is −y_i x_i."""
    inputs = keras.Input((2,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")(inputs))
    model.compile(optimizer=tf_dp.DPSGD(1.0, l2_norm_clip=clip, noise_multiplier=sigma, seed=seed),
                  loss=lambda y_true, y_pred: -y_true[:, 0] * y_pred[:, 0])
    return model


def _neighbours():
    """D: ten gradients −e₁ of norm C = 1; D' = D plus one example whose gradient (+100e₁) clips to +e₁."""
    x = np.tile([[1.0, 0.0]], (10, 1)).astype("float32")
    y = np.ones((10, 1), "float32")
    return (x, y), (np.vstack([x, [[100.0, 0.0]]]).astype("float32"), np.vstack([y, [[-1.0]]]).astype("float32"))


@pytest.mark.parametrize("sigma", [0.0, 1.0])
def test_explicit_batch_step_is_the_accounted_gaussian_mechanism_in_the_worst_case(sigma):
    """Neighbouring batches (add one example) through train_on_batch with the declared L = 10:
    the released weights differ by at most C/L, with the SAME noise (same key and counter),
    so the step is a Gaussian mechanism of sensitivity ≤ C/L and std σC/L — what the ledger
    accounts. Dividing by the realized size moved it by 2C/11 and rescaled the noise."""
    (x, y), (x_added, y_added) = _neighbours()
    released = []
    for batch in ((x, y), (x_added, y_added)):
        model = _linear_model(sigma=sigma, seed=8)
        model.train_on_batch(*batch, batch_size=10)
        released.append(model.trainable_variables[0].numpy().ravel())
    shift = np.linalg.norm(released[1] - released[0])
    assert shift <= 1.0 / 10 * (1 + 1e-5)
    assert shift == pytest.approx(0.1, rel=1e-5)  # the worst case is attained: the bound is tight
    if sigma:
        expected = epsilon_of_event(dp_event.GaussianDpEvent(sigma), 1e-5)
        assert model.get_epsilon() == pytest.approx(expected)


def test_a_short_last_batch_is_divided_by_the_declared_size():
    (x, y), (x_added, y_added) = _neighbours()
    model = _linear_model()
    dataset = tf.data.Dataset.from_tensor_slices((x_added, y_added)).batch(10)  # batches of 10 and 1
    with pytest.warns(UserWarning, match="BATCHED"):
        model.fit(dataset, epochs=1, verbose=0)
    # Σ of clipped gradients over both steps: −10e₁ + e₁, each divided by L = 10.
    np.testing.assert_allclose(model.trainable_variables[0].numpy().ravel(), [0.9, 0.0], atol=1e-6)
    assert model.privacy_ledger.phases()[0].expected_batch_size == 10


# ------------------------------------------------------ §4 σ changed mid-epoch
class ChangeSigma(keras.callbacks.Callback):
    def __init__(self, at_batch, sigma):
        super().__init__()
        self.at_batch, self.sigma = at_batch, sigma

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.at_batch:
            self.model.optimizer.noise_multiplier = self.sigma


def test_sigma_changed_by_a_callback_mid_epoch_is_what_the_ledger_composes():
    x, y = data()
    model = model_with(tf_dp.DPSGD(0.1, noise_multiplier=2.0, seed=1))
    model.fit(x, y, batch_size=25, epochs=1, verbose=0, callbacks=[ChangeSigma(3, 0.5)])  # 8 steps
    q = 25 / N
    ran = dp_event.ComposedDpEvent([
        dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(2.0)), 3),
        dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(0.5)), 5),
    ])
    assert [(p.noise_multiplier, p.steps) for p in model.privacy_ledger.phases()] == [(2.0, 3), (0.5, 5)]
    assert model.get_epsilon() == pytest.approx(epsilon_of_event(ran, 1e-5), rel=1e-9)


# --------------------------------------------------- §7 budgets never overshoot
def _largest_steps_within(epsilon, q, sigma, delta=1e-5):
    step = dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma))
    steps = 0
    while epsilon_of_event(dp_event.SelfComposedDpEvent(step, steps + 1), delta) <= epsilon:
        steps += 1
    return steps


def test_privacy_budget_holds_with_steps_per_execution():
    x, y = data()
    sigma, q = 1.0, 25 / N
    budget = epsilon_of_event(dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), 5), 1e-5) * 1.0001
    allowed = _largest_steps_within(budget, q, sigma)
    assert allowed == 5
    model = model_with(tf_dp.DPSGD(0.1, noise_multiplier=sigma, seed=1), steps_per_execution=4)
    model.fit(x, y, batch_size=25, epochs=2, verbose=0, callbacks=[tf_dp.PrivacyBudget(budget)])
    assert int(model.privacy_ledger.steps.numpy()) == allowed
    assert model.get_epsilon() <= budget


def test_budget_blocks_steps_after_a_callback_lowers_sigma():
    """σ lowered by a callback inside a 4-step execution: the ledger composes both σ, and
    exactly as many steps run at the new σ as the budget allows (dp_accounting directly)."""
    x, y = data()
    q, budget = 25 / N, 3.0
    model = model_with(tf_dp.DPSGD(0.1, noise_multiplier=2.0, seed=1), steps_per_execution=4)
    model.fit(x, y, batch_size=25, epochs=4, verbose=0,
              callbacks=[tf_dp.PrivacyBudget(budget), ChangeSigma(4, 1.2)])
    step = lambda sigma: dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma))  # noqa: E731

    def epsilon(low_sigma_steps):
        return epsilon_of_event(dp_event.ComposedDpEvent([dp_event.SelfComposedDpEvent(step(2.0), 4),
                                                          dp_event.SelfComposedDpEvent(step(1.2), low_sigma_steps)]),
                                1e-5)

    allowed = 0
    while epsilon(allowed + 1) <= budget:
        allowed += 1
    assert 0 < allowed < 28  # the budget binds before the 32 planned steps
    phases = [(p.noise_multiplier, p.steps) for p in model.privacy_ledger.phases()]
    assert phases == [(2.0, 4), (pytest.approx(1.2, rel=1e-6), allowed)]
    assert model.get_epsilon() == pytest.approx(epsilon(allowed), rel=1e-6) and model.get_epsilon() <= budget


def test_a_budget_that_never_binds_is_computed_once_and_still_checks_sigma(monkeypatch):
    """A budget far above what the run spends: its step search runs once per σ (not at
    every batch), and the step still refuses a σ the search was not run for."""
    from tf_dp.accounting import callbacks

    searches = []
    search = callbacks._max_total_steps
    monkeypatch.setattr(callbacks, "_max_total_steps", lambda *a: searches.append(1) or search(*a))
    allowed = []
    probe = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: allowed.append(
        [float(model.step_limit.allows(tf.constant(0, tf.int64), tf.constant(s))) for s in (2.0, 1.0)]))
    x, y = data()
    model = model_with(tf_dp.DPSGD(0.1, noise_multiplier=2.0, seed=1))
    model.fit(x, y, batch_size=25, epochs=2, verbose=0, callbacks=[tf_dp.PrivacyBudget(1e12), probe])
    assert int(model.privacy_ledger.steps.numpy()) == 2 * N // 25
    assert len(searches) == 1
    assert allowed == [[1.0, 0.0]] * (2 * N // 25)


def test_target_epsilon_is_never_exceeded_with_steps_per_execution():
    x, y = data()
    model = model_with(tf_dp.DPSGD(0.1, seed=1), target_epsilon=2.0, steps_per_execution=3)
    model.fit(x, y, batch_size=25, epochs=2, verbose=0)
    assert 0 < model.get_epsilon() <= 2.0


# ------------------------------------------------------------ §10 what logs reveal
def test_private_logs_show_only_epsilon_and_validation_metrics():
    x, y = data()
    x[0] = np.nan  # a NaN canary: its non-finite gradient must not show in any log
    model = model_with(tf_dp.DPSGD(0.1, noise_multiplier=1.0, seed=1), metrics=["accuracy"], private_logs=True)
    history = model.fit(x, y, batch_size=50, epochs=2, verbose=0, validation_data=data(40))
    keys = set(history.history)
    assert "epsilon" in keys and "val_loss" in keys and "val_accuracy" in keys
    assert not keys & {"loss", "accuracy", "nonfinite_examples"}, keys
    assert {k for k in keys if not k.startswith("val_")} <= {"epsilon", "noise_std"}


# ------------------------------------------- found by the adversarial review
def test_train_on_batch_warns_when_it_takes_the_first_batch_size_as_the_denominator():
    """Undeclared: the first batch's size becomes the phase's constant L (with a warning);
    a later batch of another size is still divided by it, never by its own size."""
    model = _linear_model()
    (x, y), (x_added, y_added) = _neighbours()
    with pytest.warns(UserWarning, match="batch_size"):
        model.train_on_batch(x, y)
    model.train_on_batch(x_added[-1:], y_added[-1:])  # one row: its clipped gradient +e₁ over L = 10
    np.testing.assert_allclose(model.trainable_variables[0].numpy().ravel(), [0.9, 0.0], atol=1e-6)


def test_rolling_the_ledger_back_re_keys_the_noise(tmp_path):
    """load_weights of an older file (or BackupAndRestore) rolls the ledger back while the
    key stays in memory: the next steps must not repeat the noise of the abandoned ones."""
    model, x, y = noise_only_model()
    model.compile(optimizer=tf_dp.DPSGD(1.0, noise_multiplier=1.0), loss="mse")
    model.train_on_batch(x, y, batch_size=8)
    model.save_weights(tmp_path / "old.weights.h5")
    start = bias(model)
    model.train_on_batch(x, y)
    abandoned = bias(model) - start
    model.load_weights(tmp_path / "old.weights.h5")
    assert int(model.privacy_ledger.steps.numpy()) == 1
    start = bias(model)
    model.train_on_batch(x, y)
    replayed = bias(model) - start
    assert abs(_correlation(abandoned, replayed)) < 5 / np.sqrt(abandoned.size)


def test_fewer_trainable_variables_after_a_recompile_never_reuse_a_draw():
    inputs = keras.Input((1,))
    hidden = keras.layers.Dense(2000, kernel_initializer="zeros", name="first")
    out = keras.layers.Dense(2000, kernel_initializer="zeros", name="second")
    model = tf_dp.DPModel(inputs, out(hidden(inputs)))
    x, y = np.zeros((8, 1), "float32"), np.zeros((8, 2000), "float32")
    model.compile(optimizer=tf_dp.DPSGD(1.0, noise_multiplier=1.0, seed=2**40 + 3), loss="mse")
    start = out.bias.numpy().copy()
    model.train_on_batch(x, y, batch_size=8)
    first = out.bias.numpy() - start
    model.train_on_batch(x, y)
    hidden.trainable = False  # variable indices shift: the counters of later steps must still be new
    model.compile(optimizer=seeded_on_a_trained_model(2**40 + 3), loss="mse")
    start = out.bias.numpy().copy()
    model.train_on_batch(x, y, batch_size=8)
    third = out.bias.numpy() - start
    assert abs(_correlation(first, third)) < 5 / np.sqrt(first.size)


def test_make_private_twice_continues_one_ledger():
    inputs = keras.Input((FEATURES,))
    base = keras.Model(inputs, keras.layers.Dense(CLASSES)(inputs))
    x, y = data()
    first = tf_dp.make_private(base)
    first.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0),
                   loss=keras.losses.SparseCategoricalCrossentropy(True))
    first.fit(x, y, batch_size=20, epochs=1, verbose=0)
    second = tf_dp.make_private(base)
    assert second.privacy_ledger is first.privacy_ledger
    second.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0),
                    loss=keras.losses.SparseCategoricalCrossentropy(True))
    second.fit(x, y, batch_size=20, epochs=1, verbose=0)
    assert int(second.privacy_ledger.steps.numpy()) == 20


def test_the_nonfinite_count_is_in_no_checkpoint_and_not_counted_with_private_logs(tmp_path):
    x, y = data()
    x[0] = np.inf
    model = model_with(tf_dp.DPSGD(0.1, noise_multiplier=1.0), private_logs=True)
    model.fit(x, y, batch_size=N, epochs=1, verbose=0)
    assert float(model.nonfinite_examples.numpy()) == 0.0
    path = tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
    names = [name for name, _ in tf.train.list_variables(path)]
    assert not any("nonfinite" in name for name in names), names


class RunningMean(keras.layers.Layer):
    """Normalizes by a running mean of the batches it has seen: private state, released un-noised."""

    def build(self, input_shape):
        self.mean = self.add_weight(shape=input_shape[1:], initializer="zeros", trainable=False)

    def call(self, inputs, training=False):
        if training:
            self.mean.assign(0.9 * self.mean + 0.1 * keras.ops.mean(inputs, axis=0))
        return inputs - self.mean


def test_a_layer_updating_state_from_the_batch_is_refused():
    x, y = data()
    inputs = keras.Input((FEATURES,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(CLASSES)(RunningMean()(inputs)))
    model.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0),
                   loss=keras.losses.SparseCategoricalCrossentropy(True))
    with pytest.raises(ValueError, match="non-trainable state"):
        model.fit(x, y, batch_size=20, epochs=1, verbose=0)


def test_a_guessable_seed_is_warned_about():
    with pytest.warns(UserWarning, match="guess"):
        tf_dp.DPSGD(0.1, noise_multiplier=1.0, seed=0)


def test_a_repeated_dataset_is_refused():
    """repeat(3) of 100 rows was accounted as N = 300 (found by the adversarial review)."""
    x, y = data(100)
    model = model_with(tf_dp.DPSGD(0.1, noise_multiplier=1.0))
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).map(lambda a, b: (a, b)).repeat(3)
    with pytest.raises(ValueError, match="repeat"):
        model.fit(dataset, batch_size=10, epochs=1, verbose=0)
