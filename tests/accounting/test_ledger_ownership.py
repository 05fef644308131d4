"""ε belongs to the weights, not to the model object.

A new DP model over layers another DP model trained continues that model's ledger; where
tf_dp cannot see that weights were copied (clone_model + set_weights), the user carries
the ledger with ``continue_ledger_of``. ε is compared with dp_accounting directly, and
each test failed on the code before the fix (a new model reported ε = 0).
"""

import keras
import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import RdpAccountant

import tf_dp

FEATURES, CLASSES, N, L, SIGMA, DELTA = 6, 3, 200, 20, 1.0, 1e-5
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, FEATURES)).astype("float32"), rng.integers(0, CLASSES, N).astype("int32")


def dp_accounting_epsilon(steps: int) -> float:
    """ε of ``steps`` Poisson-sampled Gaussian steps at q = L/N, computed by dp_accounting."""
    event = dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(L / N, dp_event.GaussianDpEvent(SIGMA)),
                                         steps)
    return RdpAccountant().compose(event).get_epsilon(DELTA)


def trained(model, epochs=1):
    model.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=SIGMA), loss=LOSS, delta=DELTA)
    model.fit(*data(), batch_size=L, epochs=epochs, verbose=0)
    return model


def test_a_new_dp_model_over_trained_layers_continues_their_ledger():
    inputs = keras.Input((FEATURES,))
    outputs = keras.layers.Dense(CLASSES)(keras.layers.Dense(8, activation="tanh")(inputs))
    trained(tf_dp.DPModel(inputs, outputs))  # 10 steps
    again = tf_dp.DPModel(inputs, outputs)  # the same layer objects, a new model object
    assert again.get_epsilon() == pytest.approx(dp_accounting_epsilon(10), rel=1e-6)
    trained(again)  # its steps continue the same record and noise counter
    assert int(again.privacy_ledger.steps.numpy()) == 20
    assert again.get_epsilon() == pytest.approx(dp_accounting_epsilon(20), rel=1e-6)


def test_a_subclassed_model_over_trained_layers_continues_their_ledger_at_compile():
    class Head(tf_dp.DPModel):
        def __init__(self, layer, **kwargs):
            super().__init__(**kwargs)
            self.dense = layer

        def call(self, x):
            return self.dense(x)

    layer = keras.layers.Dense(CLASSES)
    inputs = keras.Input((FEATURES,))
    trained(tf_dp.DPModel(inputs, layer(inputs)))
    head = Head(layer)
    head.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=SIGMA), loss=LOSS, delta=DELTA)
    assert head.get_epsilon() == pytest.approx(dp_accounting_epsilon(10), rel=1e-6)


def test_clone_and_set_weights_carry_the_ledger_only_when_told():
    inputs = keras.Input((FEATURES,))
    original = trained(tf_dp.DPModel(inputs, keras.layers.Dense(CLASSES)(inputs)))
    clone = keras.models.clone_model(original)
    clone.set_weights(original.get_weights())
    assert clone.get_epsilon() == 0.0  # copied numbers: tf_dp cannot know (README says so)
    clone.continue_ledger_of(original)
    assert clone.get_epsilon() == pytest.approx(dp_accounting_epsilon(10), rel=1e-6)
    trained(clone)
    assert original.get_epsilon() == pytest.approx(dp_accounting_epsilon(20), rel=1e-6)  # one shared record


def test_continue_ledger_of_is_refused_after_the_model_trained_and_layers_of_two_ledgers_are_refused():
    first = keras.layers.Dense(CLASSES)
    second = keras.layers.Dense(CLASSES)
    inputs = keras.Input((FEATURES,))
    a = trained(tf_dp.DPModel(inputs, first(inputs)))
    b = trained(tf_dp.DPModel(inputs, second(inputs)))
    with pytest.raises(ValueError, match="continue_ledger_of must be called before"):
        b.continue_ledger_of(a)
    with pytest.raises(ValueError, match="different privacy ledgers"):
        tf_dp.DPModel(inputs, keras.layers.Add()([first(inputs), second(inputs)]))


def test_a_file_of_another_fit_loaded_mid_fit_does_not_account_this_fits_steps_at_its_rate(tmp_path):
    """A callback loads, mid-fit, a weights file saved by an earlier fit at another batch size
    (q = 12/240): the ledger is rolled back to that file's phase, but the steps that follow are
    still sampled by the running fit at q = 48/240. ε must be dp_accounting's composition of
    what ran: 3 steps at q = 0.05 (the file's) then the 6 released after the load at q = 0.2
    (before the fix they were counted at the file's q = 0.05)."""
    n = 240
    x = np.random.default_rng(0).normal(size=(n, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    path = str(tmp_path / "small_batches.weights.h5")
    inputs = keras.Input((4,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), delta=1e-5)
    model.fit(x, y, batch_size=12, epochs=1, steps_per_epoch=3, verbose=0)
    model.save_weights(path)

    class LoadTheOldFile(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                self.model.load_weights(path)  # ledger 5 → 3, the phase of q = 0.05

    model.fit(x, y, batch_size=48, epochs=1, steps_per_epoch=8, verbose=0, callbacks=[LoadTheOldFile()])
    assert int(model.privacy_ledger.steps.numpy()) == 3 + 6
    accountant = RdpAccountant([1 + k / 10.0 for k in range(1, 100)] + list(range(11, 64)) + [128, 256, 512])
    step = lambda q: dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(float(np.float32(1.1))))  # noqa: E731
    accountant.compose(dp_event.ComposedDpEvent([dp_event.SelfComposedDpEvent(step(12 / n), 3),
                                                 dp_event.SelfComposedDpEvent(step(48 / n), 6)]))
    assert model.get_epsilon(1e-5) == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)
