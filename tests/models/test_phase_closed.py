"""No DP step outside an open phase (issue 31, item 3; docs/algorithms.md A.2).

The phase ``fit``/``train_on_batch`` open closes when they return. A loop of one's own that
calls ``model.train_step`` afterwards — eagerly, in its own ``tf.function``, or through Keras'
cached ``model.train_function`` — used to run DP steps the ledger recorded as Poisson steps of
the fit's phase (reported ε 4.57 where dp_accounting gives 19.15), joined BandMF's cyclic-Poisson
segment, and skipped the noise-key guard (a rolled-back or re-seeded model redrew released
noise, correlation 1.000000). Such a step is now refused on the host before anything is
released. Each test compares with what ran: the weights and the ledger before the refused
calls, ε by dp_accounting directly. Every test here failed on 703c7ba (the loop ran).
"""

import contextlib
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from dp_accounting import dp_event
from dp_accounting.rdp import RdpAccountant

import tf_dp
from tf_dp.accounting.accountant import RDP_ORDERS
from tf_dp.noise import BandMF

N, L, FEATURES, CLASSES, SIGMA, DELTA, BANDS = 240, 12, 6, 3, 1.0, 1e-5, 4
FIT_STEPS, LOOP_CALLS = 4, 40
REFUSED = r"outside fit\(\)/train_on_batch\(\)"


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, FEATURES)).astype("float32"), rng.integers(0, CLASSES, N).astype("int32")


def model(noise="gaussian", jit_compile=False, seed=None, **compile_options):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    dp = tf_dp.DPModel(inputs, keras.layers.Dense(CLASSES)(inputs))
    noise = BandMF(BANDS) if noise == "bandmf" else None
    dp.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=SIGMA, noise=noise, seed=seed),
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), delta=DELTA,
               jit_compile=jit_compile, **compile_options)
    return dp


def fixed_batch():
    x, y = data()
    return tf.constant(x[:L]), tf.constant(y[:L])


def dp_accounting_epsilon(*events) -> float:
    """ε of the composition of ``(event, count)`` pairs by dp_accounting's RDP accountant."""
    accountant = RdpAccountant(RDP_ORDERS)
    accountant.compose(dp_event.ComposedDpEvent([dp_event.SelfComposedDpEvent(e, k) for e, k in events]))
    return accountant.get_epsilon(DELTA)


def poisson_gaussian(rate):
    return dp_event.PoissonSampledDpEvent(rate, dp_event.GaussianDpEvent(float(np.float32(SIGMA))))


def state(dp) -> tuple:
    """What a released step changes: the weights, the optimizer's iterations, the ledger."""
    return ([w.copy() for w in dp.get_weights()], int(dp.optimizer.iterations.numpy()),
            [(p.scheme, p.steps) for p in dp.privacy_ledger.phases()], int(dp.privacy_ledger.steps.numpy()))


def assert_unchanged(dp, before):
    weights, iterations, phases, steps = state(dp)
    for a, b in zip(before[0], weights):
        np.testing.assert_array_equal(a, b)
    assert (iterations, phases, steps) == before[1:]


