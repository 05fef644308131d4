"""``PrivateRandomSearch``: KerasTuner random search whose released model carries the ε of the
WHOLE search (Papernot & Steinke, ICLR 2022; docs/algorithms.md §14, docs/guides/tuning.md).

What holds by construction:

* the number of trials K is drawn from OS entropy when ``search`` starts and lives only in
  that call's loop: never an attribute, never saved, printed or logged. KerasTuner's files
  go to a private temporary directory that ``search`` deletes (their number would be K);
  its oracle is written with ``max_trials=None`` and the public seed 1, and it draws every
  trial's hyperparameters independently (with replacement) from OS entropy, so the trials
  are K independent runs of the same randomized trial, as the theorem assumes; every trial
  builds its model from the same Keras name counters (else the released model's layer names,
  dense_7, would count the trials before it);
* the per-trial curve (``trial_bound`` + the score's cost) is fixed in ``__init__``; every
  trial's ledger is checked against it after training, and a trial above it stops the
  search with nothing released;
* each trial is scored by ``public_validation_data`` (declared public, no cost) or a
  ``noisy_score`` (its cost is in the curve); a score of the user's own (a value returned
  by ``HyperModel.fit``), ``validation_data`` or ``validation_split`` are refused;
* only the best trial leaves: ``best_model``, ``best_hyperparameters``, ``release`` (the
  model and ``privacy.json``); ``results_summary`` and more than one best are refused.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import json
import os
import secrets
import shutil
import tempfile
from typing import Optional

import keras
import keras_tuner
import numpy as np
from keras_tuner.src.distribute import utils as dist_utils
from keras_tuner.src.engine.trial import TrialStatus

from tf_dp import _checks
from tf_dp.accounting import dp_sgd_event, events
from tf_dp.models.reporting import PRIVACY_FILE, _version
from tf_dp.tuning.distributions import check_distribution
from tf_dp.tuning.scores import NoisyAccuracy, PublicScore
from tf_dp.tuning.selection import fit_steps, one_trial_epsilon, selection_rdp, trial_rdp, tuning_epsilon
from tf_dp.tuning.trial_bound import TrialBound, TrialOutsideBound

MODEL_FILE = "model.keras"
SCORE = "score"
_PUBLIC_ORACLE_SEED = 1  # in the oracle's file; no draw uses it (0 would be replaced by a random seed)
_REFUSED_ARGUMENTS = {
    "max_trials": "the number of trials is drawn at random from `distribution` (a fixed count costs K times ε)",
    "seed": "every random draw of the search comes from OS entropy; a seed would make K and the trials public",
    "objective": "trials are ranked by the declared score (public_validation_data or noisy_score)",
    "directory": "KerasTuner's trial files would reveal the number of trials: they go to a temporary directory "
                 "that search() deletes; use release(directory) for the best model",
    "project_name": "see `directory`",
    "overwrite": "see `directory`",
    "executions_per_trial": "one trial is one training run (the declared per-trial bound)",
    "max_retries_per_trial": "a retried trial is a second run: not allowed",
    "optimizer": "build(hp) compiles the DP model with a tf_dp optimizer itself",
    "loss": "build(hp) compiles the DP model itself",
    "metrics": "build(hp) compiles the DP model itself",
}
_REFUSED_FIT_ARGUMENTS = ("validation_data", "validation_split")


class _SecretRandomOracle(keras_tuner.oracles.RandomSearchOracle):
    """Random search WITH replacement whose every hyperparameter draw takes its seed from OS
    entropy: the K trials are independent, identically distributed runs."""

    def populate_space(self, trial_id):
        values = keras_tuner.HyperParameters()
        for hp in self.hyperparameters.space:
            values.merge([hp])
            if values.is_active(hp):
                values.values[hp.name] = hp.random_sample(secrets.randbits(64))
        return {"status": TrialStatus.RUNNING, "values": values.values}


class PrivateRandomSearch(keras_tuner.Tuner):
    """Random search over a hypermodel of DP models that releases ONLY the best trial, with
    the ε of the search (docs/guides/tuning.md).

    Args:
      hypermodel: a ``keras_tuner.HyperModel`` or ``build(hp)`` that returns a compiled
        tf_dp model (``tf_dp.DPModel`` + a tf_dp optimizer), untrained.
      distribution: the law of the number of trials, ``TruncatedNegativeBinomial`` or
        ``PoissonTrials``.
      trial_bound: ``TrialBound`` covering the training of every configuration of the space.
      public_validation_data: (x, y) declared PUBLIC: trials are ranked by accuracy on it.
      noisy_score: ``NoisyAccuracy`` on private validation data (its cost joins each trial).
      delta: δ of the reported ε.
      hyperparameters, tune_new_entries, allow_new_entries: as KerasTuner's ``RandomSearch``.
      **kwargs: any other argument of KerasTuner's ``RandomSearch`` (those that would break the
        accounting raise a ValueError).
    """

    def __init__(self, hypermodel, *, distribution, trial_bound: TrialBound, public_validation_data=None,
                 noisy_score: Optional[NoisyAccuracy] = None, delta: float = 1e-5, hyperparameters=None,
                 tune_new_entries: bool = True, allow_new_entries: bool = True, **kwargs):
        for name in kwargs:
            if name in _REFUSED_ARGUMENTS:
                raise ValueError(f"PrivateRandomSearch does not take `{name}`: {_REFUSED_ARGUMENTS[name]}.")
        self._distribution = check_distribution(distribution)
        if not isinstance(trial_bound, TrialBound):
            raise TypeError(f"`trial_bound` must be a tf_dp.tuning.TrialBound, got {type(trial_bound).__name__}.")
        self._trial_bound = trial_bound
        self._score = _declared_score(public_validation_data, noisy_score)
        self._delta = _checks.delta(delta)
        # The curve of one trial (training bound + score), fixed before any trial runs.
        self._trial_curve = trial_bound.curve + trial_rdp(self._score.event, trial_bound.orders)
        self._workdir = tempfile.mkdtemp(prefix="tf_dp_tuning_")
        self._best = None  # (score, model, hyperparameters) of the best trial so far
        self._searched = False
        oracle = _SecretRandomOracle(
            objective=keras_tuner.Objective(SCORE, "max"), max_trials=None, seed=_PUBLIC_ORACLE_SEED,
            hyperparameters=hyperparameters, tune_new_entries=tune_new_entries, allow_new_entries=allow_new_entries,
            max_retries_per_trial=0)
        try:
            super().__init__(oracle, hypermodel, directory=self._workdir, project_name="search", overwrite=True,
                             **kwargs)
        except BaseException:
            shutil.rmtree(self._workdir, ignore_errors=True)
            raise

    # ------------------------------------------------------------------ the search
    def search(self, *fit_args, **fit_kwargs):
        """Draws K from OS entropy, runs K trials (each ``hypermodel.fit`` on the given data,
        silently), keeps the best; deletes KerasTuner's files. Runs once per tuner.

        Args:
          *fit_args, **fit_kwargs: what every trial's ``fit`` gets (x, y, batch_size, epochs,
            callbacks, ...); ``validation_data`` and ``validation_split`` are refused and
            ``verbose`` is 0.

        Returns:
          None; the best trial is ``best_model`` / ``release``.
        """
        for name in _REFUSED_FIT_ARGUMENTS:
            if name in fit_kwargs:
                raise ValueError(
                    f"`{name}` is refused: selecting trials on private validation metrics is not accounted. Pass "
                    "public_validation_data=(x, y) (declared public) or noisy_score=NoisyAccuracy(x, y, "
                    "noise_multiplier) to PrivateRandomSearch.")
        if self._searched:
            raise RuntimeError("This PrivateRandomSearch has searched already: a second search is a second release "
                               "(its ε adds up). Create a new tuner.")
        if dist_utils.has_chief_oracle():
            raise RuntimeError("PrivateRandomSearch runs on one worker: a distributed search would draw K per worker.")
        self._searched = True
        self.oracle.verbose = 0  # trial numbers and scores would reveal K and the losing trials
        fit_kwargs["verbose"] = 0
        try:
            self.on_search_begin()
            for _ in range(self._distribution.sample(np.random.default_rng(secrets.randbits(128)))):
                self._one_trial(fit_args, fit_kwargs)
            self.on_search_end()
        except BaseException:
            self._best = None  # an interrupted search releases nothing
            raise
        finally:
            shutil.rmtree(self._workdir, ignore_errors=True)

    def _one_trial(self, fit_args, fit_kwargs) -> None:
        trial = self.oracle.create_trial(self.tuner_id)
        if trial.status != TrialStatus.RUNNING:
            raise keras_tuner.errors.FatalRuntimeError("The oracle stopped before the drawn number of trials.")
        self.on_trial_begin(trial)
        with _keras_names_as_before():
            self._try_run_and_update_trial(trial, *fit_args, **fit_kwargs)
        self.on_trial_end(trial)

    def run_trial(self, trial, *fit_args, **fit_kwargs):
        """Builds and trains one DP model, checks its ledger against the declared bound,
        scores it (public or noisy) and keeps it if it is the best so far."""
        hp = trial.hyperparameters
        model = self.hypermodel.build(hp)
        _check_fresh_dp_model(model)
        planned = self._planned_training(model, fit_args, fit_kwargs)
        if planned is not None:  # refused before it touches the data
            self._check_bound(planned, f"the trial with {hp.values}, before training,")
        result = self.hypermodel.fit(hp, model, *fit_args, **fit_kwargs)
        if result is not None and not isinstance(result, keras.callbacks.History):
            raise keras_tuner.errors.FatalValueError(
                f"HyperModel.fit returned {type(result).__name__}: a score of its own is a private score that is not "
                "accounted. Return the History (or nothing); trials are ranked by public_validation_data or "
                "noisy_score.")
        self._check_bound(model.privacy_ledger.event(), f"the trial with {hp.values}")
        score = self._score.score(model)
        if self._best is None or score > self._best[0]:
            self._best = (score, model, hp.copy())
        return {SCORE: score}

    def _check_bound(self, event, what: str) -> None:
        try:
            self._trial_bound.check(event, what)
        except TrialOutsideBound as error:
            raise _FatalTrialOutsideBound(str(error)) from None

    def _planned_training(self, model, fit_args, fit_kwargs):
        """The event ``model.fit(x, y, batch_size=L, epochs=E)`` will record (Poisson DP-SGD at
        the optimizer's σ), when the hypermodel's fit is KerasTuner's default (it passes the
        search's arguments unchanged) and they say it; else None (checked after training)."""
        sigma = getattr(model.optimizer, "noise_multiplier", None)
        x = fit_args[0] if fit_args else fit_kwargs.get("x")
        batch_size, epochs = fit_kwargs.get("batch_size"), fit_kwargs.get("epochs", 1)
        custom_fit = type(self.hypermodel).fit is not keras_tuner.HyperModel.fit
        others = {"user_ids", "steps_per_epoch", "initial_epoch", "sampling"} & set(fit_kwargs)
        if custom_fit or others or sigma is None or not isinstance(batch_size, int) or not isinstance(epochs, int):
            return None
        try:
            num_examples = len(x)
        except TypeError:
            return None
        steps = fit_steps(num_examples, batch_size, epochs)
        return dp_sgd_event(batch_size / num_examples, float(sigma), steps)

    # ------------------------------------------------------------------ the release
    @property
    def best_model(self):
        """The released model: the best trial's (after ``search``)."""
        return self._released()[1]

    @property
    def best_hyperparameters(self):
        return self._released()[2]

    def get_best_models(self, num_models: int = 1):
        if num_models != 1:
            raise ValueError("Only the best trial is released (docs/algorithms.md §14): num_models must be 1.")
        return [self.best_model]

    def get_best_hyperparameters(self, num_trials: int = 1):
        if num_trials != 1:
            raise ValueError("Only the best trial is released (docs/algorithms.md §14): num_trials must be 1.")
        return [self.best_hyperparameters]

    def load_model(self, trial):
        raise ValueError("Trials are not kept: only the best model is released (best_model, release).")

    def results_summary(self, num_trials: int = 10):
        raise ValueError("results_summary would print every trial (their number is K, their scores are outside "
                         "the bound): only the best trial is released.")

    def _released(self):
        if not self._searched:
            raise RuntimeError("Call search() first.")
        if self._best is None:
            raise RuntimeError("No trial was released: the search drew K = 0 trials (Poisson), every trial failed, "
                               "or the search stopped.")
        return self._best

    def epsilon(self) -> float:
        """ε at δ of the search (the ε of the released model), from the declared per-trial curve."""
        return tuning_epsilon(self._trial_curve, self._delta, self._distribution, self._trial_bound.orders)

    def privacy_report(self) -> dict:
        """``privacy.json`` of the released model: the search's ε, the distribution of K and its
        E[K], the per-trial mechanism (training bound, score) and the adjacency; the released
        model's own ledger (one trial) as the phases."""
        _, model, hp = self._released()
        phases = model.privacy_ledger.phases()
        unit = events.privacy_unit(phases)
        orders = self._trial_bound.orders
        return {
            "epsilon": self.epsilon(), "delta": self._delta, "accountant": "rdp",
            "steps": int(model.privacy_ledger.steps.numpy()),
            "phases": [dataclasses.asdict(p) for p in phases],
            "unit": unit, "adjacency": events.adjacency(unit), "tf_dp_version": _version(),
            "tuning": {
                "method": "private random search: best of K trials, K random (Papernot & Steinke, ICLR 2022; "
                          "docs/algorithms.md section 14)",
                "distribution": self._distribution.describe(),
                "expected_trials": self._distribution.mean(),
                "epsilon_one_trial": one_trial_epsilon(self._trial_curve, self._delta, orders),
                "per_trial_mechanism": {"training": self._trial_bound.describe(), "score": self._score.describe()},
                "rdp_orders": list(orders), "rdp_one_trial": [float(v) for v in self._trial_curve],
                "rdp_tuning": [float(v) for v in selection_rdp(self._trial_curve, self._distribution, orders)],
                "hyperparameters": dict(hp.values),
            },
        }

    def release(self, directory: str) -> str:
        """Writes the best model (``model.keras``, with its ledger) and ``privacy.json`` (the
        search's ε) into ``directory``; ``tf-dp report directory`` prints the search's ε.

        Returns:
          ``directory``.
        """
        report = self.privacy_report()
        os.makedirs(directory, exist_ok=True)
        self.best_model.save(os.path.join(directory, MODEL_FILE))
        with open(os.path.join(directory, PRIVACY_FILE), "w") as f:
            json.dump(report, f, indent=2)
        return directory


class _FatalTrialOutsideBound(keras_tuner.errors.FatalValueError, TrialOutsideBound):
    """TrialOutsideBound that KerasTuner does not swallow as a failed trial: it stops the search."""


@contextlib.contextmanager
def _keras_names_as_before():
    """Keras names objects from process-wide counters (dense, dense_1, ...; the model, its
    layers, the optimizer): every trial starts from the same counters, so the released model's
    names do not count the trials built before it."""
    from keras.src.backend.common import global_state

    counters = global_state.get_global_attribute("object_name_uids", default=collections.defaultdict(int),
                                                 set_to_default=True)
    saved = copy.deepcopy(counters)
    try:
        yield
    finally:
        global_state.set_global_attribute("object_name_uids", saved)


def _declared_score(public_validation_data, noisy_score):
    if (public_validation_data is None) == (noisy_score is None):
        raise ValueError("Pass exactly one of `public_validation_data=(x, y)` (validation data declared public) or "
                         "`noisy_score=tf_dp.tuning.NoisyAccuracy(x, y, noise_multiplier)` (private validation data, "
                         "accounted): selecting on a private score that is not accounted breaks the guarantee.")
    if noisy_score is not None:
        if not isinstance(noisy_score, NoisyAccuracy):
            raise TypeError(f"`noisy_score` must be a tf_dp.tuning.NoisyAccuracy, got {type(noisy_score).__name__}.")
        return noisy_score
    if not isinstance(public_validation_data, (tuple, list)) or len(public_validation_data) != 2:
        raise ValueError("`public_validation_data` must be a pair (x, y) of public examples and labels.")
    return PublicScore(*public_validation_data)


def _check_fresh_dp_model(model) -> None:
    if not hasattr(model, "privacy_ledger") or not getattr(model, "_dp", None):
        raise keras_tuner.errors.FatalTypeError(
            f"The hypermodel built a {type(model).__name__}: it must build and compile a tf_dp model (tf_dp.DPModel "
            "with a tf_dp optimizer), so that every trial trains with DP and keeps a privacy ledger.")
    if int(model.privacy_ledger.steps.numpy()):
        raise keras_tuner.errors.FatalValueError(
            "The hypermodel built a model that has trained already: its earlier steps are outside the trial's bound. "
            "Build a fresh model in build(hp).")
