"""The noise key of a DP optimizer and the guard that no (key, step) pair draws twice.

The key is a secret held in process memory only (``tf_dp.noise.NoiseKey``): never in a
saved model, weights file, checkpoint or ``get_config``. A user seed keys only a model whose
ledger has taken no DP step; a rollback re-keys; a seeded resume is refused unless the lab
run opts in (``set_seed(seed, allow_resume=True)``). See ``tf_dp.noise.key``.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Optional

import numpy as np
import tensorflow as tf

from tf_dp.noise import NoiseKey, secure_key


def check_seed(seed, secure_mode: bool, stacklevel: int = 5) -> None:
    """Refuses a non-int seed and a seed in secure mode; warns on a small (guessable) seed.

    No message names the seed (nor its repr): it keys the noise, and a log, CI output or
    notebook that printed it would let anyone subtract the noise from released weights."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
        raise TypeError(f"`seed` must be an int or None, got a {type(seed).__name__} (value not shown: a seed "
                        "is a secret).")
    if seed is not None and abs(int(seed)) < 2**32:
        warnings.warn(
            "tf_dp: the `seed` given determines the noise and is small (below 2**32): anyone who knows or guesses "
            "it can subtract the noise from released weights. Use seed=None (a fresh key from the OS) for a "
            "model you release, or a secret 64-bit seed.", UserWarning, stacklevel=stacklevel)
    if secure_mode and seed is not None:
        raise ValueError("`secure_mode=True` draws every step's noise key from the OS CSPRNG; it accepts no "
                         "`seed`. Pass seed=None (or secure_mode=False for reproducible runs).")


