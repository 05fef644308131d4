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
