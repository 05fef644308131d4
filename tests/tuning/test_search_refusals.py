"""What PrivateRandomSearch refuses, with errors naming the argument: a trial above the declared
per-trial bound (nothing released), a private score that is not accounted, arguments that would
make K public, more than the best trial, and models that are not tf_dp's."""

import os

import keras
import pytest

keras_tuner = pytest.importorskip("keras_tuner")

from tf_dp.tuning import NoisyAccuracy, PoissonTrials, TrialBound  # noqa: E402
from tf_dp.tuning.search import PrivateRandomSearch  # noqa: E402

from tests.tuning import _tiny  # noqa: E402


class Trials(PoissonTrials):
    """Poisson(μ) for the accounting, a fixed draw for the test."""

    def __init__(self, mean, trials):
        super().__init__(mean)
        self.trials = trials

    def sample(self, generator):
        return self.trials


def bound(sigma=_tiny.SIGMA):
    return TrialBound.dp_sgd(_tiny.N, sigma, _tiny.BATCH, epochs=_tiny.EPOCHS)


def tuner(build=_tiny.build, trials=2, trial_bound=None, **kwargs):
    kwargs.setdefault("public_validation_data", _tiny.data(1))
    return PrivateRandomSearch(build, distribution=Trials(3.0, trials), trial_bound=trial_bound or bound(), **kwargs)


def search(search_tuner, **kwargs):
    x, y = _tiny.data(0)
    search_tuner.search(x, y, batch_size=_tiny.BATCH, epochs=kwargs.pop("epochs", _tiny.EPOCHS), **kwargs)


def test_a_trial_below_the_declared_sigma_stops_the_search_and_releases_nothing():
    refused = tuner(trial_bound=bound(sigma=2.0))  # the hypermodel trains at σ = 1
    with pytest.raises(ValueError, match="before training.*trial_bound"):  # refused before it trains
        search(refused)
    assert not os.path.exists(refused._workdir)
    with pytest.raises(RuntimeError, match="No trial was released"):
        refused.best_model


def test_a_trial_with_more_epochs_than_declared_is_refused():
    with pytest.raises(ValueError, match="trial_bound"):
        search(tuner(), epochs=_tiny.EPOCHS + 1)


def test_a_score_must_be_declared_public_or_noisy():
    with pytest.raises(ValueError, match="public_validation_data"):
        tuner(public_validation_data=None)
    with pytest.raises(ValueError, match="exactly one"):
        tuner(noisy_score=NoisyAccuracy(*_tiny.data(2), noise_multiplier=5.0))


@pytest.mark.parametrize("argument", [{"validation_data": _tiny.data(2)}, {"validation_split": 0.2}])
def test_private_validation_metrics_are_refused(argument):
    with pytest.raises(ValueError, match=next(iter(argument))):
        search(tuner(), **argument)


class ScoringHyperModel(keras_tuner.HyperModel):
    """Returns a score of its own from fit: private and not accounted."""

    def build(self, hp):
        return _tiny.build(hp)

    def fit(self, hp, model, *args, **kwargs):
        history = model.fit(*args, **kwargs)
        return history.history["loss"][-1]


def test_a_custom_fit_outside_the_bound_is_refused_after_training():
    class LongerFit(keras_tuner.HyperModel):
        def build(self, hp):
            return _tiny.build(hp)

        def fit(self, hp, model, *args, **kwargs):
            return model.fit(*args, **{**kwargs, "epochs": _tiny.EPOCHS + 1})

    refused = tuner(LongerFit())
    with pytest.raises(ValueError, match="trial_bound") as error:
        search(refused)
    assert "before training" not in str(error.value)  # only the ledger could tell
    with pytest.raises(RuntimeError):
        refused.best_model


def test_a_score_returned_by_the_hypermodel_is_refused():
    refused = tuner(ScoringHyperModel())
    with pytest.raises(ValueError, match="not accounted"):
        search(refused)
    with pytest.raises(RuntimeError):
        refused.best_model


def test_a_noisy_score_needs_noise():
    with pytest.raises(ValueError, match="noise_multiplier"):
        NoisyAccuracy(*_tiny.data(2), noise_multiplier=0.0)


@pytest.mark.parametrize("name,value", [("max_trials", 10), ("seed", 3), ("directory", "d"), ("objective", "val_loss"),
                                        ("executions_per_trial", 2), ("optimizer", "sgd")])
def test_arguments_that_would_fix_or_reveal_k_are_refused(name, value):
    with pytest.raises(ValueError, match=f"`{name}`"):
        tuner(**{name: value})


def test_a_model_that_is_not_a_dp_model_is_refused():
    def plain(hp):
        hp.Choice("learning_rate", [0.1])
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
        model.compile("sgd", "sparse_categorical_crossentropy")
        return model

    with pytest.raises(TypeError, match="tf_dp model"):
        search(tuner(plain))


def test_only_the_best_trial_leaves_and_the_search_runs_once(tmp_path):
    searched = tuner(trials=1)
    search(searched)
    assert searched.get_best_models()[0] is searched.best_model
    with pytest.raises(ValueError, match="num_models"):
        searched.get_best_models(2)
    with pytest.raises(ValueError, match="num_trials"):
        searched.get_best_hyperparameters(2)
    with pytest.raises(ValueError, match="results_summary"):
        searched.results_summary()
    with pytest.raises(RuntimeError, match="second search"):
        search(searched)


def test_zero_poisson_trials_release_nothing(tmp_path):
    empty = tuner(trials=0)
    search(empty)
    with pytest.raises(RuntimeError, match="K = 0"):
        empty.release(str(tmp_path / "released"))
    assert not os.path.exists(tmp_path / "released")
