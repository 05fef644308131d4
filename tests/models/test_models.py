"""DPModel end to end: Poisson fit, ledger/accountant agreement, saving, errors."""


import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.harness import reference_steps, sparse_ce
from tf_dp.accounting import compute_epsilon

N, FEATURES, CLASSES = 200, 6, 3


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, FEATURES)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 1).astype("int32")
    return x, y


def functional(sigma=1.0, seed=0, learning_rate=0.2, **compile_kwargs):
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    model = tf_dp.DPModel(inputs, keras.layers.Dense(CLASSES)(hidden))
    model.compile(optimizer=tf_dp.DPSGD(learning_rate, l2_norm_clip=1.0, noise_multiplier=sigma, seed=seed),
                  loss=sparse_ce, metrics=["accuracy"], **compile_kwargs)
    return model


def test_fit_reports_epsilon_that_matches_the_accountant():
    x, y = data()
    model = functional(sigma=1.3)
    history = model.fit(x, y, batch_size=20, epochs=2, verbose=0)
    steps = 2 * 10  # ⌈N/L⌉ = 10 steps per epoch
    phase = model.privacy_ledger.phases()[0]
    assert (phase.scheme, phase.steps, phase.num_examples) == ("poisson", steps, N)
    assert phase.sampling_rate == pytest.approx(20 / N)
    assert phase.noise_multiplier == pytest.approx(1.3)
    expected = compute_epsilon(N, 20, model.optimizer.noise_multiplier, steps=steps, delta=1e-5)
    assert history.history["epsilon"][-1] == pytest.approx(expected, rel=1e-9)
    assert history.history["epsilon"][0] < history.history["epsilon"][1]
    assert model.get_epsilon() == pytest.approx(expected, rel=1e-9)


def test_fit_learns_without_noise_and_accepts_unbatched_dataset():
    keras.utils.set_random_seed(0)  # weight init; seeds 0-3 reach 0.88-0.93 (unseeded it once gave 0.78)
    x, y = data()
    model = functional(sigma=0.0, learning_rate=1.0)
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    model.fit(dataset, batch_size=20, epochs=10, verbose=0, sampling_seed=0)
    assert model.evaluate(x, y, verbose=0)[1] > 0.8  # a 3-class problem: chance is < 0.5
    assert model.privacy_ledger.phases()[0].scheme == "poisson"


def test_batched_dataset_is_accounted_without_amplification_and_warns():
    x, y = data()
    model = functional(sigma=1.0)
    with pytest.warns(UserWarning, match="BATCHED"):
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(20), epochs=1, verbose=0)
    phase = model.privacy_ledger.phases()[0]
    assert phase.scheme == "batches" and phase.steps == 10
    assert model.get_epsilon() > 3 * compute_epsilon(N, 20, 1.0, steps=10)


def test_save_and_load_keeps_optimizer_state_ledger_and_continues_identically():
    x, y = data()
    model = tf_dp.DPSequential([keras.Input((FEATURES,)), keras.layers.Dense(CLASSES)])
    model.compile(optimizer=tf_dp.DPAdamW(0.01, noise_multiplier=1.0, seed=3, noise_bias_correction=True),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), accountant="pld", delta=1e-4)
    model.fit(x, y, batch_size=20, epochs=1, verbose=0)
    path = f"{pytest.importorskip('tempfile').mkdtemp()}/model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, tf_dp.DPSequential) and isinstance(loaded.optimizer, tf_dp.DPAdamW)
    assert loaded.privacy_settings["accountant"] == "pld" and loaded.privacy_settings["delta"] == 1e-4
    assert int(loaded.privacy_ledger.steps.numpy()) == 10
    assert loaded.get_epsilon() == pytest.approx(model.get_epsilon())
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert loaded.optimizer.seed is None  # the seed is a secret: not in the file
    with pytest.warns(UserWarning, match="VOIDS"):  # a seeded resume: a lab run's explicit opt-in
        loaded.optimizer.set_seed(3, allow_resume=True)
    batch = x[:8], y[:8]
    model.train_on_batch(*batch, batch_size=8)
    loaded.train_on_batch(*batch, batch_size=8)
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_set_weights_cannot_reset_the_ledger():
    x, y = data()
    model = functional()
    model.fit(x, y, batch_size=20, epochs=1, verbose=0)
    fresh = functional()
    model.set_weights(fresh.get_weights())
    assert int(model.privacy_ledger.steps.numpy()) == 10


