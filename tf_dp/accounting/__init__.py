"""Accounting: ε from dp_accounting (RDP default everywhere, PLD on request), σ calibration, the ledger,
and the registries of sampling-scheme events and accountants (``tf_dp.accounting.events``)."""

from tf_dp.accounting.accountant import (
    ACCOUNTANTS,
    LARGEST_NOISE_MULTIPLIER,
    calibrate_noise_multiplier,
    calibrate_sigma,
    compute_epsilon,
    dp_sgd_event,
    epsilon_of_event,
    steps_for,
)
from tf_dp.accounting.events import (
    DEFAULT_ACCOUNTANT,
    SCHEME_CODES,
    Phase,
    StepEvent,
    accountant_names,
    composed_event,
    epsilon,
    phase_event,
    register_accountant,
    register_event,
    registered_schemes,
)
from tf_dp.accounting.ledger import PrivacyLedger

__all__ = [
    "ACCOUNTANTS", "DEFAULT_ACCOUNTANT", "LARGEST_NOISE_MULTIPLIER", "Phase", "PrivacyLedger", "SCHEME_CODES",
    "StepEvent", "accountant_names", "calibrate_noise_multiplier", "calibrate_sigma", "composed_event",
    "compute_epsilon", "dp_sgd_event", "epsilon", "epsilon_of_event", "phase_event", "register_accountant",
    "register_event", "registered_schemes", "steps_for",
]
