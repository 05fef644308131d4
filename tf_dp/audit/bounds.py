"""From (guesses, correct guesses) to an ε lower bound: Steinke, Nasr & Jagielski (2023).

Setting ("Privacy Auditing with One (1) Training Run", NeurIPS 2023, Theorem 3.1 and
Appendix D). m canaries are each included with probability 1/2, S ∈ {−1, +1}^m uniform;
after one run the auditor outputs guesses T ∈ {−1, 0, +1}^m with r = ‖T‖₁ non-abstentions
(r fixed in advance, e.g. r = k₊ + k₋) and makes W = Σᵢ max(0, Tᵢ·Sᵢ) correct ones. With

    W' ~ Binomial(r, q),   q = e^ε / (1 + e^ε)          (accuracy of ε-randomized response)

an (ε, δ)-DP algorithm satisfies, for every v,

    P[W ≥ v] ≤ f_ε,δ(v) = P[W' ≥ v] + 2mδ · α,   α = max_{i = 1..v} (1/i) · P[v − i ≤ W' < v].

Pure ε-DP is δ = 0: f_ε(v) = P[W' ≥ v]. The audit rejects "(ε, δ)-DP" at level β = 1 − confidence
when f_ε,δ(v) < β for the observed v; the lower bound is the supremum of the rejected ε (an
(ε, δ)-DP algorithm is (ε', δ)-DP for every ε' ≥ ε, so rejecting ε' rejects every ε ≤ ε').
The maximum over i ≤ m in the paper equals the one over i ≤ v (the window stops growing at i = v).
"""

from __future__ import annotations

import numpy as np
from scipy import special, stats

from tf_dp import _checks

__all__ = ["epsilon_lower_bound", "p_value", "pure_epsilon_lower_bound", "randomized_response_accuracy"]

_GRID_POINTS = 256  # scan of [0, ε_pure] for the (ε, δ) bound before bisection
_BISECTION_STEPS = 60


def randomized_response_accuracy(epsilon: float) -> float:
    """q = e^ε / (1 + e^ε): the best guessing accuracy against ε-DP randomized response.

    Args:
      epsilon: ε ≥ 0.

    Returns:
      The accuracy q in [1/2, 1).
    """
    return float(special.expit(epsilon))


def p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float = 0.0) -> float:
    """f_ε,δ(v) = min(1, P[W' ≥ v] + 2mδ · max_{i=1..v} (1/i)·P[v − i ≤ W' < v]), W' ~ Bin(r, q).

    An upper bound on the probability of ≥ v correct guesses out of r if the algorithm is
    (ε, δ)-DP with respect to the m randomized canaries (Steinke et al. 2023, Theorem 3.1).

    Args:
      canaries: m, the number of canaries included with probability 1/2 (abstentions count).
      guesses: r, the number of non-abstaining guesses.
      correct: v, the number of correct guesses.
      epsilon, delta: the null hypothesis (ε, δ)-DP.
    """
    m, r, v = _counts(canaries, guesses, correct)
    epsilon = _checks.non_negative("epsilon", epsilon)
    delta = _delta(delta)
    q = randomized_response_accuracy(epsilon)
    tail = float(stats.binom.sf(v - 1, r, q))  # P[W' ≥ v]
    if delta == 0.0 or v == 0:
        return min(tail, 1.0)
    below = stats.binom.pmf(np.arange(v - 1, -1, -1), r, q)  # P[W' = v−1], P[W' = v−2], ..., P[W' = 0]
    alpha = float(np.max(np.cumsum(below) / np.arange(1, v + 1)))  # max_i P[v−i ≤ W' < v] / i
    return min(tail + 2.0 * m * delta * alpha, 1.0)


def pure_epsilon_lower_bound(guesses: int, correct: int, confidence: float = 0.95) -> float:
    """sup{ε ≥ 0 : P[Bin(r, e^ε/(1+e^ε)) ≥ v] < β}, in closed form (pure ε-DP, δ = 0).

    P[Bin(r, q) ≥ v] = I_q(v, r − v + 1) (regularized incomplete beta) increases in q, so
    the rejected q are those below q* = I⁻¹_β(v, r − v + 1), the one-sided Clopper–Pearson
    lower confidence bound on the accuracy; ε = max(0, log(q* / (1 − q*))). Needs no m.

    Args:
      guesses: r, the number of non-abstaining guesses.
      correct: v, the number of correct guesses (0 ≤ v ≤ r).
      confidence: 1 − β, in (0, 1).

    Returns:
      The lower bound ε_lb ≥ 0 on the pure-DP ε.

    Raises:
      ValueError: the counts or ``confidence`` are out of range.
    """
    r, v = _guesses(guesses), _correct(guesses, correct)
    beta = _beta(confidence)
    if v == 0:
        return 0.0
    q_star = float(stats.beta.ppf(beta, v, r - v + 1))
    if q_star <= 0.5:
        return 0.0
    if q_star >= 1.0:  # only when β underflows; report the largest finite ε
        return float(special.logit(np.nextafter(1.0, 0.0)))
    return float(special.logit(q_star))


