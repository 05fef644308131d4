"""Parameter averaging (docs/algorithms.md §9): θ̄ is the EMA of the recorded iterates, training and
the privacy ledger are untouched by it, and evaluation runs on θ̄ when asked."""

import keras
import numpy as np
import pytest

import tf_dp
from tf_dp.averaging import averaged_pairs, averaged_weights

N, BATCH = 96, 16
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 5)).astype("float32")
    return x, (x[:, 0] + 0.5 * x[:, 1] > 0).astype("int32")


def _model(momentum=0.8, use_ema=True, optimizer=tf_dp.DPSGD, **optimizer_kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(2)(keras.layers.Dense(8, activation="tanh")(inputs)))
    ema = dict(use_ema=True, ema_momentum=momentum) if use_ema else {}
    model.compile(optimizer=optimizer(0.3, l2_norm_clip=1.0, noise_multiplier=0.8, seed=1, **ema, **optimizer_kwargs),
                  loss=LOSS)
    return model


class RecordIterates(keras.callbacks.Callback):
    """θ_t after every step (placed after ParameterAveraging: the model holds θ while training)."""

    def on_train_begin(self, logs=None):
        self.iterates = []

    def on_train_batch_end(self, batch, logs=None):
        self.iterates.append([np.array(v.numpy()) for v in self.model.trainable_variables])


def _numpy_average(iterates, momentum, start_step):
    """θ̄_t = θ_t for t ≤ max(s, 1), then θ̄_t = β θ̄_{t−1} + (1 − β) θ_t, in float64."""
    average = None
    for t, theta in enumerate(iterates, start=1):
        theta = [w.astype(np.float64) for w in theta]
        if t <= max(start_step, 1):
            average = theta
        else:
            average = [momentum * a + (1 - momentum) * w for a, w in zip(average, theta)]
    return average


@pytest.mark.parametrize("start_step", [0, 7])
@pytest.mark.parametrize("optimizer", [tf_dp.DPSGD, tf_dp.FIBER])
def test_average_is_the_ema_of_the_recorded_iterates(start_step, optimizer):
    x, y = _data()
    model = _model(momentum=0.8, optimizer=optimizer)
    recorder = RecordIterates()
    model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0,
              callbacks=[tf_dp.ParameterAveraging(start_step=start_step, swap_at_end=False), recorder])
    steps = int(model.privacy_ledger.steps.numpy())
    assert len(recorder.iterates) == steps > start_step + 5
    expected = _numpy_average(recorder.iterates, 0.8, start_step)
    for (_, average), want in zip(averaged_pairs(model), expected):
        np.testing.assert_allclose(average.numpy(), want, rtol=1e-5, atol=1e-6)
    # swap_at_end=False: the model ends on θ_T, the last iterate
    for got, want in zip(model.trainable_variables, recorder.iterates[-1]):
        np.testing.assert_array_equal(got.numpy(), want)


def test_averaging_changes_neither_training_nor_the_ledger():
    """Same seeds with and without averaging (and with validation run on θ̄ every epoch):
    the iterates θ are bit-identical and so are the ledger and ε — θ̄ is post-processing."""
    x, y = _data()
    plain = _model(use_ema=False)
    plain.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, validation_data=(x, y), sampling_seed=3)
    averaged = _model(use_ema=True)
    averaging = tf_dp.ParameterAveraging(start_step=2)
    history = averaged.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, validation_data=(x, y), sampling_seed=3,
                           callbacks=[averaging])
    assert history.history["epsilon"] == pytest.approx(plain.history.history["epsilon"], rel=0)
    assert averaged.get_epsilon() == plain.get_epsilon()
    assert int(averaged.privacy_ledger.steps.numpy()) == int(plain.privacy_ledger.steps.numpy())
    np.testing.assert_array_equal(averaged.privacy_ledger.phase_table.numpy(), plain.privacy_ledger.phase_table.numpy())
    # fit ended with θ̄ in the model; the callback kept θ, bit-identical to the plain run's
    for (variable, average), kept, theta in zip(averaged_pairs(averaged), averaging._iterates,
                                                plain.trainable_variables):
        np.testing.assert_array_equal(variable.numpy(), average.numpy())
        np.testing.assert_array_equal(kept.numpy(), theta.numpy())
    assert not np.array_equal(averaging._iterates[0].numpy(), averaged.trainable_variables[0].numpy())


