"""Empirical privacy auditing: the one-run audit of Steinke, Nasr & Jagielski (NeurIPS 2023).

An audit gives a LOWER bound on ε that holds with probability ≥ confidence; the accountant
(``model.get_epsilon``) gives the proven UPPER bound. A lower bound above the upper bound
means the implementation or the analysis is wrong.

``epsilon_lower_bound(r, v, δ, confidence, canaries=m)`` converts r guesses with v correct
into ε_lb; ``OneRunAudit`` inserts canaries, trains once via a user callback, scores, guesses
and returns an ``AuditResult``.
"""

from tf_dp.audit.bounds import epsilon_lower_bound, p_value, pure_epsilon_lower_bound, randomized_response_accuracy
from tf_dp.audit.canaries import mislabeled_canaries, random_pixel_canaries
from tf_dp.audit.one_run import (
    AuditResult, OneRunAudit, count_correct, guess_membership, label_log_likelihood, run_one_run_audit,
)

__all__ = [
    "AuditResult", "OneRunAudit", "count_correct", "epsilon_lower_bound", "guess_membership", "label_log_likelihood",
    "mislabeled_canaries", "p_value", "pure_epsilon_lower_bound", "random_pixel_canaries",
    "randomized_response_accuracy", "run_one_run_audit",
]
