"""Balls-in-bins sampling (docs/algorithms.md §15): the participation pattern its account assumes —
every example in exactly one step of every epoch window of B = ⌈N/L⌉ steps, counted from the
batches drawn — and its ε against dp_accounting called directly, for the sampler alone and for
a DP fit."""

import math
import warnings

import keras
import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant

import tf_dp
from tf_dp.accounting.accountant import RDP_ORDERS
from tf_dp.accounting.callbacks import PrivacyBudget
from tf_dp.accounting.ledger import PrivacyLedger
from tf_dp.sampling import balls_in_bins
from tf_dp.sampling.balls_in_bins import BallsInBinsSampler, windows_overlapped


def _drawn(sampler, step):
    indices, mask = sampler.batch(step)
    return indices.reshape(-1)[mask.reshape(-1) == 1]


def _participation(sampler, first, steps):
    """[N, T] counts of who joined which of the steps first, …, first + T − 1."""
    joined = np.zeros((sampler.num_examples, steps), dtype=np.int64)
    for k in range(steps):
        np.add.at(joined[:, k], _drawn(sampler, first + k), 1)
    return joined


def _gaussians_epsilon(sigma, count, delta):
    """dp_accounting's RDP accountant on count × Gaussian(σ), called directly."""
    engine = rdp_privacy_accountant.RdpAccountant(list(RDP_ORDERS))
    engine.compose(dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(sigma), count))
    return float(engine.get_epsilon(delta))


@pytest.mark.parametrize("secure", [False, True])
def test_every_example_is_in_exactly_one_step_of_every_epoch(secure):
    n, batch = 500, 23
    bins = math.ceil(n / batch)
    sampler = BallsInBinsSampler(n, batch, seed=None if secure else 3, secure=secure)
    assert sampler.bins == bins == 22
    joined = _participation(sampler, 0, 4 * bins)
    per_epoch = joined.reshape(n, 4, bins).sum(axis=2)
    assert (per_epoch == 1).all()  # each epoch: every example once, none twice
    # the assignments are fresh each epoch (an example's step changes), and bins are uniform
    positions = joined.reshape(n, 4, bins).argmax(axis=2)
    assert (positions[:, 0] != positions[:, 1]).mean() > 0.9
    sizes = joined.sum(axis=0)
    assert abs(sizes.mean() - n / bins) < 1e-9 and sizes.std() > 0  # random sizes, mean N/B
    # the test can fail: plain Poisson sampling at L/N breaks "exactly once per epoch"
    poisson = tf_dp.sampling.PoissonSampler(n, batch, seed=3)
    assert (_participation(poisson, 0, bins).sum(axis=1) != 1).any()


def test_batch_of_step_t_is_a_function_of_the_seed_and_t():
    a, b = BallsInBinsSampler(300, 10, seed=7), BallsInBinsSampler(300, 10, seed=7)
    late = [_drawn(a, t) for t in (95, 3, 64)]  # any order, any epoch
    early = [_drawn(b, t) for t in (3, 64, 95)]
    for x, y in zip(late, [early[2], early[0], early[1]]):
        np.testing.assert_array_equal(x, y)
    assert "secret" in repr(a) and "7" not in repr(a)


