"""The seed flags shared by the example scripts: public initial weights, secret noise.

Two different things are seeded in a DP run, with opposite requirements:

* ``--seed`` (default 0) fixes the initial weights (``keras.utils.set_random_seed``) and
  any random subset of the data an example draws. Both are data-independent, so they may
  be public: the (ε, δ) guarantee holds for whatever fixed starting point and rows are used.
* ``--noise_seed`` (default None) fixes the Gaussian (and Laplace) noise key and the Poisson
  batches. Left unset, the optimizer draws its key from the OS CSPRNG and ``fit`` its
  batches from OS entropy (tf_dp never derives either from Keras' global seed). Set, anyone
  who knows or guesses it can regenerate every step's noise and batch and subtract the noise
  from the released weights: re-running under "with x" and "without x" then tells which is
  the truth exactly, so the run's ε is no privacy guarantee. It exists only to reproduce a
  run bit for bit, and the scripts print a warning whenever it is set.
"""

from __future__ import annotations

from typing import Optional

from absl import flags

NOISE_SEED_HELP = (
    "Seed of the noise and the Poisson batches, for a bit-for-bit reproducible run. Setting it VOIDS THE PRIVACY "
    "GUARANTEE: whoever knows it can regenerate the noise and the batches and subtract the noise from the released "
    "weights. Default: fresh OS entropy for both (never saved) — the private setting.")
FIXED_NOISE_WARNING = (
    "WARNING: --noise_seed={seed} fixes the noise and the Poisson batches: anyone who knows it can regenerate "
    "them and subtract the noise from the released weights, so the epsilon printed by this run is NO privacy "
    "guarantee. Leave --noise_seed unset for a private run (fresh OS entropy).")


def define_seed_flags(public_seed_help: str = "Seed of the initial weights (public: data-independent).") -> None:
    """Defines ``--seed`` (public, default 0) and ``--noise_seed`` (secret, default None)."""
    flags.DEFINE_integer("seed", 0, public_seed_help)
    flags.DEFINE_integer("noise_seed", None, NOISE_SEED_HELP)


def noise_seed() -> Optional[int]:
    """``--noise_seed`` (None: OS entropy) for the optimizers' ``seed`` and ``fit``'s
    ``sampling_seed``; call :func:`warn_if_fixed_noise` once per run when it is set."""
    return flags.FLAGS.noise_seed


def warn_if_fixed_noise() -> None:
    """Prints the warning that a fixed ``--noise_seed`` voids the guarantee (no-op unset)."""
    if flags.FLAGS.noise_seed is not None:
        print(FIXED_NOISE_WARNING.format(seed=flags.FLAGS.noise_seed), flush=True)
