"""What each stream of secret randomness has drawn on one privacy ledger: one guard for both.

Two streams are functions of (secret, ledger step t): the optimizer's noise key (the noise of
step t) and a user ``sampling_seed`` (the batch of step t). Both obey one rule
(docs/algorithms.md A.2, B.3): no (secret, step) pair may draw for two releases. So both keep
one ``DrawRecord`` per ledger — the secret's generation and the first step it has not drawn —
in the ledger's ``DrawGuard`` (``PrivacyLedger.draws``: held by the ledger object, in this
process only, never saved). When a stream starts at step t:

  * t < drawn (``ROLLED_BACK``: load_weights of an older file, BackupAndRestore): the
    secret moves to its next generation, so no step is redrawn;
  * t > drawn (``AHEAD``): the ledger holds steps this secret did not draw here (a loaded
    file, a model trained elsewhere) — a seeded noise key refuses (unless it has kept this
    ledger since step 0 and t is where it stopped), a sampling seed warns;
  * otherwise (``AT``) the stream continues where it stopped.
"""

from __future__ import annotations

import dataclasses
import weakref

ROLLED_BACK, AHEAD, AT = "rolled_back", "ahead", "at"


@dataclasses.dataclass
class DrawRecord:
    """One secret on one ledger.

    Args:
      generation: the secret's generation that drew (0: the secret itself).
      fresh_from_step: the first ledger step it has not drawn.
      from_zero: it has drawn on this ledger since the ledger's step 0.
    """

    generation: int = 0
    fresh_from_step: int = 0
    from_zero: bool = False

    def start(self, step: int) -> str:
        """Where a stream starting at ledger step ``step`` stands against what it drew.

        Args:
          step: the ledger's step count now.

        Returns:
          ``ROLLED_BACK`` (step < drawn), ``AHEAD`` (step > drawn) or ``AT``; the record
          then starts at ``step``.
        """
        step = int(step)
        verdict = ROLLED_BACK if step < self.fresh_from_step else AHEAD if step > self.fresh_from_step else AT
        self.fresh_from_step = step
        self.from_zero = self.from_zero or step == 0
        return verdict

    def drew(self, steps: int) -> None:
        """The steps below ``steps`` have drawn with this record's generation.

        Args:
          steps: the ledger step count after the draws.
        """
        self.fresh_from_step = max(self.fresh_from_step, int(steps))


class DrawGuard:
    """The ``DrawRecord`` of every secret that drew on one ledger: noise keys (held weakly, by
    identity) and sampling seeds (by value). A plain Python object: no saver reaches it."""

    def __init__(self):
        self._keys: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._seeds: dict = {}

    def __repr__(self) -> str:
        return f"DrawGuard({len(self._keys)} key(s), {len(self._seeds)} seed(s))"  # never a seed

    def key_record(self, key, new: bool = False) -> DrawRecord:
        """The record of the noise key held by ``key``.

        Args:
          key: the object holding the key (``NoiseKeyGuard``'s token for its current seed).
          new: start a fresh record (the key has just moved to this ledger).

        Returns:
          Its record on this ledger.
        """
        record = self._keys.get(key)
        if record is None or new:
            record = self._keys[key] = DrawRecord()
        return record

    def known_key_record(self, key):
        """The record of ``key`` if it has one here, else None.

        Args:
          key: the object holding the key.

        Returns:
          A ``DrawRecord`` or None.
        """
        return self._keys.get(key)

    def seed_record(self, seed: int) -> DrawRecord:
        """The record of sampling seed ``seed`` (created at generation 0).

        Args:
          seed: the user's sampling seed.

        Returns:
          Its record on this ledger.
        """
        return self._seeds.setdefault(int(seed), DrawRecord())