def test_make_private_shares_layers_and_weights():
    inputs = keras.Input((FEATURES,))
    plain = keras.Model(inputs, keras.layers.Dense(CLASSES)(inputs))
    private = tf_dp.make_private(plain)
    assert isinstance(private, tf_dp.DPModel)
    assert [id(v) for v in private.trainable_variables] == [id(v) for v in plain.trainable_variables]
    private.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=0.5), loss=sparse_ce)
    before = plain.get_weights()[0].copy()
    private.train_on_batch(*[a[:10] for a in data()], batch_size=10)
    assert not np.allclose(plain.get_weights()[0], before)


def test_subclassed_dp_model_trains():
    class Net(tf_dp.DPModel):
        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(8, activation="relu")
            self.out = keras.layers.Dense(CLASSES)

        def call(self, inputs):
            return self.out(self.hidden(inputs))

    x, y = data()
    model = Net()
    model.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0), loss=sparse_ce)
    model.fit(x, y, batch_size=20, epochs=1, verbose=0)
    assert int(model.privacy_ledger.steps.numpy()) == 10
    assert not isinstance(tf_dp.DPModel.__mro__, type(keras.Model)) and "Functional" not in [
        c.__name__ for c in tf_dp.DPModel.__mro__
    ]


def test_xla_step_matches_graph_step():
    """Clipping is identical under XLA. (XLA's Philox kernel draws a different stream from
    the same seed; the noise statistics under XLA are tested in test_optimizers.)"""
    x, y = data()
    graph, xla = functional(sigma=0.0, seed=9), functional(sigma=0.0, seed=9, jit_compile=True)
    xla.set_weights(graph.get_weights())
    for model in (graph, xla):
        model.train_on_batch(x[:16], y[:16], batch_size=16)
    for a, b in zip(graph.get_weights(), xla.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_target_epsilon_calibrates_sigma_and_stops_at_budget():
    x, y = data()
    model = functional(sigma=None, target_epsilon=2.0, delta=1e-4)
    model.fit(x, y, batch_size=20, epochs=3, verbose=0)
    assert model.optimizer.noise_multiplier > 0
    assert model.get_epsilon() <= 2.0
    assert model.get_epsilon() > 1.9  # calibrated to the budget, not far below it
    model.fit(x, y, batch_size=20, epochs=1, verbose=0)  # the little budget left: huge σ
    assert model.get_epsilon() <= 2.0
    with pytest.raises(ValueError, match="already spent"):
        model.fit(x, y, batch_size=20, epochs=1, verbose=0, callbacks=[tf_dp.PrivacyBudget(model.get_epsilon())])


def test_budget_callback_stops_before_exceeding():
    x, y = data()
    model = functional(sigma=1.0)
    budget = compute_epsilon(N, 20, model.optimizer.noise_multiplier, steps=15)
    model.fit(x, y, batch_size=20, epochs=5, verbose=0, callbacks=[tf_dp.PrivacyBudget(budget)])
    assert int(model.privacy_ledger.steps.numpy()) == 15
    assert model.get_epsilon() <= budget


def test_bad_inputs_are_refused_with_named_errors():
    x, y = data()
    model = functional()
    with pytest.raises(ValueError, match="batch_size"):
        model.fit(x, y, batch_size=N + 1, epochs=1, verbose=0)
    with pytest.raises(TypeError, match="RaggedTensor"):
        model.fit(tf.ragged.constant([[1.0], [1.0, 2.0]]), y[:2], batch_size=1, verbose=0)
    with pytest.raises(ValueError, match="delta"):
        functional(delta=1.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        functional(sigma=None).fit(x, y, batch_size=20, verbose=0)
    inputs = keras.Input((FEATURES,))
    with_bn = tf_dp.DPModel(inputs, keras.layers.BatchNormalization()(keras.layers.Dense(3)(inputs)))
    with pytest.raises(ValueError, match="GroupNormalization"):
        with_bn.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0), loss=sparse_ce)


