"""The host's bookkeeping after an execution reads the step's logs, not the ledger's variables.

The train-function wrapper records which steps the noise key has drawn from the step count
the step logs (``STEPS_LOG``), and pops its own entries before Keras or a callback sees the
logs. Each test compares what the host recorded with the ledger's variables read directly.
"""

import keras
import numpy as np

import tf_dp
from tf_dp.accounting.callbacks import ledger_state

N, FEATURES = 64, 3


def _model(**compile_args):
    inputs = keras.Input((FEATURES,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0), jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), **compile_args)
    return model


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, FEATURES)).astype(np.float32), rng.integers(0, 2, N)


def _drawn(model) -> int:
    return model.optimizer._key_guard.drawn_steps()


class _Logs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.keys = set()

    def on_train_batch_end(self, batch, logs=None):
        self.keys |= set(logs or {})


def test_train_on_batch_records_the_ledgers_count_and_hides_the_host_logs():
    model = _model()
    x, y = _data()
    for step in range(1, 4):
        logs = model.train_on_batch(x[:8], y[:8], batch_size=8, return_dict=True)
        assert not [name for name in logs if name.startswith("tf_dp_")]
        assert _drawn(model) == int(model.privacy_ledger.steps.numpy()) == step


def test_fit_with_several_steps_per_execution_records_the_ledgers_count():
    model = _model(steps_per_execution=2)
    x, y = _data()
    seen = _Logs()
    history = model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=4, verbose=0, callbacks=[seen])
    assert _drawn(model) == int(model.privacy_ledger.steps.numpy()) == 4
    assert not [name for name in set(history.history) | seen.keys if name.startswith("tf_dp_")]
    # After the last execution the wrapper noted the ledger as it is (the logged count).
    assert model._private_run.watermark == ledger_state(model)


def test_private_logs_still_carry_the_count():
    model = _model(private_logs=True)
    x, y = _data()
    logs = model.train_on_batch(x[:8], y[:8], batch_size=8, return_dict=True)
    assert set(logs) == {"noise_std"}
    assert _drawn(model) == int(model.privacy_ledger.steps.numpy()) == 1


class _TrainOnBatchInside(keras.callbacks.Callback):
    def __init__(self, x, y):
        super().__init__()
        self.x, self.y, self.states = x, y, []

    def on_train_batch_end(self, batch, logs=None):
        if batch == 0:
            self.model.train_on_batch(self.x, self.y, batch_size=8)
            self.states.append((self.model._private_run.watermark, ledger_state(self.model)))


def test_a_train_on_batch_inside_fit_notes_the_ledger_for_fits_next_execution():
    """train_on_batch alone skips the note (its one execution follows its own phase record);
    inside a fit, the fit's next execution compares the ledger against it."""
    model = _model()
    x, y = _data()
    inside = _TrainOnBatchInside(x[:8], y[:8])
    model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=2, verbose=0, callbacks=[inside])
    (noted, now), = inside.states
    assert noted == now
    assert _drawn(model) == int(model.privacy_ledger.steps.numpy()) == 3