class NoiseKeyGuard:
    """The optimizer's Philox key with its record of which ledger steps it has drawn.

    A plain Python object (no ``tf.Module``): savers never reach the key.

    Args:
      seed: the user's secret seed, or None for a fresh key from the OS.
      secure_mode: a fresh OS key at every step instead (``noise_key``).
    """

    def __init__(self, seed: Optional[int], secure_mode: bool):
        check_seed(seed, secure_mode, stacklevel=6)
        self.secure_mode = secure_mode
        self.user_seed = None if seed is None else int(seed)
        self._key = NoiseKey(self.user_seed)
        self._window_open = False  # drawing_window: set only by the model's train function
        self._start(resume_allowed=False)

    def __repr__(self) -> str:
        return "NoiseKeyGuard(<secret>)"

    def set_seed(self, seed: Optional[int], allow_resume: bool = False) -> None:
        """Re-keys from ``seed`` (None: fresh OS entropy); see ``DPOptimizer.set_seed``."""
        check_seed(seed, self.secure_mode)
        if not isinstance(allow_resume, bool):
            raise TypeError(f"`allow_resume` must be a bool, got {allow_resume!r}.")
        if allow_resume and seed is None:
            raise ValueError("`allow_resume=True` applies to a seed; seed=None (a fresh OS key) resumes soundly "
                             "without it.")
        if allow_resume:
            warnings.warn(
                "tf_dp: set_seed(seed, allow_resume=True) lets this seed key a resumed model. Resuming one file "
                "twice with it draws the same noise at the same steps, and the two releases cancel it: this VOIDS "
                "the DP guarantee. Use it only for runs whose results are never released.", UserWarning, stacklevel=3)
        self.user_seed = None if seed is None else int(seed)
        self._key.rekey(self.user_seed)
        self._start(resume_allowed=allow_resume)

    def _start(self, resume_allowed: bool) -> None:
        """A new key that has drawn nothing yet, for no model yet: a new token, so no ledger
        holds a record of it (``PrivacyLedger.draws``)."""
        self._resume_allowed = resume_allowed
        self._generation = 0
        self._token = _KeyToken()  # what the ledgers' draw records of this key are kept under
        self._ledger = lambda: None  # a weak reference to the ledger this key draws for

    def guard(self, dp_step: int, ledger, name: str) -> bool:
        """Before DP steps start at ``ledger``'s count ``dp_step``: re-keys or refuses so that
        no (key, step) pair ever draws noise twice (``DPOptimizer.guard_noise_counter``). What
        the key has drawn is kept with the ledger, in the one draw guard the sampling seed
        uses too (``tf_dp.accounting.draws``).

        Returns:
          True when the steps about to run do not continue this key's own draws (a new key, a
          resumed or rolled-back ledger): a stateful privatizer must start afresh.
        """
        generation, seeded = self._generation, self.user_seed is not None
        bound = self._ledger() is ledger
        if not bound:
            if self._drew(self._ledger()):
                self._rekey_next_generation()
            self._ledger = weakref.ref(ledger)
        record = ledger.draws.key_record(self._token, new=not bound)
        continues = bound and dp_step == record.fresh_from_step
        if dp_step < record.fresh_from_step:
            self._rekey_next_generation()
        elif seeded and not self._resume_allowed and not (
                dp_step == 0 or (record.from_zero and dp_step == record.fresh_from_step)):
            self._refuse_seeded_resume(dp_step, name)
        record.start(dp_step)
        record.from_zero = record.from_zero and seeded  # a seed continues only what it drew from step 0
        return self._generation != generation or not (continues or dp_step == 0)

    def _drew(self, ledger) -> bool:
        """Whether this key (its current generation) has drawn, or started from step 0, on ``ledger``."""
        record = None if ledger is None else ledger.draws.known_key_record(self._token)
        return record is not None and bool(record.fresh_from_step or record.from_zero)

    def _rekey_next_generation(self) -> None:
        self._generation += 1
        self._key.rekey(self.user_seed, self._generation)

    def _refuse_seeded_resume(self, dp_step: int, name: str) -> None:
        """A seed may continue only where it left off on a ledger it has keyed since step 0."""
        raise ValueError(
            f"{name}: the optimizer's seed would key noise on a model whose privacy ledger has already "
            f"taken {dp_step} DP steps this key did not draw (a loaded .keras, load_weights, a model trained in "
            "another process, or a new optimizer or seed on a trained model). A seeded resume redraws the noise "
            "of steps that a copy of the same file may already have released, and two such releases cancel their "
            "noise. Resume with `optimizer.seed = None` (a fresh secret key from the OS, the default: fully "
            "private, reproducible in every other respect); for a lab run whose results are never released, "
            "`optimizer.set_seed(seed, allow_resume=True)` (voids the guarantee if a file is resumed twice).")

    def record(self, dp_step: int) -> None:
        """Steps below ``dp_step`` have drawn noise with the current key."""
        ledger = self._ledger()
        if ledger is not None:
            ledger.draws.key_record(self._token).drew(dp_step)

    def drawn_steps(self) -> int:
        """The first step of its ledger this key has not drawn (0 before any)."""
        ledger = self._ledger()
        record = None if ledger is None else ledger.draws.known_key_record(self._token)
        return 0 if record is None else record.fresh_from_step

    @contextlib.contextmanager
    def drawing_window(self):
        """Noise may be drawn inside this block only: the model's train function holds it
        open around each execution, after ``guard`` (docs/algorithms.md A.2)."""
        previous, self._window_open = self._window_open, True
        try:
            yield
        finally:
            self._window_open = previous

    def require_window(self, dp_step, name: str) -> None:
        """Raises unless a drawing window is open and ``dp_step`` (when known on the host) is
        not a step this key has already drawn: a direct call would redraw released noise."""
        if not self._window_open:
            raise RuntimeError(
                f"{name}: apply_private_gradients was called outside a DP step. The noise of a step is "
                "drawn only inside the train function of fit()/train_on_batch(), after the noise-key guard, "
                "so that no (key, step) pair draws twice; a direct call could redraw the noise of a released "
                "step. Nothing was released. Train with model.fit()/train_on_batch(), or, in a train_step of "
                "your own, with the model's public private-gradient call.")
        step = _host_value(dp_step)
        if step is not None and step < self.drawn_steps():
            raise RuntimeError(f"{name}: DP step {step} has already drawn noise with this key; drawing it again "
                               "would let two releases cancel their noise. Nothing was released.")

    def read(self) -> tf.Tensor:
        """This step's Philox key: the in-memory key, or fresh OS entropy in secure mode."""
        return secure_key() if self.secure_mode else self._key.read()


class _KeyToken:
    """Identifies one seeding of a key in the ledgers' draw records (held weakly there)."""

    __slots__ = ("__weakref__",)


def _host_value(dp_step) -> Optional[int]:
    """``dp_step`` as an int when the host knows it (a Python int or an eager tensor), else None."""
    if isinstance(dp_step, (int, np.integer)):
        return int(dp_step)
    if isinstance(dp_step, tf.Tensor) and not tf.is_symbolic_tensor(dp_step):
        return int(dp_step.numpy())
    return None
