"""The one-run audit of Steinke, Nasr & Jagielski (NeurIPS 2023), black-box.

1. m canaries; S_i ∈ {−1, +1} uniform and independent: canary i is trained on iff S_i = +1.
2. Train ONCE on the always-included data plus the included canaries: ``train(x, y) → model``.
3. Score each canary with the final model, s_i (default: log p_model(y_i | x_i) = −loss_i).
4. Guess T_i = +1 for the k₊ highest scores, T_i = −1 for the k₋ lowest, abstain otherwise
   (k₊, k₋ fixed before training); r = k₊ + k₋ guesses, v = #{i : T_i·S_i = +1} correct.
5. ε_lb = sup{ε : f_ε,δ(v) < β} (``tf_dp.audit.epsilon_lower_bound``): if the training is
   (ε, δ)-DP, P[ε_lb > ε] ≤ β over the draw of S.

Only S may be secret: canaries, scores and k₊, k₋ must not depend on it, which holds here
because S is drawn from its own generator after the canaries are fixed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Sequence

import numpy as np

from tf_dp import _checks
from tf_dp.audit.bounds import epsilon_lower_bound

ScoreFn = Callable[[object, np.ndarray, np.ndarray], np.ndarray]
TrainFn = Callable[[np.ndarray, np.ndarray], object]

__all__ = [
    "AuditResult", "OneRunAudit", "count_correct", "guess_membership", "label_log_likelihood", "run_one_run_audit",
]


def label_log_likelihood(model, x: np.ndarray, y: np.ndarray, from_logits: bool = True,
                         batch_size: int = 1024) -> np.ndarray:
    """s_i = log softmax(f(x_i))[y_i] = −CE(f(x_i), y_i): high when the canary's label was learned.

    ``from_logits=False`` for models whose outputs are probabilities.

    Args:
      model: a Keras classifier (anything with ``predict``).
      x: the canaries' inputs.
      y: their integer labels.
      from_logits: whether the model outputs logits (True) or probabilities (False).
      batch_size: the prediction batch size.

    Returns:
      The score s_i of every canary.
    """
    outputs = np.asarray(model.predict(x, batch_size=batch_size, verbose=0), dtype=np.float64)
    if from_logits:
        shifted = outputs - outputs.max(axis=1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    else:
        log_probs = np.log(np.clip(outputs, 1e-300, None))
    return log_probs[np.arange(len(y)), np.asarray(y, dtype=np.int64)]


def guess_membership(scores: np.ndarray, k_pos: int, k_neg: int) -> np.ndarray:
    """T ∈ {−1, 0, +1}^m: +1 for the k₊ highest scores, −1 for the k₋ lowest, 0 (abstain) else.

    Ties are broken by canary index (stable sort), which is independent of S.

    Args:
      scores: s_i per canary (higher = more likely a member).
      k_pos: k₊ ≥ 0, the number of "member" guesses.
      k_neg: k₋ ≥ 0, the number of "non-member" guesses (k₊ + k₋ ≤ m).

    Returns:
      The guesses T, an int8 array of length m.

    Raises:
      ValueError: ``k_pos`` or ``k_neg`` is negative or not an int, or they exceed m together.
    """
    scores = np.asarray(scores, dtype=np.float64)
    _check_ks(k_pos, k_neg, len(scores))
    order = np.argsort(scores, kind="stable")
    guesses = np.zeros(len(scores), dtype=np.int8)
    guesses[order[len(scores) - k_pos:]] = 1
    guesses[order[:k_neg]] = -1
    return guesses


def count_correct(guesses: np.ndarray, membership: np.ndarray) -> int:
    """v = Σ_i max(0, T_i·S_i), with S_i = +1 for members and −1 otherwise.

    Args:
      guesses: T ∈ {−1, 0, +1}^m (from ``guess_membership``).
      membership: the secret membership, True for members.

    Returns:
      v, the number of correct guesses.
    """
    secret = np.where(np.asarray(membership, dtype=bool), 1, -1)
    return int(np.sum(np.asarray(guesses) * secret > 0))


@dataclasses.dataclass(frozen=True)
class AuditResult:
    """What one audit found.

    Attributes:
      epsilon_lower_bound: ε_lb at ``confidence`` (0 when the guesses are no better than chance).
      guesses, correct: r and v.
      canaries: m; k_pos, k_neg: the guesses made each way.
      delta, confidence: the (ε, δ) hypothesis tested and 1 − β (after any Bonferroni split).
      accountant_epsilon: the model's own claim ``model.get_epsilon(delta)`` (None without one).
      scores, membership: per-canary scores and the secret S_i = +1 (True) / −1 (False).
    """

    epsilon_lower_bound: float
    guesses: int
    correct: int
    canaries: int
    k_pos: int
    k_neg: int
    delta: float
    confidence: float
    accountant_epsilon: Optional[float] = None
    scores: np.ndarray = dataclasses.field(default=None, repr=False)
    membership: np.ndarray = dataclasses.field(default=None, repr=False)

    @property
    def accuracy(self) -> float:
        """v / r, the precision of the non-abstaining guesses."""
        return self.correct / self.guesses if self.guesses else float("nan")

    def summary(self) -> str:
        claim = "" if self.accountant_epsilon is None else f" ≤ accountant ε {self.accountant_epsilon:.3f}?"
        return (f"ε lower bound {self.epsilon_lower_bound:.3f}{claim} (δ = {self.delta:g}, confidence "
                f"{self.confidence:g}): {self.correct}/{self.guesses} guesses correct, m = {self.canaries}")


class OneRunAudit:
    """Holds the canaries and their secret membership S for one training run.

    Example::

        audit = OneRunAudit(canary_x, canary_y, seed=0)
        result = audit.run(train, x, y, k_pos=100, k_neg=100, delta=1e-5)

    where ``train(x_train, y_train)`` builds, compiles and fits a fresh model and returns it.

    Args:
      canary_x: the canaries' inputs.
      canary_y: their labels (as many as inputs, at least one).
      seed: seeds the secret membership S and the training set's shuffle.

    Raises:
      ValueError: the canary inputs and labels differ in number or are empty.
    """

    def __init__(self, canary_x: np.ndarray, canary_y: np.ndarray, seed: int = 0):
        if len(canary_x) != len(canary_y) or len(canary_y) == 0:
            raise ValueError(f"Need as many canary labels as inputs (> 0), got {len(canary_x)} and {len(canary_y)}.")
        self.canary_x, self.canary_y = np.asarray(canary_x), np.asarray(canary_y)
        rng = np.random.default_rng(seed)
        self.membership = rng.random(len(canary_y)) < 0.5  # S_i = +1 with probability 1/2
        self._shuffle_seed = int(rng.integers(2**31))

    @property
    def num_canaries(self) -> int:
        return len(self.canary_y)

    def training_set(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The always-included (x, y) plus the canaries with S_i = +1, rows shuffled."""
        x_train = np.concatenate([np.asarray(x), self.canary_x[self.membership].astype(np.asarray(x).dtype)])
        y_train = np.concatenate([np.asarray(y), self.canary_y[self.membership].astype(np.asarray(y).dtype)])
        order = np.random.default_rng(self._shuffle_seed).permutation(len(y_train))
        return x_train[order], y_train[order]

    def score(self, model, score_fn: Optional[ScoreFn] = None) -> np.ndarray:
        """s_i for every canary (default ``label_log_likelihood``): higher = more likely a member."""
        scores = np.asarray((score_fn or label_log_likelihood)(model, self.canary_x, self.canary_y), dtype=np.float64)
        if scores.shape != (self.num_canaries,):
            raise ValueError(f"score_fn must return one score per canary, got shape {scores.shape}.")
        return scores

    def evaluate(self, scores: np.ndarray, *, k_pos: int, k_neg: int, delta: float, confidence: float = 0.95,
                 accountant_epsilon: Optional[float] = None) -> AuditResult:
        """Guesses k₊ members and k₋ non-members from ``scores`` and converts (r, v) into ε_lb."""
        guesses = guess_membership(scores, k_pos, k_neg)
        r, v = k_pos + k_neg, count_correct(guesses, self.membership)
        bound = epsilon_lower_bound(r, v, delta, confidence, canaries=self.num_canaries)
        return AuditResult(bound, r, v, self.num_canaries, k_pos, k_neg, delta, confidence, accountant_epsilon,
                           np.asarray(scores, dtype=np.float64), self.membership.copy())

    def evaluate_best(self, scores: np.ndarray, candidates: Sequence[tuple[int, int]], *, delta: float,
                      confidence: float = 0.95, accountant_epsilon: Optional[float] = None) -> AuditResult:
        """The largest ε_lb over several (k₊, k₋), each tested at level β / len(candidates)
        (Bonferroni), so the maximum still holds with probability ≥ ``confidence``."""
        if not candidates:
            raise ValueError("`candidates` must list at least one (k_pos, k_neg).")
        level = 1.0 - (1.0 - _checks.in_open_unit_interval("confidence", confidence)) / len(candidates)
        results = [self.evaluate(scores, k_pos=kp, k_neg=kn, delta=delta, confidence=level,
                                 accountant_epsilon=accountant_epsilon) for kp, kn in candidates]
        return max(results, key=lambda result: result.epsilon_lower_bound)

    def run(self, train: TrainFn, x: np.ndarray, y: np.ndarray, *, k_pos: Optional[int] = None,
            k_neg: Optional[int] = None, delta: float = 1e-5, confidence: float = 0.95,
            score_fn: Optional[ScoreFn] = None) -> AuditResult:
        """Trains once via ``train(x_train, y_train) → model``, scores the canaries and audits.

        k₊ = k₋ = ⌊m/10⌋ unless given. ``accountant_epsilon`` is ``model.get_epsilon(delta)``
        when the model has one (tf_dp.DPModel)."""
        default = max(1, self.num_canaries // 10)
        k_pos, k_neg = default if k_pos is None else k_pos, default if k_neg is None else k_neg
        _check_ks(k_pos, k_neg, self.num_canaries)
        model = train(*self.training_set(x, y))
        return self.evaluate(self.score(model, score_fn), k_pos=k_pos, k_neg=k_neg, delta=delta,
                             confidence=confidence, accountant_epsilon=_claimed_epsilon(model, delta))


def run_one_run_audit(train: TrainFn, x: np.ndarray, y: np.ndarray, canary_x: np.ndarray, canary_y: np.ndarray,
                      *, seed: int = 0, **kwargs) -> AuditResult:
    """``OneRunAudit(canary_x, canary_y, seed).run(train, x, y, **kwargs)`` in one call.

    Args:
      train: ``train(x_train, y_train)`` builds, compiles and fits a fresh model and returns it.
      x: the always-included inputs.
      y: their labels.
      canary_x: the canaries' inputs.
      canary_y: the canaries' labels.
      seed: seeds the secret membership and the shuffle.
      **kwargs: passed to ``OneRunAudit.run`` (k_pos, k_neg, delta, confidence, ...).

    Returns:
      The ``AuditResult``.
    """
    return OneRunAudit(canary_x, canary_y, seed=seed).run(train, x, y, **kwargs)


def _claimed_epsilon(model, delta: float) -> Optional[float]:
    get_epsilon = getattr(model, "get_epsilon", None)
    if not callable(get_epsilon):
        return None
    epsilon = float(get_epsilon(delta))
    return epsilon if not math.isnan(epsilon) else None


def _check_ks(k_pos, k_neg, m: int) -> None:
    for name, k in (("k_pos", k_pos), ("k_neg", k_neg)):
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise ValueError(f"`{name}` must be an integer >= 0, got {k!r}.")
    if k_pos + k_neg > m:
        raise ValueError(f"k_pos + k_neg = {k_pos + k_neg} guesses exceed the {m} canaries.")
