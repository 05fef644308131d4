"""The privatizing half of every tf_dp optimizer: noise once, average by L, then update.

A DP optimizer never sees raw gradients. The model (``tf_dp.DPModel``) hands it the SUM
of per-example clipped gradients Σ_i ḡ_i; the optimizer applies the Gaussian mechanism
and the average of docs/algorithms.md §1 steps 4–5,

    ĝ = (Σ_i ḡ_i + N(0, σ²C² I)) / L,

and passes ĝ to its base Keras update (SGD, Adam, AdamW; DiSK/FIBER filter ĝ inside
``update_step``, where Keras hands it the gradient summed over tf.distribute replicas). L is the expected
batch size under Poisson sampling (never the realized size) or the public size of an
explicit batch. Calling ``apply``/``apply_gradients`` directly — what a plain
``keras.Model`` does — raises, so a DP optimizer can never train non-privately by accident.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from tf_dp import _checks
from tf_dp.clipping import CURRENT_WEIGHTS
from tf_dp.noise import NoiseKey, add_gaussian_noise, secure_key

_NOT_CALIBRATED = float("nan")


def _replica() -> tuple:
    """(this replica's id, number of replicas) under tf.distribute; (0, 1) otherwise."""
    context = tf.distribute.get_replica_context()
    if context is None:
        return 0, 1
    return context.replica_id_in_sync_group, context.num_replicas_in_sync


class DPOptimizer:
    """Mixin placed before a Keras optimizer class: ``class DPSGD(DPOptimizer, keras.optimizers.SGD)``.

    Args:
      l2_norm_clip: C, the per-example clipping bound (flat L2 norm over all trainable
        variables).
      noise_multiplier: σ; the noise on the clipped sum has std σ·C. ``None`` only when a
        ``target_epsilon`` given to ``DPModel.compile`` calibrates it before training.
      seed: key of the noise stream (reproducible). ``None`` draws a fresh one from the OS.
        The key is a secret kept in memory only: it is never written into a saved model,
        weights file, checkpoint or ``get_config`` (whoever held it could subtract the
        noise). A seed keys only a model whose ledger has taken no DP step: a resumed
        model trains with ``seed=None`` (see ``set_seed``).
      secure_mode: draw a fresh key from the OS CSPRNG at every step (and Poisson batches
        from OS entropy): the production setting; no seed, no XLA.
    """

    def _init_dp(self, l2_norm_clip: float, noise_multiplier: Optional[float], seed: Optional[int],
                 secure_mode: bool = False):
        l2_norm_clip = _checks.positive("l2_norm_clip", l2_norm_clip, "It is the per-example clip bound C.")
        if noise_multiplier is not None:
            noise_multiplier = _checks.non_negative(
                "noise_multiplier", noise_multiplier, "Noise std on the clipped sum is noise_multiplier * l2_norm_clip."
            )
        if not isinstance(secure_mode, bool):
            raise TypeError(f"`secure_mode` must be a bool, got {secure_mode!r}.")
        self._check_seed(seed, secure_mode)
        self.secure_mode = secure_mode
        self._user_seed = None if seed is None else int(seed)
        self._noise_key = NoiseKey(self._user_seed)
        self._start_key(resume_allowed=False)
        with keras.name_scope(self.name, caller=self):
            self._l2_norm_clip = self._dp_variable("l2_norm_clip", l2_norm_clip, "float32")
            self._noise_multiplier = self._dp_variable(
                "noise_multiplier", _NOT_CALIBRATED if noise_multiplier is None else noise_multiplier, "float32"
            )
            # σ_w = σ·C/L of the latest step, the noise std on the averaged gradient; read
            # by noise-bias corrections (DP-AdamBC, FIBER).
            self._averaged_noise_stddev = self._dp_variable("averaged_noise_stddev", 0.0, "float32")

    @staticmethod
    def _check_seed(seed, secure_mode: bool):
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
            raise TypeError(f"`seed` must be an int or None, got {seed!r}.")
        if seed is not None and abs(int(seed)) < 2**32:
            warnings.warn(
                f"tf_dp: seed={seed} determines the noise: anyone who knows or guesses it (small seeds are easy to "
                "guess) can subtract the noise from released weights. Use seed=None (a fresh key from the OS) for a "
                "model you release, or a secret 64-bit seed.", UserWarning, stacklevel=4)
        if secure_mode and seed is not None:
            raise ValueError("`secure_mode=True` draws every step's noise key from the OS CSPRNG; it accepts no "
                             "`seed`. Pass seed=None (or secure_mode=False for reproducible runs).")

    def _dp_variable(self, name, value, dtype):
        variable = keras.Variable(
            np.asarray(value, dtype=dtype), name=name, dtype=dtype, trainable=False,
            aggregation="only_first_replica",
        )
        self._track_variable(variable)
        return variable

    # -- the DP parameters, single source of truth for model, optimizer and accountant --
    @property
    def l2_norm_clip(self) -> float:
        return float(self._l2_norm_clip.numpy())

    @l2_norm_clip.setter
    def l2_norm_clip(self, value: float):
        self._l2_norm_clip.assign(_checks.positive("l2_norm_clip", value))

    @property
    def noise_multiplier(self) -> Optional[float]:
        value = float(self._noise_multiplier.numpy())
        return None if np.isnan(value) else value

    @noise_multiplier.setter
    def noise_multiplier(self, value: float):
        self._noise_multiplier.assign(_checks.non_negative("noise_multiplier", value))

    @property
    def seed(self) -> Optional[int]:
        return self._user_seed

    @seed.setter
    def seed(self, value: Optional[int]):
        """Re-keys the noise: None for a fresh key from the OS; a seed only before the
        model's first DP step (``set_seed``)."""
        self.set_seed(value)

    def __setattr__(self, name, value):
        if name == "seed":  # Keras skips assigning the value an attribute already holds: always re-key
            self.set_seed(value)
            return
        super().__setattr__(name, value)

    def set_seed(self, seed: Optional[int], allow_resume: bool = False) -> None:
        """Re-keys the noise from ``seed`` (None: a fresh secret key from the OS).

        A seeded key may start drawing only on a model whose ledger has taken NO DP step
        (then it continues across ``fit`` calls in this process). On a resumed model (a
        loaded ``.keras``, ``load_weights``, a trained model given a new optimizer) it
        would redraw the noise of steps a copy of the same file may already have released,
        and two such releases cancel their noise: the first step refuses. Resume with
        ``seed=None`` (fully private; reproducible in every other respect).

        Args:
          seed: the secret key, or None.
          allow_resume: lets the seed key a resumed model, for lab runs whose results are
            never released: it VOIDS the DP guarantee as soon as one file is resumed twice
            with this seed (warned).
        """
        self._check_seed(seed, self.secure_mode)
        if not isinstance(allow_resume, bool):
            raise TypeError(f"`allow_resume` must be a bool, got {allow_resume!r}.")
        if allow_resume and seed is None:
            raise ValueError("`allow_resume=True` applies to a seed; seed=None (a fresh OS key) resumes soundly "
                             "without it.")
        if allow_resume:
            warnings.warn(
                f"tf_dp: set_seed({seed}, allow_resume=True) lets this seed key a resumed model. Resuming one file "
                "twice with it draws the same noise at the same steps, and the two releases cancel it: this VOIDS "
                "the DP guarantee. Use it only for runs whose results are never released.", UserWarning, stacklevel=2)
        self._user_seed = None if seed is None else int(seed)
        self._noise_key.rekey(self._user_seed)
        self._start_key(resume_allowed=allow_resume)

    def _start_key(self, resume_allowed: bool) -> None:
        """A new key that has drawn nothing yet, for no model yet."""
        self._resume_allowed = resume_allowed
        self._key_generation, self._fresh_from_step = 0, 0
        self._noise_ledger = lambda: None  # a weak reference to the ledger this key draws for
        self._seeded_from_zero = False  # this key's seed has drawn on that ledger since its step 0

    def guard_noise_counter(self, dp_step: int, ledger) -> None:
        """Called before DP steps start at ``ledger``'s count ``dp_step``; refuses or re-keys
        so that no (key, step) pair ever draws noise twice.

        * Another model's ledger: a key that has drawn noise is replaced (next generation).
        * Rolled back (``dp_step`` behind steps this key has drawn: load_weights of an older
          file, BackupAndRestore, a restored checkpoint): re-key. Without a seed the new key
          is fresh OS entropy; with one, a hash of (seed, generation), reproducible.
        * A seed on a ledger that has taken steps this key has not drawn (a resume) raises,
          unless ``set_seed(..., allow_resume=True)``.
        """
        if self._noise_ledger() is not ledger:
            if self._fresh_from_step or self._seeded_from_zero:
                self._rekey_next_generation()
            self._noise_ledger, self._fresh_from_step, self._seeded_from_zero = weakref.ref(ledger), 0, False
        if dp_step < self._fresh_from_step:
            self._rekey_next_generation()
            self._fresh_from_step = dp_step
        elif self._user_seed is not None and not self._resume_allowed:
            self._refuse_seeded_resume(dp_step)
        if dp_step == 0:
            self._seeded_from_zero = self._user_seed is not None

    def _rekey_next_generation(self) -> None:
        self._key_generation += 1
        self._noise_key.rekey(self._user_seed, self._key_generation)

    def _refuse_seeded_resume(self, dp_step: int) -> None:
        """A seed may continue only where it left off on a ledger it has keyed since step 0."""
        if dp_step == 0 or (self._seeded_from_zero and dp_step == self._fresh_from_step):
            return
        raise ValueError(
            f"{self.name}: seed={self._user_seed} would key noise on a model whose privacy ledger has already "
            f"taken {dp_step} DP steps this key did not draw (a loaded .keras, load_weights, a model trained in "
            "another process, or a new optimizer or seed on a trained model). A seeded resume redraws the noise "
            "of steps that a copy of the same file may already have released, and two such releases cancel their "
            "noise. Resume with `optimizer.seed = None` (a fresh secret key from the OS, the default: fully "
            "private, reproducible in every other respect); for a lab run whose results are never released, "
            "`optimizer.set_seed(seed, allow_resume=True)` (voids the guarantee if a file is resumed twice).")

    def record_noise_counter(self, dp_step: int) -> None:
        """Steps below ``dp_step`` have drawn noise with the current key."""
        self._fresh_from_step = max(self._fresh_from_step, int(dp_step))

    def noise_key(self) -> tf.Tensor:
        """This step's Philox key: the in-memory key, or fresh OS entropy in secure mode."""
        return secure_key() if self.secure_mode else self._noise_key.read()

    def noise_multiplier_tensor(self) -> tf.Tensor:
        """σ as a tensor, read once per compiled step (noise and ledger use the same read)."""
        return self._noise_multiplier.value

    def clip_bound(self) -> tf.Tensor:
        """C as a tensor, read inside the compiled train step."""
        return self._l2_norm_clip.value

    # -- the mechanism --
    def apply(self, grads, trainable_variables=None):
        raise TypeError(
            f"{type(self).__name__} is a differentially private optimizer and refuses raw "
            "gradients: they are neither clipped per example nor noised. Train with "
            "`tf_dp.DPModel`, `tf_dp.DPSequential` or `tf_dp.make_private(model)` instead of a "
            "plain keras.Model; those hand the optimizer per-example clipped sums."
        )

    def apply_private_gradients(
        self,
        clipped_sums: Sequence[tf.Tensor],
        trainable_variables: Sequence,
        expected_batch_size: tf.Tensor,
        public_gradients: Optional[Sequence[Optional[tf.Tensor]]] = None,
        *,
        dp_step: tf.Tensor,
        noise_multiplier: Optional[tf.Tensor] = None,
        release: Optional[tf.Tensor] = None,
    ):
        """ĝ = (Σ_i ḡ_i + N(0, σ²C² I)) / L, then the base optimizer's update with ĝ.

        Args:
          clipped_sums: Σ_i ḡ_i per variable, each ḡ_i clipped to flat norm ≤ C.
          trainable_variables: the variables, aligned with ``clipped_sums``.
          expected_batch_size: L — expected Poisson batch size or an explicit batch's size.
          public_gradients: data-independent terms (e.g. weight regularizers) added after
            averaging; they cost no privacy.
          dp_step: the model's DP step count before this step (its ledger's): the noise
            counter, unique over the model's life.
          noise_multiplier: σ of this step (default: the variable's value), the same read
            the ledger records.
          release: 1.0, or 0.0 when a privacy budget forbids this step: then the base
            update receives a zero gradient (a function of public state only).
        """
        trainable_variables = list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
        sigma = self.noise_multiplier_tensor() if noise_multiplier is None else noise_multiplier
        stddev_on_sum = sigma * self._l2_norm_clip.value
        denominator = tf.cast(expected_batch_size, tf.float32)
        replica, replicas = _replica()
        # Under tf.distribute the R replicas' averaged gradients are SUMMED by the optimizer:
        # each adds an independent N(0, σ²C²/R) share, so the global sum carries exactly
        # N(0, σ²C²), added once (R = 1: the plain mechanism).
        noisy_sums = add_gaussian_noise(list(clipped_sums), stddev_on_sum / replicas**0.5, self.noise_key(),
                                        dp_step, replica, replicas)
        averaged = [g / tf.cast(denominator, g.dtype) for g in noisy_sums]
        if release is not None:
            averaged = [g * tf.cast(release, g.dtype) for g in averaged]
        self._averaged_noise_stddev.assign(stddev_on_sum / denominator)
        if public_gradients is not None:
            averaged = [g if p is None else g + tf.cast(p, g.dtype) for g, p in zip(averaged, public_gradients)]
        return super().apply(averaged, trainable_variables)

    def evaluation_points(self, trainable_variables) -> tuple:
        """Where the model evaluates per-example gradients this step: θ_t for DP-SGD."""
        return CURRENT_WEIGHTS

    def averaged_noise_stddev(self) -> tf.Tensor:
        """σ_w = σ·C/L of the latest step (public: a function of the hyperparameters)."""
        return self._averaged_noise_stddev.value

    def noise_variance_on_average(self, dtype) -> tf.Tensor:
        """σ_w² = (σ·C/L)², the per-coordinate variance the noise adds to ĝ this step."""
        return tf.square(tf.cast(self._averaged_noise_stddev.value, dtype))

    def _dp_config(self) -> dict:
        return {
            "l2_norm_clip": self.l2_norm_clip,
            "noise_multiplier": self.noise_multiplier,
            "seed": None,  # the seed is the user's secret: never serialized
            "secure_mode": self.secure_mode,
        }
