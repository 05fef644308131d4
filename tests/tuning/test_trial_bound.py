"""TrialBound: the per-trial curve is the pointwise max of the candidates' dp_accounting curves,
and a trial whose σ, q or steps fall outside every candidate is refused, naming `trial_bound`."""

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant

from tf_dp.tuning import TrialBound, TrialOutsideBound
from tf_dp.tuning.selection import ORDERS

N = 1000


def dp_accounting_curve(q, sigma, steps):
    engine = rdp_privacy_accountant.RdpAccountant(list(ORDERS))
    engine.compose(dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)),
                                                steps))
    return engine._rdp


def float32_below(sigma):
    """The largest float32 <= σ (what the bound assumes an optimizer runs)."""
    rounded = np.float32(sigma)
    return float(rounded if float(rounded) <= sigma else np.nextafter(rounded, np.float32(0)))


def poisson_event(q, sigma, steps):
    return dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)


def test_curve_is_the_pointwise_max_over_the_choices():
    bound = TrialBound.dp_sgd(N, [0.8, 1.5], [50, 100], epochs=[1, 2])
    curves = [dp_accounting_curve(b / N, float32_below(s), e * int(np.ceil(N / b))) for s in (0.8, 1.5)
              for b in (50, 100) for e in (1, 2)]
    np.testing.assert_allclose(bound.curve, np.max(curves, axis=0), rtol=1e-12)
    assert bound.describe()["noise_multiplier"] == [float32_below(0.8), 1.5]


def test_candidates_pass_and_the_trial_curve_is_returned():
    bound = TrialBound.dp_sgd(N, [0.8, 1.5], 100, steps=[10, 20])
    for sigma in (float32_below(0.8), 1.5):
        for steps in (10, 20):
            np.testing.assert_allclose(bound.check(poisson_event(0.1, sigma, steps)),
                                       dp_accounting_curve(0.1, sigma, steps), rtol=1e-12)


@pytest.mark.parametrize("q,sigma,steps", [(0.1, 0.7, 20), (0.2, 1.0, 20), (0.1, 1.0, 21)],
                         ids=["smaller_sigma", "larger_q", "more_steps"])
def test_trial_outside_the_bound_is_refused(q, sigma, steps):
    bound = TrialBound.dp_sgd(N, 1.0, 100, steps=20)
    with pytest.raises(TrialOutsideBound, match="trial_bound"):
        bound.check(poisson_event(q, sigma, steps))


def test_bad_declarations_are_refused():
    with pytest.raises(ValueError, match="noise_multiplier"):
        TrialBound.dp_sgd(N, [1.0, 0.0], 100, epochs=1)
    with pytest.raises(ValueError, match="epochs"):
        TrialBound.dp_sgd(N, 1.0, 100)
    with pytest.raises(ValueError, match="candidates"):
        TrialBound([])


def test_epochs_count_as_fit_runs_them():
    """fit's epoch is ⌈N/L⌉ steps: 2 epochs of 100 rows at L = 32 take 8 steps (not ⌈2·100/32⌉ = 7),
    and the bound declared with epochs=2 and σ = 1.3 covers the ledger of that fit (float32 σ)."""
    import keras

    import tf_dp
    from tf_dp.tuning import fit_steps

    inputs = keras.Input((2,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.3),  # float32(1.3) < 1.3
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).normal(size=(100, 2)).astype("float32")
    model.fit(x, (x[:, 0] > 0).astype("int64"), batch_size=32, epochs=2, verbose=0)
    assert int(model.privacy_ledger.steps.numpy()) == fit_steps(100, 32, 2) == 8
    assert model.privacy_ledger.phases()[0].noise_multiplier < 1.3
    TrialBound.dp_sgd(100, 1.3, 32, epochs=2).check(model.privacy_ledger.event())  # the σ the optimizer runs
    with pytest.raises(TrialOutsideBound):
        TrialBound.dp_sgd(100, 1.3, 32, steps=7).check(model.privacy_ledger.event())


def test_search_space_bound_covers_every_configuration():
    """Discrete choices: the max over their product; a continuous σ range: its smallest value
    (RDP falls with σ)."""
    keras_tuner = pytest.importorskip("keras_tuner")
    hp = keras_tuner.HyperParameters()
    hp.Choice("noise_multiplier", [1.0, 2.0, 1.5])
    hp.Choice("batch_size", [16, 32])
    hp.Int("epochs", 1, 3)
    hp.Float("learning_rate", 0.01, 1.0)
    bound = TrialBound.from_search_space(hp, 100, "noise_multiplier", "batch_size", epochs="epochs")
    every = TrialBound.dp_sgd(100, [1.0, 1.5, 2.0], [16, 32], epochs=[1, 2, 3])
    np.testing.assert_allclose(bound.curve, every.curve, rtol=1e-12)
    ranged = keras_tuner.HyperParameters()
    ranged.Float("noise_multiplier", 0.8, 2.0)
    ranged.Int("batch_size", 16, 48, step=16)
    ranged.Fixed("epochs", 2)
    np.testing.assert_allclose(
        TrialBound.from_search_space(ranged, 100, "noise_multiplier", "batch_size", epochs="epochs").curve,
        TrialBound.dp_sgd(100, 0.8, [16, 32, 48], epochs=2).curve, rtol=1e-12)
    for sigma in (0.8, 1.0, 2.0):  # every σ of the range passes the check at every batch size
        for batch in (16, 32, 48):
            TrialBound.from_search_space(ranged, 100, "noise_multiplier", "batch_size", epochs="epochs").check(
                poisson_event(batch / 100, sigma, 2 * int(np.ceil(100 / batch))))


def test_search_space_refuses_what_it_cannot_list():
    keras_tuner = pytest.importorskip("keras_tuner")
    hp = keras_tuner.HyperParameters()
    hp.Float("batch_size", 16.0, 64.0)
    with pytest.raises(ValueError, match="batch_size"):
        TrialBound.from_search_space(hp, 100, 1.0, "batch_size", epochs=1)
    with pytest.raises(ValueError, match="noise_multiplier"):
        TrialBound.from_search_space(hp, 100, "sigma", 32, epochs=1)


def test_more_noise_or_fewer_steps_at_the_same_rate_is_within_the_bound():
    """Post-processing dominance: dp_accounting's fractional orders give ∞ for some larger σ
    (here q = 0.32, σ = 2 at order 1.8) where the declared σ = 0.8 is finite; the trial is
    still accepted, a larger q is not."""
    bound = TrialBound.dp_sgd(100, 0.8, 32, steps=8)
    assert np.isinf(dp_accounting_curve(0.32, 2.0, 4)[ORDERS.index(1.8)])
    assert np.isfinite(bound.curve[ORDERS.index(1.8)])
    bound.check(poisson_event(0.32, 2.0, 4))
    with pytest.raises(TrialOutsideBound):
        bound.check(poisson_event(0.33, 2.0, 4))
