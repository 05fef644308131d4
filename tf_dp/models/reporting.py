"""What a DP model tells about its privacy, and what it writes to disk.

The ledger (σ, q, N, L, steps of every phase) is saved in ``.keras`` files and
checkpoints and reported as ε; ``privacy.json`` goes beside an exported SavedModel.
Nothing that determines the noise or the batches (keys, seeds) is ever written: they live
in memory only (``tf_dp.noise.key``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import keras

from tf_dp import _checks
from tf_dp.accounting import PrivacyLedger, events

PRIVACY_FILE = "privacy.json"
_COMPILE_SETTINGS = ("delta", "accountant", "target_epsilon", "private_logs")


def _version() -> str:
    from tf_dp._version import __version__

    return __version__


class PrivacyReporting:
    """ε, the privacy report, export and saving of DP models (mixed into DPModelMixin)."""

    def get_epsilon(self, delta: Optional[float] = None, accountant: Optional[str] = None) -> float:
        """ε of every DP step this model has taken, at ``delta`` (default: compile's δ)."""
        delta = self._dp["delta"] if delta is None else _checks.delta(delta)
        return self.privacy_ledger.epsilon(delta, accountant or self._dp["accountant"])

    @property
    def privacy_settings(self) -> dict:
        return dict(self._dp)

    def privacy_report(self, delta: Optional[float] = None) -> dict:
        """The privacy ledger as a JSON-ready dict (what ``tf-dp report`` prints)."""
        delta = self._dp["delta"] if delta is None else _checks.delta(delta)
        phases = self.privacy_ledger.phases()
        unit = events.privacy_unit(phases)
        return {
            "epsilon": self.get_epsilon(delta), "delta": delta, "accountant": self._dp["accountant"],
            "steps": int(self.privacy_ledger.steps.numpy()),
            "phases": [dataclasses.asdict(p) for p in phases],
            "unit": unit,
            "adjacency": events.adjacency(unit),
            "tf_dp_version": _version(),
        }

    def export(self, filepath, format="tf_saved_model", verbose=None, **kwargs):
        """Keras ``export`` (a SavedModel whose serving graph is the model's inference call:
        no clipping, noise, histogram or optimizer), plus ``privacy.json`` with the ledger."""
        super().export(filepath, format=format, verbose=verbose, **kwargs)
        with open(os.path.join(filepath, PRIVACY_FILE), "w") as f:
            json.dump(self.privacy_report(), f, indent=2)

    def get_compile_config(self):
        config = super().get_compile_config()
        if config:
            config["privacy"] = {name: self._dp[name] for name in _COMPILE_SETTINGS}
            config["privacy"]["clipping_engine"] = self._dp["engine"]
        return config

    def compile_from_config(self, config):
        config = dict(config)
        privacy = config.pop("privacy", {})
        self.compile(**keras.saving.deserialize_keras_object(config), **privacy)
        if self.built:
            self.optimizer.build(self.trainable_variables)

    def save_own_variables(self, store):
        super().save_own_variables(store)
        self.privacy_ledger.save_to(store)

    def load_own_variables(self, store):
        keys = set(store.keys())
        if set(PrivacyLedger.STORE_KEYS) <= keys:
            self.privacy_ledger.load_from(store)
        super().load_own_variables({k: store[k] for k in keys - set(PrivacyLedger.STORE_KEYS)})
