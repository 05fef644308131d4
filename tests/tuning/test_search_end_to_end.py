"""PrivateRandomSearch end to end: a tiny hypermodel tuned with 4 trials. The released model is
the best trial's, and privacy.json's ε is the bound computed here from the released model's
ledger (dp_accounting's RdpAccountant, the §14 formulas written out, dp_accounting's
conversion)."""

import json
import math
import os

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant

pytest.importorskip("keras_tuner")

from tf_dp import cli  # noqa: E402
from tf_dp.tuning import NoisyAccuracy, PoissonTrials, TrialBound, TruncatedNegativeBinomial  # noqa: E402
from tf_dp.tuning.search import PrivateRandomSearch  # noqa: E402
from tf_dp.tuning.selection import ORDERS  # noqa: E402

from tests.tuning import _tiny  # noqa: E402

TRIALS = 4


class FourTrials(PoissonTrials):
    """Poisson(μ) for the accounting; the test fixes the draw to 4 trials."""

    def sample(self, generator):
        return TRIALS


class FourTrialsNegativeBinomial(TruncatedNegativeBinomial):
    def sample(self, generator):
        return TRIALS


def ledger_curve(model, score_sigma=None):
    engine = rdp_privacy_accountant.RdpAccountant(list(ORDERS))
    engine.compose(model.privacy_ledger.event())
    if score_sigma is not None:
        engine.compose(dp_event.GaussianDpEvent(score_sigma))
    return np.asarray(engine._rdp)


def poisson_bound_by_hand(rdp, mu, delta):
    curve = [rdp[i] + mu * rdp_privacy_accountant.compute_delta(ORDERS, rdp, math.log1p(1 / (a - 1)))[0]
             + math.log(mu) / (a - 1) for i, a in enumerate(ORDERS)]
    return rdp_privacy_accountant.compute_epsilon(ORDERS, curve, delta)[0]


def negative_binomial_bound_by_hand(rdp, eta, gamma, delta):
    mean = eta * (1 - gamma) / (gamma * (1 - gamma**eta))
    second = min((1 + eta) * ((1 - 1 / h) * r + math.log(1 / gamma) / h)
                 for h, r in zip([1.0] + list(ORDERS), [0.0] + list(rdp)))
    curve = [rdp[i] + second + math.log(mean) / (a - 1) for i, a in enumerate(ORDERS)]
    return rdp_privacy_accountant.compute_epsilon(ORDERS, curve, delta)[0]


def test_public_score_search_releases_the_best_trial_with_the_bound(tmp_path):
    x, y = _tiny.data(0)
    validation = _tiny.data(1, rows=200)
    tuner = PrivateRandomSearch(_tiny.build, distribution=FourTrials(10.0),
                                trial_bound=TrialBound.dp_sgd(_tiny.N, _tiny.SIGMA, _tiny.BATCH, epochs=_tiny.EPOCHS),
                                public_validation_data=validation)
    tuner.search(x, y, batch_size=_tiny.BATCH, epochs=_tiny.EPOCHS)
    scores = [trial.score for trial in tuner.oracle.trials.values()]
    assert len(scores) == TRIALS
    released = tuner.best_model
    accuracy = np.mean(np.argmax(released.predict(validation[0], verbose=0), axis=-1) == validation[1])
    assert accuracy == pytest.approx(max(scores), abs=1e-12)  # the best trial's model, nothing else
    directory = tuner.release(str(tmp_path / "released"))
    assert sorted(os.listdir(directory)) == ["model.keras", "privacy.json"]
    with open(os.path.join(directory, "privacy.json")) as f:
        report = json.load(f)
    expected = poisson_bound_by_hand(ledger_curve(released), 10.0, 1e-5)
    assert report["epsilon"] == pytest.approx(expected, rel=1e-9)
    assert report["epsilon"] > report["tuning"]["epsilon_one_trial"] == pytest.approx(released.get_epsilon(1e-5))
    assert report["tuning"]["distribution"] == {"name": "poisson", "mean": 10.0, "expected_trials": 10.0}
    assert report["tuning"]["expected_trials"] == 10.0
    assert report["tuning"]["per_trial_mechanism"]["training"]["noise_multiplier"] == [_tiny.SIGMA]
    assert report["adjacency"] == "add/remove one example"
    assert report["tuning"]["hyperparameters"] == tuner.best_hyperparameters.values
    assert cli.report(directory)["epsilon"] == report["epsilon"]  # tf-dp report prints the search's ε
    assert not os.path.exists(tuner._workdir)  # KerasTuner's trial files are gone


def test_noisy_score_search_adds_the_score_cost(tmp_path):
    x, y = _tiny.data(0)
    score = NoisyAccuracy(*_tiny.data(2, rows=100), noise_multiplier=8.0)
    distribution = FourTrialsNegativeBinomial(1.0, 0.2)
    tuner = PrivateRandomSearch(_tiny.build, distribution=distribution,
                                trial_bound=TrialBound.dp_sgd(_tiny.N, _tiny.SIGMA, _tiny.BATCH, epochs=_tiny.EPOCHS),
                                noisy_score=score)
    tuner.search(x, y, batch_size=_tiny.BATCH, epochs=_tiny.EPOCHS)
    report = tuner.privacy_report()
    rdp = ledger_curve(tuner.best_model, score_sigma=8.0)
    np.testing.assert_allclose(report["tuning"]["rdp_one_trial"], rdp, rtol=1e-9)
    assert report["epsilon"] == pytest.approx(negative_binomial_bound_by_hand(rdp, 1.0, 0.2, 1e-5), rel=1e-9)
    assert report["tuning"]["per_trial_mechanism"]["score"]["noise_multiplier"] == 8.0
    assert report["tuning"]["expected_trials"] == pytest.approx(5.0)
    best = max(trial.score for trial in tuner.oracle.trials.values())
    assert tuner._best[0] == best
