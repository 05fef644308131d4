"""Private hyperparameter tuning: the ε of the model a user ships, tuning included
(Papernot & Steinke, ICLR 2022; docs/algorithms.md §14, docs/guides/tuning.md).

* ``TruncatedNegativeBinomial``, ``PoissonTrials``: the law of the random number of trials K;
* ``selection_rdp``, ``tuning_epsilon``: ε of releasing the best of K trials from one trial's
  RDP curve (``trial_rdp`` of its dp_accounting event);
* ``calibrate_noise_multiplier``, ``calibrate_mean_trials``: σ or E[K] for a total ε;
* ``TrialBound``: the per-trial curve declared before the first trial;
* ``PublicScore`` / ``NoisyAccuracy``: how trials are ranked;
* ``PrivateRandomSearch``: the KerasTuner search (needs ``pip install "tf-dp[tuning]"``).
"""

from tf_dp.tuning.distributions import PoissonTrials, TruncatedNegativeBinomial
from tf_dp.tuning.scores import NoisyAccuracy, PublicScore
from tf_dp.tuning.selection import (
    calibrate_mean_trials,
    calibrate_noise_multiplier,
    fit_steps,
    one_trial_epsilon,
    selection_rdp,
    trial_rdp,
    tuning_epsilon,
)
from tf_dp.tuning.trial_bound import TrialBound, TrialOutsideBound

__all__ = [
    "NoisyAccuracy", "PoissonTrials", "PrivateRandomSearch", "PublicScore", "TrialBound", "TrialOutsideBound",
    "TruncatedNegativeBinomial", "calibrate_mean_trials", "calibrate_noise_multiplier", "fit_steps",
    "one_trial_epsilon", "selection_rdp", "trial_rdp", "tuning_epsilon",
]


def __getattr__(name):
    """``PrivateRandomSearch`` imports keras-tuner (the optional extra) on first use."""
    if name == "PrivateRandomSearch":
        try:
            from tf_dp.tuning.search import PrivateRandomSearch
        except ImportError as error:
            raise ImportError('PrivateRandomSearch needs keras-tuner: pip install "tf-dp[tuning]" '
                              '(keras-tuner>=1.4).') from error
        return PrivateRandomSearch
    raise AttributeError(f"module 'tf_dp.tuning' has no attribute {name!r}")
