"""The secret that determines a run's noise, held in process memory only.

Whoever knows the Philox key can regenerate every step's noise, subtract it from the
change of the weights between two released iterates, and recover the exact clipped
gradient sum — and with it which examples were in the batch. So the key is NEVER saved:
it is not a Keras variable of the optimizer (``.keras`` files, weights files and
checkpoints store those), not in ``get_config``, not in ``privacy.json``. A run started
with ``seed=None`` draws its key from the OS CSPRNG, and a resumed run draws a fresh one.
A user seed is the user's secret and keys only a model whose ledger has taken no DP step:
two resumes of one file with one seed would draw the same noise at the same steps, which
cancels in the difference of their releases (``DPOptimizer.guard_noise_counter`` refuses;
``set_seed(seed, allow_resume=True)`` is a lab run's opt-in). Uniqueness of the draws
over the model's whole life comes from the counter (the ledger's DP step count, saved
with the model) under one key: see ``tf_dp.noise.gaussian``.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Optional

import numpy as np
import tensorflow as tf


def new_seed() -> int:
    """A fresh 63-bit seed from the OS CSPRNG (used when the user passes ``seed=None``)."""
    return secrets.randbits(63)


def secure_key() -> tf.Tensor:
    """A fresh Philox key from the OS CSPRNG at every call of the compiled step
    (``secure_mode``): the noise cannot be reproduced from any stored seed. Not XLA-compilable."""
    return tf.reshape(tf.py_function(lambda: new_seed(), [], tf.int64), [])


class NoiseKey:
    """A 63-bit Philox key in a TF variable that no saver can reach.

    The holder is a plain Python object, not a ``tf.Module``/``Trackable``: an optimizer
    attribute holding it is invisible to Keras saving and to ``tf.train.Checkpoint``, while
    the compiled train step reads the variable like any other (so a new key needs no retrace).

    Args:
      seed: the user's secret seed (an int), or None to draw the key from the OS CSPRNG.
    """

    def __init__(self, seed: Optional[int] = None):
        with tf.init_scope():
            self._variable = tf.Variable(_key_of(seed), trainable=False, name="noise_key",
                                         synchronization=tf.VariableSynchronization.ON_WRITE,
                                         aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    def read(self) -> tf.Tensor:
        return self._variable.read_value()

    def rekey(self, seed: Optional[int] = None, generation: int = 0) -> None:
        """A new key (from ``seed`` and ``generation``, or fresh OS entropy), seen by
        already-traced steps too."""
        self._variable.assign(_key_of(seed, generation))

    def __repr__(self) -> str:
        return "NoiseKey(<secret>)"


def _key_of(seed: Optional[int], generation: int = 0) -> np.int64:
    """The key of ``seed`` (generation 0: the seed itself), a hash of (seed, generation)
    for later generations, or fresh OS entropy without a seed."""
    if seed is None:
        return np.int64(new_seed())
    if generation == 0:
        return np.int64(seed & (2**63 - 1))
    digest = hashlib.sha256(f"tf_dp noise key {seed} {generation}".encode()).digest()
    return np.int64(int.from_bytes(digest[:8], "little") & (2**63 - 1))