def test_windows_overlapped_is_the_most_windows_over_every_alignment():
    for bins in (1, 2, 5, 7):
        for steps in range(0, 30):
            worst = max((len({(start + k) // bins for k in range(steps)}) for start in range(bins)), default=0)
            assert windows_overlapped(steps, bins) == worst


@pytest.mark.parametrize("steps", [1, 100, 250, 251])
def test_ledger_and_compute_epsilon_give_dp_accountings_epsilon(steps):
    n, batch, sigma, delta = 10000, 100, 1.1, 1e-5
    ledger = PrivacyLedger()
    ledger.open_phase("balls_in_bins", batch / n, sigma, n, float(batch), 100.0, new_segment=True)
    ledger.steps.assign(steps)
    windows = math.ceil((steps - 1) / 100) + 1
    reference = _gaussians_epsilon(sigma, windows, delta)
    assert ledger.epsilon(delta, "rdp") == reference
    assert tf_dp.compute_epsilon(n, batch, sigma, steps=steps, delta=delta, scheme="balls_in_bins") == reference


def _data(n=240):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 6)).astype(np.float32), rng.integers(0, 3, size=n).astype(np.int32)


def _model(sigma=1.0):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=sigma),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _logging_batches(monkeypatch):
    drawn = {}
    original = BallsInBinsSampler.batch

    def logged(self, step):
        indices, mask = original(self, step)
        drawn[int(step)] = indices[mask > 0]
        return indices, mask

    monkeypatch.setattr(BallsInBinsSampler, "batch", logged)
    return drawn


def test_fit_trains_each_example_once_per_epoch_and_accounts_one_gaussian_per_window(monkeypatch):
    drawn = _logging_batches(monkeypatch)
    (x, y), model = _data(), _model(sigma=1.3)
    model.fit(x, y, batch_size=24, epochs=2, verbose=0, sampling="balls_in_bins")
    model.fit(x, y, batch_size=24, epochs=1, verbose=0, sampling="balls_in_bins")  # a second segment
    phases = model.privacy_ledger.phases()
    assert [(p.scheme, p.parameter, p.steps) for p in phases] == [("balls_in_bins", 10.0, 20),
                                                                  ("balls_in_bins", 10.0, 10)]
    assert len({p.segment for p in phases}) == 2
    for epoch in range(3):
        steps = range(10 * epoch, 10 * epoch + 10)
        counts = np.bincount(np.concatenate([drawn[t] for t in steps]), minlength=240)
        assert (counts == 1).all()
    # ⌈19/10⌉ + 1 = 3 and ⌈9/10⌉ + 1 = 2 windows (a segment's first step may start mid-window), dp_accounting directly
    sigma = phases[0].noise_multiplier  # 1.3 as the float32 the step used
    assert model.get_epsilon(1e-5, "rdp") == pytest.approx(_gaussians_epsilon(sigma, 5, 1e-5), rel=1e-12)
    assert model.get_epsilon(1e-5, "rdp") > 1.01 * _gaussians_epsilon(sigma, 4, 1e-5)


def test_a_blocked_step_stops_a_balls_in_bins_fit(monkeypatch):
    """A step the budget blocks moves the sampler on but not the DP count, so the segment's
    released steps could span more epoch windows than ⌈(T − 1)/B⌉ + 1: training must stop
    there (asked of the scheme's registration, whole_segments, not of its name)."""
    _logging_batches(monkeypatch)

    class LowerSigma(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 3:
                self.model.optimizer.noise_multiplier = 1.2

    steps_after = []

    class Steps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            steps_after.append(int(self.model.privacy_ledger.steps.numpy()))

    (x, y), model = _data(), _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(x, y, batch_size=24, epochs=2, verbose=0, sampling="balls_in_bins",
                  callbacks=[PrivacyBudget(100.0), LowerSigma(), Steps()])
    assert steps_after[:4] == [1, 2, 3, 3]  # the scenario happened: step 3 was blocked
    assert len(steps_after) == 4  # and training stopped right there


def test_the_scheme_is_registered_with_its_ledger_code():
    from tf_dp.accounting import events
    from tf_dp.sampling.schemes import SAMPLING_SCHEMES

    assert SAMPLING_SCHEMES["balls_in_bins"] is balls_in_bins.BallsInBinsSampling
    assert events.SCHEME_CODES["balls_in_bins"] == balls_in_bins.LEDGER_CODE and events.is_segmented("balls_in_bins")


def test_a_named_scheme_is_refused_with_what_it_cannot_take():
    from tf_dp.noise import BandMF
    from tf_dp.sampling.schemes import scheme_for_fit

    assert isinstance(scheme_for_fit(None, 600, 60, "balls_in_bins"), balls_in_bins.BallsInBinsSampling)
    with pytest.raises(ValueError, match="do not apply to 'balls_in_bins'"):
        scheme_for_fit(None, 600, 60, "balls_in_bins", user_ids=np.arange(600))
    with pytest.raises(ValueError, match="needs 'cyclic_poisson' sampling"):
        scheme_for_fit(BandMF(2), 600, 60, "balls_in_bins")
    with pytest.raises(ValueError, match="not a registered sampling scheme"):
        scheme_for_fit(None, 600, 60, "shuffle")