def loops_of_ones_own(dp):
    """The three ways a loop of one's own reaches the step, each on one fixed batch."""
    batch = fixed_batch()
    traced = tf.function(dp.train_step)
    batches = iter(tf.data.Dataset.from_tensors(batch).repeat())
    return {"tf.function(model.train_step)": lambda: traced(batch),
            "model.train_step eagerly": lambda: dp.train_step(batch),
            "model.train_function": lambda: dp.train_function(batches)}


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("noise", ["gaussian", "bandmf"])
def test_a_loop_of_ones_own_after_fit_is_refused_and_releases_nothing(noise, jit_compile):
    x, y = data()
    dp = model(noise, jit_compile)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dp.fit(x, y, batch_size=L, steps_per_epoch=FIT_STEPS, epochs=1, verbose=0)
    before, epsilon = state(dp), dp.get_epsilon()
    scheme = "cyclic_poisson" if noise == "bandmf" else "poisson"
    assert before[2] == [(scheme, FIT_STEPS)]
    # What ran: 4 Poisson steps (BandMF: one round of PoissonSampled(b·L/N) per band group).
    expected = (dp_accounting_epsilon((poisson_gaussian(BANDS * L / N), -(-FIT_STEPS // BANDS)))
                if noise == "bandmf" else dp_accounting_epsilon((poisson_gaussian(L / N), FIT_STEPS)))
    assert epsilon == pytest.approx(expected, rel=1e-6)
    for name, loop in loops_of_ones_own(dp).items():
        for _ in range(LOOP_CALLS if name.startswith("tf.function") else 2):
            with pytest.raises(RuntimeError, match=REFUSED):
                loop()
        assert_unchanged(dp, before)
    assert dp.get_epsilon() == pytest.approx(expected, rel=1e-6)
    # evaluate and predict are not steps; a later fit opens its own phase and trains.
    dp.evaluate(x, y, verbose=0)
    dp.predict(x[:5], verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dp.fit(x, y, batch_size=L, steps_per_epoch=1, epochs=1, verbose=0)
    assert int(dp.privacy_ledger.steps.numpy()) == FIT_STEPS + 1


def test_run_eagerly_fit_trains_and_a_loop_after_it_is_refused():
    """Keras runs the train function as Python (run_eagerly=True): the step runs per call
    inside the wrapper's execution, and after fit the eager step is refused."""
    x, y = data()
    dp = model(run_eagerly=True)
    dp.fit(x, y, batch_size=L, steps_per_epoch=2, epochs=1, verbose=0)
    before = state(dp)
    assert before[2] == [("poisson", 2)]
    for name, loop in loops_of_ones_own(dp).items():
        with pytest.raises(RuntimeError, match=REFUSED):
            loop()
    assert_unchanged(dp, before)


def test_a_step_traced_by_a_callback_during_fit_is_refused_then_and_after():
    """A ``tf.function(model.train_step)`` traced from a callback (callbacks run between the
    train function's executions) is refused at its trace, so there is no graph to call later."""
    x, y = data()
    dp, outcomes, batch = model(), [], fixed_batch()
    traced = tf.function(dp.train_step)

    class TraceTheStep(keras.callbacks.Callback):
        def on_train_batch_end(self, step, logs=None):
            try:
                traced.get_concrete_function(batch)
                outcomes.append("traced")
            except RuntimeError as error:
                outcomes.append(str(error))

    dp.fit(x, y, batch_size=L, steps_per_epoch=2, epochs=1, verbose=0, callbacks=[TraceTheStep()])
    assert len(outcomes) == 2 and all("outside fit()/train_on_batch()" in o for o in outcomes), outcomes
    before = state(dp)
    with pytest.raises(RuntimeError, match=REFUSED):
        traced(batch)
    assert_unchanged(dp, before)


def test_the_phase_closes_when_fit_raises():
    x, y = data()
    dp = model()

    class Stop(keras.callbacks.Callback):
        def on_train_batch_end(self, step, logs=None):
            raise KeyError("stop")

    with pytest.raises(KeyError):
        dp.fit(x, y, batch_size=L, steps_per_epoch=3, epochs=1, verbose=0, callbacks=[Stop()])
    before = state(dp)
    assert before[3] == 1
    with pytest.raises(RuntimeError, match=REFUSED):
        dp.train_function(iter(tf.data.Dataset.from_tensors(fixed_batch()).repeat()))
    assert_unchanged(dp, before)


def test_a_mixed_run_is_accounted_as_what_ran_and_a_refused_loop_adds_nothing():
    """fit (Poisson, T₁ = 4 steps at q = L/N), then a loop of one's own (refused), then 3
    train_on_batch steps: ε is dp_accounting's PoissonSampled(q, G(σ))^4 ∘ G(σ)^3. On 703c7ba the
    loop's 40 steps were counted as Poisson steps of the fit's phase."""
    x, y = data()
    dp = model()
    dp.fit(x, y, batch_size=L, steps_per_epoch=FIT_STEPS, epochs=1, verbose=0)
    loop = loops_of_ones_own(dp)["tf.function(model.train_step)"]
    for _ in range(LOOP_CALLS):
        with contextlib.suppress(RuntimeError):
            loop()
    for _ in range(3):
        dp.train_on_batch(x[:L], y[:L], batch_size=L)
    phases = [(p.scheme, p.steps) for p in dp.privacy_ledger.phases()]
    assert phases == [("poisson", FIT_STEPS), ("batches", 3)]
    expected = dp_accounting_epsilon((poisson_gaussian(L / N), FIT_STEPS),
                                     (dp_event.GaussianDpEvent(float(np.float32(SIGMA))), 3))
    assert dp.get_epsilon() == pytest.approx(expected, rel=1e-6)


# ---------------------------------------------------------------- the noise-key guard
UNITS, SEED = 4000, 2**40 + 17
NOISE_BATCH = np.zeros((8, 1), "float32"), np.zeros((8, UNITS), "float32")


def noise_only_model(seed=SEED):
    """Every gradient is 0: an update is pure noise (as tests/noise/test_noise_key_resume.py)."""
    inputs = keras.Input((1,))
    dp = tf_dp.DPModel(inputs, keras.layers.Dense(UNITS, kernel_initializer="zeros")(inputs))
    dp.compile(optimizer=tf_dp.DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=1.0, seed=seed), loss="mse")
    return dp


def noise_of_a_step(dp) -> np.ndarray:
    before = dp.trainable_variables[1].numpy().copy()
    dp.train_on_batch(*NOISE_BATCH, batch_size=8)
    return dp.trainable_variables[1].numpy() - before


def rolled_back_by_load_weights(tmp_path):
    """Seeded, 1 step, saved, a 2nd step released (its noise z), then load_weights of step 1's file."""
    dp = noise_only_model()
    noise_of_a_step(dp)
    dp.save_weights(tmp_path / "step1.weights.h5")
    released = noise_of_a_step(dp)
    dp.load_weights(tmp_path / "step1.weights.h5")
    return dp, released


def loaded_then_reseeded(tmp_path):
    """A seeded run saved after 2 steps, its 3rd step released; load_model + optimizer.seed = S."""
    dp = noise_only_model()
    for _ in range(2):
        noise_of_a_step(dp)
    dp.save(tmp_path / "run.keras")
    released = noise_of_a_step(dp)
    loaded = keras.models.load_model(tmp_path / "run.keras")
    loaded.optimizer.seed = SEED
    return loaded, released


@pytest.mark.parametrize("resume", [rolled_back_by_load_weights, loaded_then_reseeded])
def test_a_loop_of_ones_own_after_a_rollback_or_a_reseed_draws_no_noise(tmp_path, resume):
    """On 703c7ba the loop skipped the key guard and redrew the released noise z (correlation
    1.000000 with z); now it is refused before any noise is drawn."""
    dp, released = resume(tmp_path)
    before = state(dp)
    batch = tuple(tf.constant(a) for a in NOISE_BATCH)
    for call in (tf.function(dp.train_step), dp.train_step):
        with pytest.raises(RuntimeError, match=REFUSED):
            call(batch)
    assert_unchanged(dp, before)
    if resume is rolled_back_by_load_weights:  # the door fit/train_on_batch keep: re-keyed, fresh noise
        assert abs(np.corrcoef(noise_of_a_step(dp), released)[0, 1]) < 5 / np.sqrt(UNITS)