def test_import_is_quiet(tmp_path):
    import subprocess
    import sys

    env = {"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    result = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", "import tf_dp"], capture_output=True,
                            text=True, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert "tf_dp" not in result.stderr


def test_validate_lists_problems_and_fix_replaces_batch_norm(capsys):
    inputs = keras.Input((8, 8, 3))
    hidden = keras.layers.Conv2D(6, 3, activation="relu")(inputs)
    hidden = keras.layers.BatchNormalization()(hidden)
    outputs = keras.layers.Dense(CLASSES)(keras.layers.Flatten()(hidden))
    model = keras.Model(inputs, outputs)
    problems = tf_dp.validate(model)
    assert len(problems) == 1 and "BatchNormalization" in problems[0]
    fixed = tf_dp.fix(model)
    assert tf_dp.validate(fixed) == [] and "replaced BatchNormalization" in capsys.readouterr().out
    assert any(isinstance(layer, keras.layers.GroupNormalization) for layer in fixed.layers)
    np.testing.assert_array_equal(fixed.layers[1].get_weights()[0], model.layers[1].get_weights()[0])
    private = tf_dp.make_private(fixed)
    private.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0), loss=sparse_ce)
    private.train_on_batch(np.zeros((4, 8, 8, 3), "float32"), np.zeros(4, "int32"), batch_size=4)
    rnn = keras.Sequential([keras.Input((3, 2), batch_size=4), keras.layers.SimpleRNN(2, stateful=True)])
    assert any("stateful" in p for p in tf_dp.validate(rnn))


def test_nonfinite_examples_are_counted_in_logs_and_do_not_poison_weights():
    x, y = data()
    x = x.copy()
    x[:5, 0] = np.inf
    model = functional(sigma=0.5)
    history = model.fit(x, y, batch_size=20, epochs=1, verbose=0, sampling_seed=0)
    assert history.history["nonfinite_examples"][0] > 0
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_secure_mode_refuses_seeds_and_draws_unreproducible_noise():
    with pytest.raises(ValueError, match="secure_mode"):
        tf_dp.DPSGD(0.1, noise_multiplier=1.0, seed=1, secure_mode=True)
    x, y = data()
    weights = []
    for _ in range(2):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((FEATURES,))
        model = tf_dp.DPModel(inputs, keras.layers.Dense(CLASSES)(inputs))
        model.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0, secure_mode=True), loss=sparse_ce)
        model.fit(x, y, batch_size=20, epochs=1, verbose=0)
        weights.append(model.get_weights()[0])
    assert not np.allclose(weights[0], weights[1])
    with pytest.raises(ValueError, match="XLA"):
        model.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0, secure_mode=True), loss=sparse_ce,
                      jit_compile=True)
    model.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0, secure_mode=True), loss=sparse_ce)
    with pytest.raises(ValueError, match="sampling_seed"):
        model.fit(x, y, batch_size=20, epochs=1, verbose=0, sampling_seed=3)


def test_changed_sigma_between_fits_is_composed():
    x, y = data()
    model = functional(sigma=1.0)
    model.fit(x, y, batch_size=20, epochs=1, verbose=0)
    model.optimizer.noise_multiplier = 2.0
    model.fit(x, y, batch_size=40, epochs=1, verbose=0)
    phases = model.privacy_ledger.phases()
    assert [(p.noise_multiplier, p.sampling_rate, p.steps) for p in phases] == [(1.0, 0.1, 10), (2.0, 0.2, 5)]
    alone = compute_epsilon(N, 20, 1.0, steps=10)
    assert model.get_epsilon() > alone


def test_large_delta_warns_and_budget_stop_saves_the_model(tmp_path):
    x, y = data()
    model = functional(sigma=1.0, delta=0.01)  # 0.01 >= 1/200
    budget = compute_epsilon(N, 20, model.optimizer.noise_multiplier, steps=12, delta=0.01)
    path = str(tmp_path / "stopped.keras")
    with pytest.warns(UserWarning, match="delta"):
        history = model.fit(x, y, batch_size=20, epochs=3, verbose=0,
                            callbacks=[tf_dp.PrivacyBudget(budget, save_path=path)])
    assert int(model.privacy_ledger.steps.numpy()) == 12
    assert keras.models.load_model(path, compile=False).privacy_ledger.steps.numpy() == 12
    assert "noise_std" in history.history
    assert history.history["noise_std"][0] == pytest.approx(model.optimizer.noise_multiplier * 1.0 / 20, rel=1e-6)