def epsilon_lower_bound(
    guesses: int, correct: int, delta: float = 0.0, confidence: float = 0.95, *, canaries: int | None = None
) -> float:
    """ε_lb = sup{ε ≥ 0 : f_ε,δ(v) < β}, β = 1 − confidence (Steinke et al. 2023).

    With probability ≥ confidence over the canaries' coin flips, an (ε, δ)-DP algorithm
    (w.r.t. the m canaries) never makes the audit report ε_lb > ε.

        f_ε,δ(v) = P[W' ≥ v] + 2mδ · max_{i=1..v} (1/i) · P[v − i ≤ W' < v],
        W' ~ Binomial(r, e^ε / (1 + e^ε)).

    δ = 0 is the pure bound (closed form, ``pure_epsilon_lower_bound``). For δ > 0, since
    f_ε,δ ≥ P[W' ≥ v] every rejected ε lies in [0, ε_pure]. f_ε,δ need not be monotone in ε
    (the δ term can fall as ε grows), so instead of the paper's plain bisection (Appendix D)
    [0, ε_pure] is scanned on 257 points and the last rejected point is refined by bisection
    towards the next one: the supremum up to dips narrower than ε_pure/256, and the value
    returned always satisfies f_ε_lb,δ(v) < β (a rejected ε), or is 0. Where f is monotone
    (all practical cases checked) this is the paper's answer.

    Args:
      guesses: r, the number of non-abstaining guesses (fixed before looking at S).
      correct: v, how many of them were right.
      delta: δ of the null hypothesis (0: pure ε-DP).
      confidence: 1 − β.
      canaries: m, the number of randomized canaries; required when δ > 0 (the δ term
        grows with m, so it cannot default to r).
    """
    r, v = _guesses(guesses), _correct(guesses, correct)
    delta, beta = _delta(delta), _beta(confidence)
    upper = pure_epsilon_lower_bound(r, v, confidence)
    if delta == 0.0 or upper == 0.0:
        return upper
    if canaries is None:
        raise ValueError("`canaries` (m, the number of randomized canaries) is needed when delta > 0.")
    m = _counts(canaries, r, v)[0]
    rejected = lambda eps: p_value(m, r, v, eps, delta) < beta  # noqa: E731
    grid = np.linspace(0.0, upper, _GRID_POINTS + 1)
    hits = [i for i, eps in enumerate(grid) if rejected(eps)]
    if not hits:
        return 0.0
    low, high = float(grid[hits[-1]]), float(grid[min(hits[-1] + 1, _GRID_POINTS)])
    for _ in range(_BISECTION_STEPS):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if rejected(middle) else (low, middle)
    return low


def _counts(canaries, guesses, correct) -> tuple[int, int, int]:
    m = _checks.positive_int("canaries", canaries)
    r, v = _guesses(guesses), _correct(guesses, correct)
    if r > m:
        raise ValueError(f"`guesses` ({r}) cannot exceed `canaries` ({m}).")
    return m, r, v


def _guesses(guesses) -> int:
    if isinstance(guesses, bool) or not isinstance(guesses, (int, np.integer)) or guesses < 0:
        raise ValueError(f"`guesses` must be an integer >= 0, got {guesses!r}.")
    return int(guesses)


def _correct(guesses, correct) -> int:
    if isinstance(correct, bool) or not isinstance(correct, (int, np.integer)) or not 0 <= correct <= guesses:
        raise ValueError(f"`correct` must be an integer in [0, guesses={guesses}], got {correct!r}.")
    return int(correct)


def _delta(delta) -> float:
    delta = _checks.real("delta", delta)
    if not 0.0 <= delta < 1.0:
        raise ValueError(f"`delta` must lie in [0, 1), got {delta}.")
    return delta


def _beta(confidence) -> float:
    confidence = _checks.in_open_unit_interval("confidence", confidence)
    return 1.0 - confidence

