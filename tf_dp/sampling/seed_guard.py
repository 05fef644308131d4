"""The sampling-seed guard: no (sampling seed, step) pair draws the batch of two released runs.

Batch t of a seeded ``fit`` is a function of (``sampling_seed``, t), t the privacy ledger's
step count (``tf_dp.sampling.poisson``). Two runs that train steps t.. from one ledger state
with one seed would share their batch membership, and composing their ledgers as independent
Poisson samplings would understate ε. This module records, per ledger object and seed, the
steps the seed has drawn in this process (a weak mapping: nothing here is ever saved) and, at
the start of each ``fit`` (after BackupAndRestore restored the ledger), tells the stream which
generation of the seed to draw from (docs/algorithms.md B.3):

  * the ledger continues where this seed stopped: generation unchanged, silent;
  * the ledger moved back behind steps the seed has drawn (``load_weights`` of an older
    file, BackupAndRestore): the next generation, whose seed is a SHA-256 hash of
    (seed, generation), reproducible but never a pair already drawn; warned;
  * the ledger holds steps this seed did not draw in this process (a loaded file, a model
    trained elsewhere, another seed on a trained model): warned, since a file resumed twice
    with one seed draws the same batches twice; ``sampling_seed=None`` is the fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
import weakref
from typing import Optional

import numpy as np

_DRAWN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # ledger → {seed: _SeedRecord}


@dataclasses.dataclass
class _SeedRecord:
    """One seed on one ledger: its current generation, and the first sampler step it has not drawn."""

    generation: int
    fresh_from_step: int


def check_sampling_seed(seed) -> None:
    """Refuses a sampling seed that is not an int or None, without naming its value (a seed
    is a secret: no message, warning or repr may carry it)."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
        raise TypeError(f"`sampling_seed` must be an int or None, got a {type(seed).__name__} (value not shown: a "
                        "seed is a secret).")


def generation_seed(seed: int, generation: int) -> int:
    """The seed the sampler of ``generation`` draws from: ``seed`` itself for generation 0
    (today's batches), else 64 bits of SHA-256 of (seed, generation) (docs/algorithms.md B.3)."""
    if generation == 0:
        return int(seed)
    digest = hashlib.sha256(f"tf_dp sampling seed {int(seed)} {int(generation)}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def stream_generation(ledger, seed: Optional[int], first_step: int) -> int:
    """The generation of ``seed`` a fit starting at ledger step ``first_step`` draws from.

    Re-keys (next generation, warned) when ``first_step`` is behind the steps the seed has
    drawn on ``ledger``; warns when the ledger holds steps the seed did not draw in this
    process. A None seed (OS entropy, fresh every fit) is never guarded: generation 0.
    """
    if seed is None:
        return 0
    record = _DRAWN.setdefault(ledger, {}).setdefault(int(seed), _SeedRecord(0, 0))
    if first_step < record.fresh_from_step:
        _warn_rollback(first_step, record.fresh_from_step, record.generation + 1)
        record.generation += 1
    elif first_step > record.fresh_from_step:
        _warn_seeded_resume(first_step)
    record.fresh_from_step = first_step
    return record.generation


def record_drawn(ledger, seed: Optional[int], steps_drawn: int) -> None:
    """The seed's current generation has drawn the batches of the steps below ``steps_drawn``."""
    record = None if seed is None else _DRAWN.get(ledger, {}).get(int(seed))
    if record is not None:
        record.fresh_from_step = max(record.fresh_from_step, int(steps_drawn))


def _warn_rollback(first_step: int, drawn: int, generation: int) -> None:
    warnings.warn(
        f"tf_dp: the privacy ledger is at step {first_step}, behind the {drawn} steps whose batches this "
        "`sampling_seed` has already drawn on this model (load_weights of an earlier file, BackupAndRestore). "
        f"Redrawing them would train two runs on the same batches, so batches are drawn from generation "
        f"{generation} of the seed (a hash of sampling_seed and the generation): still reproducible, never a "
        "batch already drawn (docs/algorithms.md B.3).", UserWarning, stacklevel=4)


def _warn_seeded_resume(first_step: int) -> None:
    warnings.warn(
        f"tf_dp: `sampling_seed` is set, but the privacy ledger has already taken {first_step} DP steps that "
        "this seed did not draw in this process (a loaded .keras file, load_weights into a new model, a model "
        "trained in another process, or a new sampling_seed on a trained model). A file resumed twice with the "
        "same sampling_seed trains both runs on the same batches, and composing their ledgers as independent "
        "samplings understates ε. When resuming a file, pass sampling_seed=None (the default: batches drawn "
        "from OS entropy).", UserWarning, stacklevel=4)
