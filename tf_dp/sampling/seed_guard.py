"""The sampling-seed guard: no (sampling seed, step) pair draws the batch of two released runs.

Batch t of a seeded ``fit`` is a function of (``sampling_seed``, t), t the privacy ledger's
step count (``tf_dp.sampling.poisson``). Two runs that train steps t.. from one ledger state
with one seed would share their batch membership, and composing their ledgers as independent
Poisson samplings would understate ε. The steps the seed has drawn in this process are kept
with the ledger object, in the draw guard the noise key uses too (``PrivacyLedger.draws``,
``tf_dp.accounting.draws``: nothing there is ever saved). At the start of each ``fit`` (after
BackupAndRestore restored the ledger; ``tf_dp.models.private_run``) this module tells the
stream which generation of the seed to draw from (docs/algorithms.md B.3):

  * the ledger continues where this seed stopped: generation unchanged, silent;
  * the ledger moved back behind steps the seed has drawn (``load_weights`` of an older
    file, BackupAndRestore): the next generation, whose seed is a SHA-256 hash of
    (seed, generation), reproducible but never a pair already drawn; warned;
  * the ledger holds steps this seed did not draw in this process (a loaded file, a model
    trained elsewhere, another seed on a trained model): warned, since a file resumed twice
    with one seed draws the same batches twice; ``sampling_seed=None`` is the fix.
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Optional

import numpy as np

from tf_dp.accounting.draws import AHEAD, ROLLED_BACK


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
    record = ledger.draws.seed_record(seed)
    drawn = record.fresh_from_step
    verdict = record.start(first_step)
    if verdict == ROLLED_BACK:
        _warn_rollback(first_step, drawn, record.generation + 1)
        record.generation += 1
    elif verdict == AHEAD:
        _warn_seeded_resume(first_step)
    return record.generation


def record_drawn(ledger, seed: Optional[int], steps_drawn: int) -> None:
    """The seed's current generation has drawn the batches of the steps below ``steps_drawn``."""
    if seed is not None:
        ledger.draws.seed_record(seed).drew(steps_drawn)


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
