"""BandMF's account (docs/algorithms.md §10.2–10.3) against what actually ran: every example's
released participations must be ≥ b DP steps apart inside a segment, and a run that restarts
its sampler and its buffer must be accounted as a new segment. Checked against a hand replay of
the sampler's batches (which step each batch was released at) and dp_accounting directly."""

import warnings

import keras
import numpy as np
import pytest

import tf_dp
from tf_dp.accounting.callbacks import PrivacyBudget
from tf_dp.noise import BandMF
from tf_dp.sampling import cyclic_poisson


def _data(n=240):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 6)).astype(np.float32), rng.integers(0, 3, size=n).astype(np.int32)


def _model(bands, sigma=1.0):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=sigma, noise=BandMF(bands)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_a_step_the_budget_blocks_keeps_every_groups_released_steps_b_apart(monkeypatch):
    """A callback listed after PrivacyBudget changes σ: that step is blocked (released nothing,
    DP counter unchanged) while the sampler moves on to the next group. The groups' released
    DP steps must stay ≥ b apart (else two participations of one example share a row of C,
    and PoissonSampled(q_b, G(σ))^⌈T/b⌉ under-states ε) — or fit must refuse to continue."""
    bands = 2
    drawn = {}
    original = cyclic_poisson.CyclicPoissonSampler.batch

    def logged(self, step):
        indices, mask = original(self, step)
        drawn[int(step)] = indices[mask > 0]
        return indices, mask

    monkeypatch.setattr(cyclic_poisson.CyclicPoissonSampler, "batch", logged)

    class LowerSigma(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 3:
                self.model.optimizer.noise_multiplier = 1.2

    steps_after = []

    class Steps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            steps_after.append(int(self.model.privacy_ledger.steps.numpy()))

    x, y = _data()
    model = _model(bands)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.fit(x, y, batch_size=12, steps_per_epoch=10, epochs=1, verbose=0, sampling_seed=2**40 + 17,
                      callbacks=[PrivacyBudget(100.0), LowerSigma(), Steps()])
    except (ValueError, RuntimeError) as error:  # a refusal is a fix too
        assert "BandMF" in str(error) or "cyclic" in str(error)
        return
    assert 3 in steps_after and steps_after.count(steps_after[3]) >= 2  # the scenario happened: a blocked step
    # Hand replay: Keras batch k consumed the sampler's step k (the fit started at ledger step 0);
    # it was released at DP step steps_after[k] − 1 if the count moved.
    released_at = {}
    previous = 0
    for k, after in enumerate(steps_after):
        if after > previous:
            released_at[k] = previous
        previous = after
    for group in range(bands):
        steps = sorted(dp for k, dp in released_at.items() if k % bands == group and len(drawn[k]))
        gaps = np.diff(steps)
        assert np.all(gaps >= bands), (group, steps)


def test_a_resume_by_backup_and_restore_is_a_new_segment(tmp_path):
    """A process killed mid-fit and resumed by keras.callbacks.BackupAndRestore: the new run has a
    new sampler (new secret groups) and a fresh buffer, so it is a new segment: ε must be that of
    two segments, ⌈T₁/b⌉ + ⌈T₂/b⌉ rounds, not one of ⌈(T₁ + T₂)/b⌉ (dp_accounting directly)."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant

    bands, n, batch, per_epoch = 4, 240, 12, 5

    class Crash(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                raise KeyboardInterrupt

    x, y = _data(n)
    backup = str(tmp_path / "backup")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = _model(bands)
        with pytest.raises(KeyboardInterrupt):
            first.fit(x, y, batch_size=batch, steps_per_epoch=per_epoch, epochs=2, verbose=0,
                      callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq="epoch"), Crash()])
        resumed = _model(bands)
        resumed.fit(x, y, batch_size=batch, steps_per_epoch=per_epoch, epochs=2, verbose=0,
                    callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq="epoch")])
    assert int(resumed.privacy_ledger.steps.numpy()) == 2 * per_epoch
    sigma = resumed.privacy_ledger.phases()[0].noise_multiplier
    segment = dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(bands * batch / n, dp_event.GaussianDpEvent(sigma)), -(-per_epoch // bands))
    orders = [1 + k / 10.0 for k in range(1, 100)] + list(range(11, 64)) + [128, 256, 512]  # algorithms.md A.3
    accountant = rdp_privacy_accountant.RdpAccountant(orders)
    accountant.compose(dp_event.ComposedDpEvent([segment, segment]))
    expected = accountant.get_epsilon(1e-5)
    assert resumed.get_epsilon(1e-5) >= expected * (1 - 1e-9)


def test_a_rollback_by_load_weights_inside_fit_starts_a_new_segment(tmp_path, monkeypatch):
    """A callback rolls the model back mid-fit (load_weights of a file saved 2 steps earlier,
    the scenario of tests/noise/test_noise_key_resume.py): the key is replaced and the BandMF
    buffer restarts, while the sampler runs on (its step s no longer equals the DP step t).
    Hand replay of what the ledger counts: within every ledger segment each group's chances
    must be ≤ ⌈T/b⌉ and ≥ b DP steps apart — the premise of PoissonSampled(q_b, G(σ))^⌈T/b⌉
    (docs/algorithms.md §10.3) — and ε must be at least dp_accounting's event of the replay's
    own per-segment chances. Before the fix the restored and continued steps were merged into
    one segment of 8 steps (2 rounds) although group 1 had 3 chances (DP steps 1, 3, 7)."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant

    bands, n, batch = 4, 240, 12
    path = str(tmp_path / "at_step_3.weights.h5")
    released_at = {}  # Keras batch k (= sampler step k) → the DP step it was released at

    class Rollback(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.before = int(self.model.privacy_ledger.steps.numpy())

        def on_train_batch_end(self, batch, logs=None):
            released_at[len(released_at)] = self.before
            if len(released_at) == 3:
                self.model.save_weights(path)
            if len(released_at) == 5:
                self.model.load_weights(path)  # ledger 5 → 3

    x, y = _data(n)
    model = _model(bands)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(x, y, batch_size=batch, steps_per_epoch=5, epochs=2, verbose=0, sampling_seed=2**40 + 5,
                  callbacks=[Rollback()])
    counted = {k: t for k, t in released_at.items() if not (3 <= t < 5 and k < 5)}  # steps 3, 4 rolled back
    assert sorted(counted.values()) == list(range(8)) == list(range(int(model.privacy_ledger.steps.numpy())))
    phases = model.privacy_ledger.phases()
    starts = np.cumsum([0] + [p.steps for p in phases])
    rounds = []
    for segment in sorted({p.segment for p in phases}):
        rows = [i for i, p in enumerate(phases) if p.segment == segment]
        first, end = starts[rows[0]], starts[rows[-1] + 1]
        chances = {g: sorted(t for k, t in counted.items() if first <= t < end and k % bands == g)
                   for g in range(bands)}
        most = max(len(c) for c in chances.values())
        assert most <= -(-(end - first) // bands), (segment, chances)
        assert all(np.all(np.diff(c) >= bands) for c in chances.values()), (segment, chances)
        rounds.append(most)
    sigma = min(p.noise_multiplier for p in phases)
    step = dp_event.PoissonSampledDpEvent(bands * batch / n, dp_event.GaussianDpEvent(sigma))
    orders = [1 + k / 10.0 for k in range(1, 100)] + list(range(11, 64)) + [128, 256, 512]  # algorithms.md A.3
    accountant = rdp_privacy_accountant.RdpAccountant(orders)
    accountant.compose(dp_event.ComposedDpEvent([dp_event.SelfComposedDpEvent(step, r) for r in rounds]))
    assert model.get_epsilon(1e-5) >= accountant.get_epsilon(1e-5) * (1 - 1e-9)
