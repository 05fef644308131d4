"""``DPOptimizer(inner)``: makes any ``keras.optimizers.Optimizer`` differentially private.

A DP optimizer never sees raw gradients. The model (``tf_dp.DPModel``) hands it the SUM
of per-example clipped gradients Σ_i ḡ_i; the optimizer runs the chain of
``tf_dp.optimizers.transforms`` (docs/algorithms.md §1 steps 4–5),

    ĝ_t = (Σ_i ḡ_i + z_t) / L,   z_t ~ N(0, σ² S(C)² I)   (S(C) = clipping.sensitivity(C)),

then its filters (DiSK, FIBER), then the INNER optimizer's update with the result:
``DPOptimizer(keras.optimizers.Lion(1e-3), noise_multiplier=1.0)`` is DP-Lion. L is the
expected batch size under Poisson sampling (never the realized size) or the public size of
an explicit batch. Calling ``apply``/``apply_gradients`` directly — what a plain
``keras.Model`` does — raises, so a DP optimizer can never train non-privately by accident.

In the manner of Keras' ``LossScaleOptimizer``, the inner optimizer is part of the config,
builds and owns its variables, and ``learning_rate``, ``iterations`` and Keras' base
options (EMA, gradient accumulation, weight decay, gradient clipping of the noisy average)
are the inner's. The saved state is one flat list — the inner's iteration and learning
rate, the DP variables (C, σ, σ_w), the inner's slots, then the transforms' state — the
layout the tf_dp optimizers have always saved, so older ``.keras`` files load and resume.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from tf_dp import _checks, streams
from tf_dp.clipping import CURRENT_WEIGHTS
from tf_dp.clipping.policy import resolve_clipping
from tf_dp.noise.privatizer import resolve_privatizer
from tf_dp.noise.release import SumNoise, noised_sum
from tf_dp.optimizers import transforms
from tf_dp.optimizers.clipped_sum import ClippedSum
from tf_dp.optimizers.key_guard import NoiseKeyGuard

_NOT_CALIBRATED = float("nan")


def _replica() -> tuple:
    """(this replica's id, number of replicas) under tf.distribute; (0, 1) otherwise."""
    context = tf.distribute.get_replica_context()
    if context is None:
        return 0, 1
    return context.replica_id_in_sync_group, context.num_replicas_in_sync


class _InnerAttribute:
    """A Keras base-optimizer option (``use_ema``, ``weight_decay``, ...) that belongs to the
    inner optimizer: read and set there. Keras' own ``__init__``/``build`` of the wrapper see
    the default, so the wrapper keeps no EMA or accumulator of its own."""

    def __init__(self, default):
        self.default = default

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, optimizer, owner=None):
        if optimizer is None:
            return self
        inner = optimizer.__dict__.get("inner_optimizer")
        if inner is None or optimizer.__dict__.get("_building_own_state", False):
            return self.default
        return getattr(inner, self.name)

    def __set__(self, optimizer, value):
        inner = optimizer.__dict__.get("inner_optimizer")
        if inner is not None:
            setattr(inner, self.name, value)
        elif value != self.default:
            raise ValueError(f"Set `{self.name}` on the inner optimizer, not on tf_dp.DPOptimizer.")


