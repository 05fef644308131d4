"""PrivacyBudget across a BackupAndRestore resume with another batch size, and its
message when a single step costs more than the budget.

ε is recomputed independently: dp_accounting's RDP accountant composing the ledger's
phases (checked against the batch sizes that actually ran).
"""

import keras
import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant

import tf_dp
from tf_dp.accounting.accountant import RDP_ORDERS

FEATURES, CLASSES, N = 5, 3, 240
SIGMA, BUDGET, DELTA = float(np.float32(1.8)), 2.0, 1e-5  # σ as the float32 variable holds it


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, FEATURES)).astype("float32"), rng.integers(0, CLASSES, N).astype("int32")


def fresh_model(sigma=SIGMA):
    """A new process's model (after an OOM restart): empty ledger, fresh noise key."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(CLASSES)(inputs))
    model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=sigma),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), delta=DELTA)
    return model


def rdp_epsilon(parts):
    """ε of [(q, σ, steps), ...] Poisson-sampled Gaussian phases by dp_accounting directly."""
    accountant = rdp_privacy_accountant.RdpAccountant(RDP_ORDERS)
    for q, sigma, steps in (part for part in parts if part[2]):
        accountant.compose(dp_event.SelfComposedDpEvent(
            dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps))
    return accountant.get_epsilon(DELTA)


class InterruptAt(keras.callbacks.Callback):
    """Raises before batch ``batch`` (a crash; Keras' own BackupAndRestore tests do the same)."""

    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.batch:
            raise RuntimeError("interrupted")


@pytest.mark.parametrize("budget_before_backup", [True, False])
@pytest.mark.parametrize("first_batch, resumed_batch, interrupt_at", [(60, 30, 2), (30, 60, 6)])
def test_budget_holds_across_a_resume_with_another_batch_size(tmp_path, first_batch, resumed_batch, interrupt_at,
                                                              budget_before_backup):
    x, y = data()

    def callbacks(*more):
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=1)
        budget = tf_dp.PrivacyBudget(BUDGET)
        return [budget, backup, *more] if budget_before_backup else [backup, budget, *more]

    with pytest.raises(RuntimeError, match="interrupted"):
        fresh_model().fit(x, y, batch_size=first_batch, epochs=50, verbose=0,
                          callbacks=callbacks(InterruptAt(interrupt_at)))
    model = fresh_model()
    model.fit(x, y, batch_size=resumed_batch, epochs=50, verbose=0, callbacks=callbacks())

    phases = model.privacy_ledger.phases()
    ran = [(p.sampling_rate, p.noise_multiplier, p.steps) for p in phases]
    assert [(q, s) for q, s, _ in ran] == [(first_batch / N, SIGMA), (resumed_batch / N, SIGMA)]
    assert ran[0][2] == interrupt_at  # the backup holds the steps before the crash
    spent = rdp_epsilon(ran)
    assert model.get_epsilon() == pytest.approx(spent, rel=1e-9)
    assert spent <= BUDGET
    # Tight: the budget stopped training, not the epochs — one more step would exceed it.
    assert rdp_epsilon(ran + [(resumed_batch / N, SIGMA, 1)]) > BUDGET


def test_one_step_above_the_budget_says_so_and_what_to_change():
    x, y = data()
    model = fresh_model(sigma=0.5)
    one_step = rdp_epsilon([(60 / N, 0.5, 1)])
    assert one_step > BUDGET
    with pytest.raises(ValueError) as error:
        model.fit(x, y, batch_size=60, epochs=1, verbose=0, callbacks=[tf_dp.PrivacyBudget(BUDGET)])
    message = str(error.value)
    assert "One DP step alone" in message and f"{one_step:.4f}" in message
    assert "Raise noise_multiplier" in message and "smaller batch_size" in message
    assert "already spent" not in message
    assert int(model.privacy_ledger.steps.numpy()) == 0


class SigmaPerBatch(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        self.model.optimizer.noise_multiplier = 2.0 + 0.01 * batch


def test_a_sigma_set_after_the_budget_computed_its_limit_is_warned_about():
    """A σ schedule listed after PrivacyBudget changes σ after the limit was computed, so
    the step refuses every σ and nothing trains: warned. Listed before, every step runs."""
    x, y = data()
    model = fresh_model()
    with pytest.warns(UserWarning, match="List PrivacyBudget after the callback that sets noise_multiplier"):
        model.fit(x, y, batch_size=60, epochs=1, verbose=0, callbacks=[tf_dp.PrivacyBudget(1e6), SigmaPerBatch()])
    assert int(model.privacy_ledger.steps.numpy()) == 0
    model.fit(x, y, batch_size=60, epochs=1, verbose=0, callbacks=[SigmaPerBatch(), tf_dp.PrivacyBudget(1e6)])
    assert int(model.privacy_ledger.steps.numpy()) == N // 60
