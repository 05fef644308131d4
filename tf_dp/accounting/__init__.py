"""Accounting: ε from dp_accounting (RDP default, PLD on request), σ calibration, the ledger."""

from tf_dp.accounting.accountant import (
    ACCOUNTANTS,
    calibrate_noise_multiplier,
    compute_epsilon,
    dp_sgd_event,
    epsilon_of_event,
    steps_for,
)
from tf_dp.accounting.ledger import Phase, PrivacyLedger

__all__ = [
    "ACCOUNTANTS", "Phase", "PrivacyLedger", "calibrate_noise_multiplier", "compute_epsilon",
    "dp_sgd_event", "epsilon_of_event", "steps_for",
]