_BASE_OPTIONS = {
    "weight_decay": None, "clipnorm": None, "global_clipnorm": None, "clipvalue": None, "use_ema": False,
    "ema_momentum": 0.99, "ema_overwrite_frequency": None, "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}


@keras.saving.register_keras_serializable(package="tf_dp")
class DPOptimizer(keras.optimizers.Optimizer):
    """``DPOptimizer(inner, l2_norm_clip=1.0, noise_multiplier=None, seed=None, secure_mode=False,
    noise=None, clipping=None, name="DPOptimizer")``.

    Args:
      inner_optimizer: the Keras optimizer that updates the weights with the privatized
        gradient (not built yet, not itself a DP optimizer).
      l2_norm_clip: C, the per-example clipping bound; or an adaptive bound (an object with
        ``next_bound(C_t, squared_norms, mask, expected_batch_size, key, dp_step,
        noise_multiplier=σ)`` and ``gradient_noise_multiplier(σ, expected_batch_size)``, e.g.
        ``tf_dp.clipping.AdaptiveClip``) whose current C_t lives in the ``l2_norm_clip``
        variable; ``next_bound`` receives the step's σ so that it releases nothing noised
        below what the ledger records (docs/algorithms.md §12).
      noise_multiplier: σ; the noise on the clipped sum has std σ·clipping.sensitivity(C).
        ``None`` only when a ``target_epsilon`` given to ``DPModel.compile`` calibrates it.
      seed: key of the noise stream (reproducible). ``None`` draws a fresh one from the OS.
        The key is a secret kept in memory only: never in a saved model, weights file,
        checkpoint or ``get_config``. A seed keys only a model whose ledger has taken no DP
        step: a resumed model trains with ``seed=None`` (see ``set_seed``). One seed keys one
        released model: two models trained with the same seed (a sweep, another data set)
        draw the same noise at the same steps, so their difference cancels it and the two
        releases together are NOT bounded by composing their ε (docs/algorithms.md B.3).
      secure_mode: a fresh key from the OS CSPRNG at every step (and Poisson batches from
        OS entropy): the production setting; no seed, no XLA.
      noise: the privatizer (``tf_dp.noise.Privatizer``, a registered name, or None for
        ``GaussianNoise()``).
      clipping: the clipping policy (``tf_dp.clipping.ClippingPolicy``, a registered name, or
        None for ``"flat"``).
      name: the optimizer's name.
      **kwargs: refused: options of the base optimizer (clipnorm, ...) raise a ValueError
        telling to set them on the inner optimizer; any other raises a TypeError.
    """

    weight_decay = _InnerAttribute(None)
    clipnorm = _InnerAttribute(None)
    global_clipnorm = _InnerAttribute(None)
    clipvalue = _InnerAttribute(None)
    use_ema = _InnerAttribute(False)
    ema_momentum = _InnerAttribute(0.99)
    ema_overwrite_frequency = _InnerAttribute(None)
    loss_scale_factor = _InnerAttribute(None)
    gradient_accumulation_steps = _InnerAttribute(None)

    def __init__(self, inner_optimizer, l2_norm_clip=1.0, noise_multiplier: Optional[float] = None,
                 seed: Optional[int] = None, secure_mode: bool = False, noise=None, clipping=None,
                 name: Optional[str] = None, **kwargs):
        _refuse_base_options(kwargs)
        _check_inner(inner_optimizer)
        if not isinstance(secure_mode, bool):
            raise TypeError(f"`secure_mode` must be a bool, got {secure_mode!r}.")
        adaptive = l2_norm_clip if _is_adaptive(l2_norm_clip) else None
        initial_clip = _initial_clip(l2_norm_clip, adaptive)
        if noise_multiplier is not None:
            noise_multiplier = _checks.non_negative(
                "noise_multiplier", noise_multiplier,
                "Noise std on the clipped sum is noise_multiplier * l2_norm_clip.")
        super().__init__(learning_rate=0.0, name=name or "DPOptimizer")
        self.inner_optimizer = inner_optimizer
        self._inner_base_variables = list(inner_optimizer.variables)  # its iteration (and learning rate)
        self.secure_mode = secure_mode
        self._key_guard = NoiseKeyGuard(seed, secure_mode)
        self.adaptive_clip = adaptive
        self.privatizer = resolve_privatizer(noise)
        self.clipping = resolve_clipping(clipping)
        self.clipping.check_clip_norm(l2_norm_clip)  # before training: e.g. named thresholds vs C
        with keras.name_scope(self.name, caller=self):
            self._l2_norm_clip = self._dp_variable("l2_norm_clip", initial_clip)
            self._noise_multiplier = self._dp_variable(
                "noise_multiplier", _NOT_CALIBRATED if noise_multiplier is None else noise_multiplier)
            # σ_w = σ·S(C)/L of the latest step, the noise std on the averaged gradient: the
            # public record behind the ``noise_std`` log (the chain passes σ_w on as a value).
            self._averaged_noise_stddev = self._dp_variable("averaged_noise_stddev", 0.0)
        self.filters = []  # GradientFilter parts, in chain order
        self.observation = None  # a TwoPointObservation, or None for the gradient at θ_t
        self._part_states = []  # (part, its state) once built

    def _dp_variable(self, name, value):
        variable = keras.Variable(np.asarray(value, dtype="float32"), name=name, dtype="float32", trainable=False,
                                  aggregation="only_first_replica")
        self._track_variable(variable)
        return variable

    def __dir__(self):
        # Keras' saver walks dir(): the inner's state is saved in this optimizer's own flat
        # list (``save_own_variables``), not a second time under "inner_optimizer".
        return [name for name in super().__dir__() if name != "inner_optimizer"]

    def __setattr__(self, name, value):
        if name == "seed":  # Keras skips assigning the value an attribute already holds: always re-key
            self.set_seed(value)
            return
        super().__setattr__(name, value)

    # -- delegated to the inner optimizer (as LossScaleOptimizer) --
    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    @property
    def _model_variables_moving_average(self):
        return self.inner_optimizer._model_variables_moving_average  # Keras' EMA (ParameterAveraging)

    @property
    def _accumulated_gradients(self):
        return self.inner_optimizer._accumulated_gradients

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

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
        return self._key_guard.user_seed

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
        self._key_guard.set_seed(seed, allow_resume)
        self.privatizer.reset()  # a new key: a stateful privatizer's secret state starts afresh

    def guard_noise_counter(self, dp_step: int, ledger) -> None:
        """Called before DP steps start at ``ledger``'s count ``dp_step``; refuses or re-keys
        so that no (key, step) pair ever draws noise twice.

        * Another model's ledger: a key that has drawn noise is replaced (next generation).
        * Rolled back (``dp_step`` behind steps this key has drawn: load_weights of an older
          file, BackupAndRestore, a restored checkpoint): re-key. Without a seed the new key
          is fresh OS entropy; with one, a hash of (seed, generation), reproducible.
        * A seed on a ledger that has taken steps this key has not drawn (a resume) raises,
          unless ``set_seed(..., allow_resume=True)``.

        A re-key, or steps that do not continue this key's own draws (a resumed model),
        reset the privatizer's secret state (contract of ``tf_dp.noise.Privatizer.reset``).
        """
        if self._key_guard.guard(dp_step, ledger, self.name):
            self.privatizer.reset(int(dp_step))

    def drawing_window(self):
        """A context in which ``apply_private_gradients`` may draw noise; the model's train
        function opens it around each execution, after ``guard_noise_counter``. Outside it the
        call raises before anything is drawn (docs/algorithms.md A.2).

        Returns:
          A context manager.
        """
        return self._key_guard.drawing_window()

    def record_noise_counter(self, dp_step: int) -> None:
        """Steps below ``dp_step`` have drawn noise with the current key."""
        self._key_guard.record(dp_step)

    def _noise_key(self) -> tf.Tensor:
        """This step's Philox key: the in-memory key, or fresh OS entropy in secure mode. Private:
        the key never leaves the optimizer (a plug-in asks for a release, ``release_sum``)."""
        return self._key_guard.read()

    def release_sum(self, total: tf.Tensor, noise: SumNoise, dp_step: tf.Tensor) -> tf.Tensor:
        """A second noised release of this step: ``total`` + one draw of ``noise`` from the
        optimizer's key on the allocated stream ``tf_dp.streams.SUM_RELEASE``, summed over
        replicas (``tf_dp.noise.release.noised_sum``). Drawn only inside the drawing window, like
        the gradient's noise (docs/algorithms.md §5, A.2, B.3); the caller accounts for it.

        Args:
          total: this replica's share of the sum (RaCO-DP: its histogram counts).
          noise: a ``tf_dp.noise.release.SumNoise`` (distribution, sensitivity, multiplier).
          dp_step: the ledger's DP step count before this step (the noise counter).

        Returns:
          The released sum, identical on every replica.
        """
        self._key_guard.require_window(dp_step, self.name)
        return noised_sum(total, noise, self._noise_key(), dp_step, streams.SUM_RELEASE.code)

    def noise_report(self) -> dict:
        """What the latest step's noise was, for reports and logs (public values only).

        Returns:
          {"noise_multiplier": σ, "clip_bound": C_t, "averaged_noise_stddev": σ_w} as tensors.
        """
        return {"noise_multiplier": self.noise_multiplier_tensor(), "clip_bound": self.clip_bound(),
                "averaged_noise_stddev": self.averaged_noise_stddev()}

    def noise_multiplier_tensor(self) -> tf.Tensor:
        """σ as a tensor, read once per compiled step (noise and ledger use the same read)."""
        return self._noise_multiplier.value

    def clip_bound(self) -> tf.Tensor:
        """C (C_t for an adaptive bound) as a tensor, read inside the compiled train step."""
        return self._l2_norm_clip.value

    # -- building the parts --
    def build(self, var_list):
        if self.built:
            return
        var_list = list(var_list)
        self.inner_optimizer.build(var_list)
        self._building_own_state = True
        try:
            super().build(var_list)
        finally:
            self._building_own_state = False
        with keras.name_scope(self.name, caller=self):
            parts = self.filters + ([self.observation] if self.observation is not None else [])
            self._part_states = [(part, part.init(self, var_list)) for part in parts]
        self.privatizer.build(var_list)

    def add_state_variable(self, shape, name: str):
        """A zero-initialized state variable of a part (written in replica context with one
        value on every replica, hence aggregation "only_first_replica")."""
        return self.add_variable(shape=shape, dtype="float32", aggregation="only_first_replica", name=name)

    def add_state_variables(self, variables, name: str, copy_values: bool = False) -> list:
        """One state variable per trainable variable (zeros, or a copy of its value)."""
        return [self.add_variable(shape=v.shape, dtype=v.dtype, aggregation="only_first_replica",
                                  name=f"{v.path.replace('/', '_')}_{name}",
                                  initializer=_value_of(v) if copy_values else "zeros")
                for v in variables]

    def part_state(self, part) -> dict:
        """The state variables of ``part`` (a filter or the observation), by name."""
        for owner, state in self._part_states:
            if owner is part:
                return state
        raise ValueError(f"{self.name} is not built, or {part!r} is not one of its parts.")

    # -- the mechanism --
    def apply(self, grads, trainable_variables=None):
        """Keras' ``apply``: takes one ``ClippedSum`` (what ``tf_dp.DPModel`` hands it each
        step) and runs the DP chain on it (``apply_private_gradients``); raw gradients raise.

        Args:
          grads: a ``tf_dp.optimizers.ClippedSum``.
          trainable_variables: the variables, aligned with ``grads.sums`` (default: the
            variables the optimizer was built with).

        Returns:
          The inner optimizer's iteration count after the update.
        """
        if isinstance(grads, ClippedSum):
            variables = self._trainable_variables if trainable_variables is None else trainable_variables
            return self.apply_private_gradients(
                grads.sums, variables, grads.expected_batch_size, grads.public_gradients,
                dp_step=grads.dp_step, noise_multiplier=grads.noise_multiplier, release=grads.release,
                squared_norms=grads.squared_norms, mask=grads.mask)
        raise TypeError(
            f"{type(self).__name__} is a differentially private optimizer and refuses raw "
            "gradients: they are neither clipped per example nor noised. Train with "
            "`tf_dp.DPModel`, `tf_dp.DPSequential` or `tf_dp.make_private(model)` instead of a "
            "plain keras.Model; those hand the optimizer per-example clipped sums. In a train_step of "
            "your own (tape.gradient + apply_gradients), call `self.private_update(per_example_loss, "
            "data)` instead: it clips, noises and applies the step and records it in the ledger "
            "(docs/guides/keras-models.md#your-own-training-logic)."
        )

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        self.apply(grads, trainable_variables)

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
        squared_norms: Optional[tf.Tensor] = None,
        mask: Optional[tf.Tensor] = None,
    ):
        """ĝ = (Σ_i ḡ_i + z_t) / L through the chain, then the inner optimizer's update.

        Args:
          clipped_sums: Σ_i ḡ_i per variable, each ḡ_i clipped to sensitivity S(C).
          trainable_variables: the variables, aligned with ``clipped_sums``.
          expected_batch_size: L — expected Poisson batch size or an explicit batch's size.
          public_gradients: data-independent terms (e.g. weight regularizers) added after
            averaging; they cost no privacy.
          dp_step: the model's DP step count before this step (its ledger's): the noise
            counter, unique over the model's life.
          noise_multiplier: σ of this step (default: the variable's value), the same read
            the ledger records.
          release: 1.0, or 0.0 when a privacy budget forbids this step: then the update
            receives a zero gradient (a function of public state only).
          squared_norms, mask: the batch's per-example squared norms [B] and 0/1 mask [B]
            (all chunks), needed by an adaptive clip bound only.
        """
        self._key_guard.require_window(dp_step, self.name)  # Python: every eager call, or at trace time
        variables = list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
        sigma = self.noise_multiplier_tensor() if noise_multiplier is None else noise_multiplier
        bound, key = self._l2_norm_clip.value, self._noise_key()
        stddev_on_sum = self._gradient_noise_multiplier(sigma, expected_batch_size) * self.clipping.sensitivity(bound)
        replica, replicas = _replica()
        noisy_sums = transforms.privatize(self.privatizer, clipped_sums, stddev_on_sum, key, dp_step, replica,
                                          replicas)
        gradients = transforms.release_gate(transforms.average(noisy_sums, expected_batch_size), release)
        noise_stddev = stddev_on_sum / tf.cast(expected_batch_size, tf.float32)
        self._averaged_noise_stddev.assign(noise_stddev)
        gradients = transforms.add_public_gradients(gradients, public_gradients)
        self._advance_clip_bound(bound, squared_norms, mask, expected_batch_size, key, dp_step, release, sigma)
        # σ_w²·F_n: the marginal variance of correlated (BandMF) noise, docs/algorithms.md §10.5
        noise_variance = self.privatizer.released_noise_variance(tf.square(noise_stddev))
        return self._filter_and_update(gradients, variables, noise_variance, replicas)

    def _gradient_noise_multiplier(self, sigma, expected_batch_size):
        """σ, or an adaptive bound's σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2) (its count takes the rest;
        σ_b defaults to L/20, docs/algorithms.md §12)."""
        if self.adaptive_clip is None:
            return sigma
        return self.adaptive_clip.gradient_noise_multiplier(sigma, expected_batch_size=expected_batch_size)

    def _advance_clip_bound(self, bound, squared_norms, mask, expected_batch_size, key, dp_step, release,
                            sigma=None):
        """C_{t+1} = adaptive.next_bound(C_t, ...) for an adaptive bound (kept on a refused step)."""
        if self.adaptive_clip is None:
            return
        if squared_norms is None or mask is None:
            raise ValueError(f"{self.name}: an adaptive l2_norm_clip needs the batch's `squared_norms` and `mask` "
                             "in apply_private_gradients (tf_dp.DPModel passes them).")
        following = self.adaptive_clip.next_bound(bound, squared_norms, mask, expected_batch_size, key, dp_step,
                                                  noise_multiplier=sigma)
        if release is not None:
            following = tf.where(tf.cast(release, tf.float32) > 0, tf.cast(following, tf.float32), bound)
        self._l2_norm_clip.assign(following)

    def _filter_and_update(self, gradients, variables, noise_variance, replicas):
        """The filters on ĝ (summed over replicas when they need it), θ_{t−1} ← θ_t for the
        observation, then the inner update with the noise variance left in its gradient."""
        reduced = replicas > 1 and any(f.needs_global_gradient for f in self.filters)
        if reduced:
            gradients = transforms.all_reduce_sum(gradients)
        for part in self.filters:
            gradients, noise_variance, new_state = part.update(gradients, noise_variance,
                                                               _values(self.part_state(part)))
            _assign(self.part_state(part), new_state)
        if self.observation is not None:
            _assign(self.part_state(self.observation), self.observation.record(variables))
        if reduced:  # the inner optimizer sums the R replicas' (identical) gradients again
            gradients = [g / tf.cast(replicas, g.dtype) for g in gradients]
        with self._handing_noise_variance(noise_variance):
            self.inner_optimizer.apply(gradients, variables)

    def _handing_noise_variance(self, noise_variance):
        if getattr(self.inner_optimizer, "uses_noise_variance", False):
            return self.inner_optimizer.noise_variance_of_step(noise_variance)
        return contextlib.nullcontext()

    def evaluation_points(self, trainable_variables) -> tuple:
        """Where the model evaluates per-example gradients this step: θ_t, or the
        observation's points (DiSK, FIBER)."""
        if self.observation is None:
            return CURRENT_WEIGHTS
        return self.observation.evaluation_points(list(trainable_variables),
                                                  _values(self.part_state(self.observation)))

    def averaged_noise_stddev(self) -> tf.Tensor:
        """σ_w = σ·S(C)/L of the latest step (public: a function of the hyperparameters)."""
        return self._averaged_noise_stddev.value

    def noise_variance_on_average(self, dtype) -> tf.Tensor:
        """The per-coordinate noise variance left in what the inner optimizer received at the
        latest step: σ_w² (times F_n for BandMF, §10.5), times A_t for each filter ("transient"
        correction)."""
        variance = self.privatizer.released_noise_variance(tf.square(tf.cast(self._averaged_noise_stddev.value, dtype)))
        for part in self.filters:
            attenuation = tf.cast(part.attenuation(self.part_state(part)["noise_covariance"].value), dtype)
            variance = part.handed_on_variance(attenuation, variance)
        return variance

    # -- saving: one flat list in the layout tf_dp has always saved --
    @property
    def variables(self):
        return self._saved_variables()

    def _saved_variables(self) -> list:
        """[inner iteration (and learning rate)] + [C, σ, σ_w] + [inner slots] + [parts' state]."""
        base = self._inner_base_variables
        slots = [v for v in self.inner_optimizer.variables if not any(v is b for b in base)]
        dp = [self._l2_norm_clip, self._noise_multiplier, self._averaged_noise_stddev]
        return base + dp + slots + self._part_variables()

    def _part_variables(self) -> list:
        """The parts' state in saved order: noise covariances, then θ_{t−1}, then the filters'
        per-variable states."""
        states = [state for _, state in self._part_states]
        covariances = [s["noise_covariance"] for s in states if "noise_covariance" in s]
        previous = [v for s in states for v in s.get("previous_weights", [])]
        per_variable = [v for part in self.filters for name in part.state_names for v in self.part_state(part)[name]]
        return covariances + previous + per_variable

    def _legacy_layouts(self) -> list:
        """Older saved layouts: lists of (variable or None to skip, convert) per stored entry."""
        return []

    def save_own_variables(self, store):
        for index, variable in enumerate(self._saved_variables()):
            store[str(index)] = variable.numpy()

    def load_own_variables(self, store):
        saved = self._saved_variables()
        layouts = [[(v, None) for v in saved]] + self._legacy_layouts()
        for layout in layouts:
            if len(layout) == len(store.keys()):
                for index, (variable, convert) in enumerate(layout):
                    if variable is not None:
                        value = store[str(index)]
                        variable.assign(convert(np.asarray(value)) if convert else value)
                return
        warnings.warn(f"Skipping variable loading for optimizer '{self.name}', because it has {len(saved)} "
                      f"variables whereas the saved optimizer has {len(store.keys())} variables.", stacklevel=2)

    # -- config --
    def _dp_config(self) -> dict:
        return {
            "l2_norm_clip": (keras.saving.serialize_keras_object(self.adaptive_clip) if self.adaptive_clip is not None
                             else self.l2_norm_clip),
            "noise_multiplier": self.noise_multiplier,
            "seed": None,  # the seed is the user's secret: never serialized
            "secure_mode": self.secure_mode,
            "noise": keras.saving.serialize_keras_object(self.privatizer),
            "clipping": keras.saving.serialize_keras_object(self.clipping),
        }

    def get_config(self):
        return {"name": self.name, "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
                **self._dp_config()}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = _deserialized_dp_config(config, custom_objects)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)


