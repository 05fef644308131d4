"""``tf-dp tune``: a private random search over learning rate × clip norm from the command line
(docs/guides/tuning.md). The data set's model is tuned with ``PrivateRandomSearch``: K trials,
K drawn from OS entropy and never shown, each ranked by ``NoisyAccuracy`` on a private
validation split held out of the training rows; only the best trial is released, with the ε
of the whole search (``privacy.json``). The test split only measures the released model.

* ``adult``: logistic regression on UCI Adult's 107 features;
* ``mnist``: the main job's model (examples/mnist_dpsgd.py): Tramèr & Boneh's tanh CNN on the
  order-2 scattering features (J = 2, L = 8) of the images, DP-SGD with momentum 0.9.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence

import numpy as np

from tf_dp import _checks

DEFAULTS = {  # per data set: L, epochs, learning rates, clip norms
    "adult": {"batch_size": 256, "epochs": 5, "learning_rates": [0.05, 0.2, 0.5, 1.0, 2.0, 4.0],
              "clip_norms": [0.1, 0.5, 1.0, 2.0]},
    "mnist": {"batch_size": 1024, "epochs": 40, "learning_rates": [0.5, 1.0, 2.0, 4.0],
              "clip_norms": [0.05, 0.1, 0.2]},
}
DISTRIBUTIONS = ("logarithmic", "geometric", "poisson")
_MNIST_MOMENTUM = 0.9


@dataclasses.dataclass
class TuneResult:
    """What ``tune`` releases and reports.

    Args:
      epsilon: ε of the whole search at ``delta``.
      epsilon_one_trial: ε of one trial alone (for comparison).
      delta: δ.
      noise_multiplier: σ of every trial.
      test_accuracy: accuracy of the released model on the test split.
      hyperparameters: the best trial's learning rate and clip norm.
      directory: where ``model.keras`` and ``privacy.json`` were written.
    """

    epsilon: float
    epsilon_one_trial: float
    delta: float
    noise_multiplier: float
    test_accuracy: float
    hyperparameters: dict
    directory: str


def trial_distribution(name: str, mean_trials: float):
    """The law of K: ``logarithmic`` (η = 0), ``geometric`` (η = 1) or ``poisson``, of mean E[K].

    Args:
      name: one of ``DISTRIBUTIONS``.
      mean_trials: E[K] (> 1; >= 1 for Poisson).

    Returns:
      ``TruncatedNegativeBinomial`` or ``PoissonTrials``.
    """
    from tf_dp.tuning.distributions import PoissonTrials, TruncatedNegativeBinomial

    if name not in DISTRIBUTIONS:
        raise ValueError(f"`distribution` must be one of {DISTRIBUTIONS}, got {name!r}.")
    if name == "poisson":
        return PoissonTrials(mean_trials)
    return TruncatedNegativeBinomial.with_mean(0.0 if name == "logarithmic" else 1.0, mean_trials)


def load_splits(dataset: str, validation_examples: int, train_examples: Optional[int] = None) -> dict:
    """Training rows, the private validation rows after them, and the test split.

    Args:
      dataset: ``adult`` or ``mnist`` (``mnist``: scattering features of the images).
      validation_examples: rows held out of the training split to rank the trials (private).
      train_examples: training rows (default: all that remain).

    Returns:
      {"x", "y", "validation": (x, y), "test": (x, y)}.
    """
    from tf_dp import data as datasets

    split = datasets.load_adult() if dataset == "adult" else datasets.load_mnist()
    validation_examples = _checks.positive_int("validation_examples", validation_examples)
    available = len(split.y_train) - validation_examples
    n = available if train_examples is None else _checks.positive_int("train_examples", train_examples)
    if n > available:
        raise ValueError(f"`train_examples`={n} + `validation_examples`={validation_examples} exceed the "
                         f"{len(split.y_train)} training rows of {dataset}.")
    x, x_test = split.x_train[:n + validation_examples], split.x_test
    if dataset == "mnist":
        from tf_dp.features import scattering_features

        x, x_test = scattering_features(x), scattering_features(x_test)
    y = np.asarray(split.y_train[:n + validation_examples])
    return {"x": x[:n], "y": y[:n], "validation": (x[n:], y[n:]), "test": (x_test, np.asarray(split.y_test))}


def build_model(dataset: str, input_shape, learning_rate: float, clip: float, sigma: float, delta: float):
    """The data set's DP model, compiled for DP-SGD at σ (untrained).

    Args:
      dataset: ``adult`` (logistic regression) or ``mnist`` (the main job's scattering CNN).
      input_shape: shape of one example.
      learning_rate, clip: the trial's hyperparameters.
      sigma: σ of every trial.
      delta: δ of the model's ledger.

    Returns:
      A compiled ``tf_dp.DPModel``.
    """
    import keras

    import tf_dp

    inputs = keras.Input(tuple(input_shape))
    if dataset == "adult":
        outputs, momentum = keras.layers.Dense(2)(inputs), 0.0
    else:
        x = keras.layers.GroupNormalization(27, center=False, scale=False)(inputs)
        x = keras.layers.Conv2D(16, 3, strides=2, padding="same", activation="tanh")(x)
        x = keras.layers.Conv2D(32, 3, padding="same", activation="tanh")(x)
        x = keras.layers.Dense(32, activation="tanh")(keras.layers.Flatten()(x))
        outputs, momentum = keras.layers.Dense(10)(x), _MNIST_MOMENTUM
    model = tf_dp.DPModel(inputs, outputs)
    model.compile(optimizer=tf_dp.DPSGD(learning_rate, l2_norm_clip=clip, noise_multiplier=sigma, momentum=momentum),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), delta=delta)
    return model


def tune(dataset: str, output: str, *, target_epsilon: Optional[float] = None,
         noise_multiplier: Optional[float] = None, distribution: str = "logarithmic", mean_trials: float = 10.0,
         learning_rates: Optional[Sequence[float]] = None, clip_norms: Optional[Sequence[float]] = None,
         batch_size: Optional[int] = None, epochs: Optional[int] = None, train_examples: Optional[int] = None,
         validation_examples: int = 2000, score_noise: float = 30.0, delta: float = 1e-5) -> TuneResult:
    """Private random search over learning rate × clip norm; releases the best trial to ``output``.

    Args:
      dataset: ``adult`` or ``mnist``.
      output: directory for the released ``model.keras`` and ``privacy.json``.
      target_epsilon: total ε of the SEARCH (σ calibrated for it); or ``noise_multiplier``.
      noise_multiplier: σ of every trial; or ``target_epsilon``.
      distribution, mean_trials: the law of K (``trial_distribution``).
      learning_rates, clip_norms: the candidates (default: the data set's, ``DEFAULTS``).
      batch_size, epochs: L and the epochs of every trial (default: the data set's).
      train_examples, validation_examples: ``load_splits``.
      score_noise: σ of ``NoisyAccuracy``'s noise on the validation count.
      delta: δ.

    Returns:
      ``TuneResult`` (ε of the search, the best trial's test accuracy and hyperparameters).
    """
    from tf_dp.tuning import NoisyAccuracy, TrialBound, calibrate_noise_multiplier
    from tf_dp.tuning.search import PrivateRandomSearch

    if dataset not in DEFAULTS:
        raise ValueError(f"`dataset` must be one of {sorted(DEFAULTS)}, got {dataset!r}.")
    if (target_epsilon is None) == (noise_multiplier is None):
        raise ValueError("Pass exactly one of `target_epsilon` (the search's total ε) or `noise_multiplier`.")
    settings = {**DEFAULTS[dataset], **{k: v for k, v in {"batch_size": batch_size, "epochs": epochs,
                                                          "learning_rates": learning_rates,
                                                          "clip_norms": clip_norms}.items() if v is not None}}
    law = trial_distribution(distribution, mean_trials)
    data = load_splits(dataset, validation_examples, train_examples)
    n, batch, epochs = len(data["y"]), settings["batch_size"], settings["epochs"]
    score = NoisyAccuracy(*data["validation"], noise_multiplier=score_noise)
    sigma = noise_multiplier
    if target_epsilon is not None:
        sigma = calibrate_noise_multiplier(target_epsilon, law, n, batch, epochs=epochs, delta=delta,
                                           score_event=score.event)
    shape = data["x"].shape[1:]
    rates, clips = [float(v) for v in settings["learning_rates"]], [float(v) for v in settings["clip_norms"]]

    def build(hp):
        return build_model(dataset, shape, hp.Choice("learning_rate", rates), hp.Choice("l2_norm_clip", clips),
                           sigma, delta)

    search = PrivateRandomSearch(build, distribution=law, noisy_score=score, delta=delta,
                                 trial_bound=TrialBound.dp_sgd(n, sigma, batch, epochs=epochs))
    search.search(data["x"], data["y"], batch_size=batch, epochs=epochs)
    search.release(output)
    report = search.privacy_report()
    predictions = np.argmax(search.best_model.predict(data["test"][0], verbose=0, batch_size=1024), axis=-1)
    return TuneResult(epsilon=report["epsilon"], epsilon_one_trial=report["tuning"]["epsilon_one_trial"],
                      delta=delta, noise_multiplier=float(sigma),
                      test_accuracy=float(np.mean(predictions == data["test"][1])),
                      hyperparameters=dict(report["tuning"]["hyperparameters"]),
                      directory=os.path.abspath(output))