def test_mixed_bfloat16_clips_in_float32_and_float16_is_refused():
    from tf_dp.clipping import clipped_gradient_sum

    x, y = data()
    norms = {}
    for policy in ("float32", "mixed_bfloat16"):
        keras.config.set_dtype_policy(policy)
        try:
            keras.utils.set_random_seed(0)
            inputs = keras.Input((FEATURES,))
            model = tf_dp.DPModel(inputs, keras.layers.Dense(CLASSES, dtype="float32")(
                keras.layers.Dense(8, activation="relu")(inputs)))
            result = clipped_gradient_sum(model, sparse_ce, tf.constant(x[:16]), tf.constant(y[:16]), tf.ones(16), 1.0)
            assert all(g.dtype == tf.float32 for g in result.clipped_sums)
            norms[policy] = np.sqrt(result.squared_norms.numpy())
            model.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0, seed=0), loss=sparse_ce)
            model.fit(x, y, batch_size=20, epochs=1, verbose=0)
            assert all(np.isfinite(w).all() for w in model.get_weights())
            if policy == "mixed_bfloat16":  # an output layer left in bfloat16 (bfloat16 logits and losses)
                low = tf_dp.DPModel(inputs, keras.layers.Dense(CLASSES)(inputs))
                low.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0, seed=0), loss=sparse_ce,
                            metrics=["accuracy"])
                history = low.fit(x, y, batch_size=20, epochs=1, verbose=0)
                assert np.isfinite(history.history["loss"][-1])
        finally:
            keras.config.set_dtype_policy("float32")
    # bfloat16 keeps 8 mantissa bits (unit roundoff 0.4 %): typical per-example norms agree
    # to ~1 %, but rounding can flip a ReLU whose pre-activation is near 0, moving single
    # examples more; so the median must be tight and none may be off by 2x (a wrong dtype
    # path, e.g. gradients of the wrong point or scale, would be off for all examples).
    relative = np.abs(norms["mixed_bfloat16"] / norms["float32"] - 1)
    assert np.median(relative) < 0.03 and relative.max() < 0.5
    keras.config.set_dtype_policy("mixed_float16")
    try:
        inputs = keras.Input((FEATURES,))
        model = tf_dp.DPModel(inputs, keras.layers.Dense(CLASSES)(inputs))
        with pytest.raises(ValueError, match="mixed_bfloat16"):
            model.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0), loss=sparse_ce)
    finally:
        keras.config.set_dtype_policy("float32")


@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_fit_trains_step_t_on_the_batch_of_step_t_across_epochs_and_fit_calls(steps_per_execution):
    # 2 fit calls of 2 epochs x 2 steps with the SAME sampling_seed equal train_step on the
    # batches of steps 0..7 of one seeded stream: Keras' iterator handling never shifts the
    # stream, and a second fit call does not replay the first call's batches.
    from tf_dp.models.data import poisson_dataset

    x, y = data()
    fitted, stepped = functional(sigma=0.0, steps_per_execution=steps_per_execution), functional(sigma=0.0)
    stepped.set_weights(fitted.get_weights())
    for _ in range(2):
        fitted.fit(x, y, batch_size=16, epochs=2, steps_per_epoch=2, sampling_seed=4, verbose=0)
    stepped._prebuild(x, y)
    with reference_steps(stepped):
        for batch in poisson_dataset(x, y, N, 16, None, seed=4).take(8):
            stepped.train_step(batch)
    assert int(fitted.privacy_ledger.steps.numpy()) == 8
    for a, b in zip(fitted.get_weights(), stepped.get_weights()):  # compiled vs eager float32 rounding only;
        np.testing.assert_allclose(a, b, atol=1e-6)  # a shifted batch moves weights by ~1e-2