# -------------------------------------------------------------------- helpers
def _refuse_base_options(kwargs: dict) -> None:
    for name in kwargs:
        if name in _BASE_OPTIONS:
            raise ValueError(f"tf_dp.DPOptimizer does not take `{name}`: set it on the inner optimizer, e.g. "
                             f"DPOptimizer(keras.optimizers.SGD(..., {name}=...), ...).")
    if kwargs:
        raise TypeError(f"tf_dp.DPOptimizer got unexpected arguments {sorted(kwargs)}.")


def _check_inner(inner) -> None:
    if isinstance(inner, DPOptimizer):
        raise TypeError("`inner_optimizer` is already a DP optimizer: wrapping it again would noise twice. Pass "
                        "the plain Keras optimizer.")
    if not isinstance(inner, keras.optimizers.Optimizer):
        raise TypeError(f"`inner_optimizer` must be a keras.optimizers.Optimizer (e.g. keras.optimizers.Lion(1e-3)), "
                        f"got {inner!r}.")
    if inner.built:
        raise ValueError("`inner_optimizer` is already built; pass a fresh optimizer (DPOptimizer builds it on the "
                         "model's trainable variables).")


def _is_adaptive(l2_norm_clip) -> bool:
    return hasattr(l2_norm_clip, "next_bound") and hasattr(l2_norm_clip, "gradient_noise_multiplier")