class RecordStart(keras.callbacks.Callback):
    """The weights the first step of a fit starts from."""

    def on_train_batch_begin(self, batch, logs=None):
        if not hasattr(self, "weights"):
            self.weights = [np.array(v.numpy()) for v in self.model.trainable_variables]


def test_a_second_fit_continues_from_the_iterates_not_the_average():
    """fit ends with θ̄ in the model (for evaluation and export); the next fit with the
    callback trains on from θ_T exactly (Keras' own EMA would continue from θ̄)."""
    x, y = _data()
    model = _model()
    averaging = tf_dp.ParameterAveraging()
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[averaging])
    theta = [np.array(kept.numpy()) for kept in averaging._iterates]
    theta_bar = [np.array(v.numpy()) for v in model.trainable_variables]
    assert not np.array_equal(theta[0], theta_bar[0])
    start = RecordStart()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[averaging, start])
    for got, want in zip(start.weights, theta):
        np.testing.assert_array_equal(got, want)


def test_evaluate_uses_the_average_when_asked():
    x, y = _data()
    model = _model()
    averaging = tf_dp.ParameterAveraging(swap_at_end=False)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, validation_data=(x, y), callbacks=[averaging])
    theta = [np.array(v.numpy()) for v in model.trainable_variables]
    theta_bar = [np.array(a.numpy()) for _, a in averaged_pairs(model)]

    reference = _model(use_ema=False)
    reference.set_weights(theta_bar)
    on_average = reference.evaluate(x, y, verbose=0)
    reference.set_weights(theta)
    on_iterate = reference.evaluate(x, y, verbose=0)
    assert on_average != pytest.approx(on_iterate)

    assert model.evaluate(x, y, verbose=0) == pytest.approx(on_iterate, rel=1e-6)  # not asked: θ
    assert model.evaluate(x, y, verbose=0, callbacks=[averaging]) == pytest.approx(on_average, rel=1e-6)
    assert history.history["val_loss"][-1] == pytest.approx(on_average, rel=1e-6)  # validation ran on θ̄
    with averaged_weights(model):
        assert model.evaluate(x, y, verbose=0) == pytest.approx(on_average, rel=1e-6)
    for variable, value in zip(model.trainable_variables, theta):  # θ restored exactly
        np.testing.assert_array_equal(variable.numpy(), value)


def test_end_of_fit_leaves_the_average_for_export(tmp_path):
    x, y = _data()
    model = _model()
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[tf_dp.ParameterAveraging()])
    theta_bar = [np.array(a.numpy()) for _, a in averaged_pairs(model)]
    model.save(tmp_path / "averaged.keras")
    loaded = keras.models.load_model(tmp_path / "averaged.keras")
    for got, want in zip(loaded.trainable_variables, theta_bar):
        np.testing.assert_array_equal(got.numpy(), want)
    assert loaded.get_epsilon() == model.get_epsilon()


@pytest.mark.parametrize("kwargs, match", [({}, "use_ema=True"), ({"ema_overwrite_frequency": 5}, "overwrite")])
def test_optimizer_must_keep_the_average_without_overwriting(kwargs, match):
    x, y = _data()
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(2)(inputs))
    ema = {"use_ema": True, **kwargs} if kwargs else {}
    model.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0, **ema), loss=LOSS)
    with pytest.raises(ValueError, match=match):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[tf_dp.ParameterAveraging()])


def test_bad_arguments():
    with pytest.raises(ValueError, match="start_step"):
        tf_dp.ParameterAveraging(start_step=-1)
    with pytest.raises(ValueError, match="start_step"):
        tf_dp.ParameterAveraging(start_step=2.5)


def test_every_step_is_averaged_with_several_steps_per_execution():
    """θ̄ is updated inside the compiled step: with steps_per_execution = 4 (callbacks see
    every 4th iterate only) it is the same average as with 1."""
    x, y = _data()
    averages = []
    for steps_per_execution in (1, 4):
        model = _model()
        model.compile(optimizer=model.optimizer, loss=LOSS, steps_per_execution=steps_per_execution)
        model.fit(x, y, batch_size=12, epochs=2, verbose=0, sampling_seed=3,  # 8 steps per epoch
                  callbacks=[tf_dp.ParameterAveraging(swap_at_end=False)])
        assert int(model.optimizer.iterations.numpy()) == 16
        averages.append([np.array(a.numpy()) for _, a in averaged_pairs(model)])
    for one, four in zip(*averages):
        np.testing.assert_allclose(four, one, rtol=1e-6, atol=1e-7)
