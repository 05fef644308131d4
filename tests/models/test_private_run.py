"""One ``PrivateRun`` per fit: the run re-records its phase and the budget's limit right before an execution.

A callback listed after ``PrivacyBudget`` (user callbacks follow the privacy callbacks) that
loads another file in ``on_train_batch_begin`` replaces the ledger after the budget computed its
step limit. On e4398a6 (before the run) the step then ran under the limit computed for the
ledger as it was: a file whose ε is already above the budget trained one more step (ledger 11
for a file of 10, ε above the budget grew further). The run recomputes the limit after
re-recording its phase, so the step is blocked: the ledger keeps the file's count, the weights
stay the file's, and ε equals the file's — computed here by dp_accounting from the steps the
file ran, not by the ledger.
"""

import keras
import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import RdpAccountant

import tf_dp
from tf_dp.accounting.accountant import RDP_ORDERS

N, L, FEATURES, CLASSES, DELTA = 2000, 10, 4, 2, 1e-5
# Explicit batches at σ = 2 (no amplification): ε far above BUDGET, which the fit's own Poisson
# steps (q = 0.005, the same σ) would reach only after thousands of steps.
FILE_STEPS, SIGMA = 10, 2.0
BUDGET = 5.0


def _model():
    inputs = keras.Input((FEATURES,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(CLASSES)(inputs))
    model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=SIGMA), jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), delta=DELTA)
    return model


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, FEATURES)).astype("float32"), rng.integers(0, CLASSES, N).astype("int32")


class _LoadBeforeBatch(keras.callbacks.Callback):
    def __init__(self, path, batch):
        super().__init__()
        self.path, self.batch, self.weights = path, batch, None

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.batch:
            self.model.load_weights(self.path)
            self.weights = [w.copy() for w in self.model.get_weights()]


@pytest.mark.parametrize("batch", [0, 1])
def test_a_file_loaded_by_a_later_callback_right_before_a_step_is_held_to_the_budget(tmp_path, batch):
    x, y = _data()
    spent = _model()
    for _ in range(FILE_STEPS):
        spent.train_on_batch(x[:L], y[:L], batch_size=L)
    path = str(tmp_path / "spent.weights.h5")
    spent.save_weights(path)
    accountant = RdpAccountant(RDP_ORDERS)
    accountant.compose(dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(SIGMA), FILE_STEPS))
    file_epsilon = accountant.get_epsilon(DELTA)
    assert file_epsilon > BUDGET

    model = _model()
    load = _LoadBeforeBatch(path, batch)
    model.fit(x, y, batch_size=L, epochs=1, steps_per_epoch=4, verbose=0,
              callbacks=[tf_dp.PrivacyBudget(BUDGET), load])
    assert int(model.privacy_ledger.steps.numpy()) == FILE_STEPS
    for after, loaded in zip(model.get_weights(), load.weights):
        np.testing.assert_array_equal(after, loaded)
    assert model.get_epsilon() == pytest.approx(file_epsilon, rel=1e-6)