def _initial_clip(l2_norm_clip, adaptive) -> float:
    if adaptive is None:
        return _checks.positive("l2_norm_clip", l2_norm_clip, "It is the per-example clip bound C.")
    initial = getattr(adaptive, "initial", None)
    return _checks.positive("l2_norm_clip.initial", initial, "The adaptive bound starts at C_0 = initial.")


def _deserialized_dp_config(config: dict, custom_objects=None) -> dict:
    """A config whose learning rate (schedule) and adaptive clip bound are objects again."""
    config = dict(config)
    for name in ("learning_rate", "l2_norm_clip"):
        if isinstance(config.get(name), dict):
            config[name] = keras.saving.deserialize_keras_object(config[name], custom_objects=custom_objects)
    return config


def _value_of(variable):
    def initializer(shape, dtype=None):
        return tf.cast(tf.identity(variable.value), dtype or variable.dtype)

    return initializer


def _values(state: dict) -> dict:
    return tf.nest.map_structure(lambda v: v.value, state)


def _assign(state: dict, values: dict) -> None:
    for name, value in values.items():
        targets = state[name]
        if isinstance(targets, (list, tuple)):
            for target, new in zip(targets, value):
                target.assign(tf.cast(new, target.dtype))
        else:
            targets.assign(tf.cast(value, targets.dtype))
