"""DPModel, DPSequential and make_private: Keras models whose train step is DP-SGD.

A train step (ALGORITHMS §1): the batch arrives as Poisson-sampled chunks of static
size P with a 0/1 mask (from ``fit``) or as an explicit batch; the clipping engine
returns Σ_i c_i g_i over all chunks; the DP optimizer adds N(0, σ²C² I) once, divides by
L and updates; the ledger counts the step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from typing import Optional

import keras
import numpy as np
import tensorflow as tf
from keras.src.models.functional import Functional
from keras.src.models.model import functional_init_arguments

from tf_dp import _checks
from tf_dp.accounting import ACCOUNTANTS, PrivacyLedger, calibrate_noise_multiplier
from tf_dp.accounting.callbacks import PrivacyBudget, PrivacyReport
from tf_dp.clipping import ENGINES, clipped_gradient_sum
from tf_dp.models.data import (agreed_sampling_seed, as_arrays, distributed_poisson_dataset, is_batched_dataset,
                               is_poisson_batch, num_rows, poisson_dataset)
from tf_dp.models.losses import per_example_loss
from tf_dp.models.validation import check_model
from tf_dp.optimizers import DPOptimizer

DEFAULT_DELTA = 1e-5
PRIVACY_FILE = "privacy.json"


def _version() -> str:
    from tf_dp._version import __version__

    return __version__


def _accelerator_present() -> bool:
    return bool(tf.config.list_physical_devices("GPU") or tf.config.list_physical_devices("TPU"))


class DPModelMixin:
    """The DP training behaviour shared by DPModel and DPSequential."""

    def _init_privacy(self):
        self.privacy_ledger = PrivacyLedger()
        # Examples whose gradient was NaN/Inf this epoch: they contribute zero (clip_factors).
        # A plain TF variable: not a Keras metric (so not in evaluate) nor a saved weight.
        self.nonfinite_examples = tf.Variable(0.0, trainable=False, name="nonfinite_examples",
                                              aggregation=tf.VariableAggregation.SUM)
        self._dp = {"delta": DEFAULT_DELTA, "accountant": "rdp", "target_epsilon": None, "engine": "ghost"}
        self._dp_loss = None

    # ---------------------------------------------------------------- compile
    def compile(
        self,
        optimizer=None,
        loss=None,
        metrics=None,
        *,
        delta: Optional[float] = None,
        accountant: str = "rdp",
        target_epsilon: Optional[float] = None,
        clipping_engine: str = "ghost",
        jit_compile="auto",
        **kwargs,
    ):
        """Keras ``compile`` plus the privacy settings.

        Args:
          optimizer: a tf_dp DP optimizer (DPSGD, DPAdam, DPAdamW, ...). Plain Keras
            optimizers are refused: they would train without noise.
          loss: one Keras loss; it is evaluated per example.
          delta: δ at which ε is reported (default 1e-5; keep δ ≤ 1/N).
          accountant: "rdp" (default) or "pld".
          target_epsilon: if set, ``fit`` calibrates σ so that all training so far plus the
            planned epochs meets this ε, and stops rather than exceed it.
          clipping_engine: "ghost" (fast, default) or "vectorized" (reference).
          jit_compile: XLA. "auto" = on when a GPU/TPU is visible, off on CPU, where XLA
            was measured slower (README).
        """
        if not isinstance(optimizer, DPOptimizer):
            raise TypeError(
                f"{type(self).__name__} needs a differentially private optimizer "
                f"(tf_dp.DPSGD, tf_dp.DPAdam, tf_dp.DPAdamW, ...), got {type(optimizer).__name__}: a plain "
                "Keras optimizer would train without noise. Use e.g. "
                "tf_dp.DPSGD(learning_rate, l2_norm_clip=1.0, noise_multiplier=1.1)."
            )
        check_model(self)
        if self.dtype_policy.name == "mixed_float16":
            raise ValueError(
                "dtype policy mixed_float16 wraps the optimizer in a LossScaleOptimizer, which would apply "
                "unclipped, un-noised scaled gradients: use keras.config.set_dtype_policy('mixed_bfloat16') "
                "(bfloat16 forward; tf_dp clips and adds noise in float32)."
            )
        self._dp = {
            "delta": DEFAULT_DELTA if delta is None else _checks.delta(delta),
            "accountant": _checks.one_of("accountant", accountant, ACCOUNTANTS),
            "target_epsilon": None if target_epsilon is None else _checks.positive("target_epsilon", target_epsilon),
            "engine": _checks.one_of("clipping_engine", clipping_engine, ENGINES),
        }
        self._dp_loss = per_example_loss(loss)
        if jit_compile == "auto":
            jit_compile = _accelerator_present() and not optimizer.secure_mode
        if jit_compile and optimizer.secure_mode:
            raise ValueError("`secure_mode=True` draws OS entropy inside the step, which XLA cannot compile: "
                             "use jit_compile=False.")
        # Keras applies sample weights only to `weighted_metrics`; the 0/1 padding mask of
        # Poisson chunks is such a weight, so every metric is made a weighted one.
        weighted = list(tf.nest.flatten(metrics or [])) + list(tf.nest.flatten(kwargs.pop("weighted_metrics", None) or []))
        super().compile(optimizer=optimizer, loss=loss, weighted_metrics=weighted or None, jit_compile=jit_compile, **kwargs)

    # ------------------------------------------------------------- train step
    def train_step(self, data):
        if not isinstance(self.optimizer, DPOptimizer):
            raise TypeError("A DPModel trains only with a tf_dp DP optimizer; recompile with one.")
        x, y, mask, expected_batch_size = self._unpack_dp_batch(data)
        return self._dp_step(x, y, mask, expected_batch_size)

    def _dp_step(self, x, y, mask, expected_batch_size):
        clip = self.optimizer.clip_bound()
        points = self.optimizer.evaluation_points(self.trainable_variables)
        clipped_sums = self._clipped_sum_over_chunks(x, y, mask, clip, points)
        self.optimizer.apply_private_gradients(
            clipped_sums, self.trainable_variables, expected_batch_size, self._regularization_gradients()
        )
        self.privacy_ledger.record_step()
        return _for_multi_worker_reduce(
            {**self.get_metrics_result(), "nonfinite_examples": self.nonfinite_examples.read_value()})

    def test_step(self, data):
        return _for_multi_worker_reduce(super().test_step(data))

    def _unpack_dp_batch(self, data):
        """(x, y, mask, L) with x, y, mask shaped [chunks, P, ...]."""
        if is_poisson_batch(data):
            return data["x"], data["y"], data["mask"], data["expected_batch_size"][0]
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if sample_weight is not None:
            raise ValueError("`sample_weight`/`class_weight` are not supported by DP training in tf_dp.")
        if y is None:
            raise ValueError("DP training needs targets `y` to compute each example's loss.")
        batch = tf.shape(tf.nest.flatten(x)[0])[0]
        add_chunk_axis = lambda t: tf.expand_dims(t, 0)  # noqa: E731
        mask = tf.ones([1, batch], tf.float32)
        return tf.nest.map_structure(add_chunk_axis, x), tf.nest.map_structure(add_chunk_axis, y), mask, _global(batch)

    def _clipped_sum_over_chunks(self, x, y, mask, clip, points):
        """Σ over the batch's chunks of Σ_i c_i g_i; also counts non-finite examples."""

        def chunk(index):
            take = lambda t: tf.gather(t, index)  # noqa: E731
            return tf.nest.map_structure(take, x), tf.nest.map_structure(take, y), take(mask)

        totals = ([tf.zeros_like(v) for v in self.trainable_variables], tf.constant(0.0))
        if tf.nest.flatten(x)[0].shape[0] == 1:
            totals = self._clip_chunk(*chunk(0), clip, points, totals)
        else:
            chunks = tf.shape(mask)[0]
            _, totals = tf.while_loop(lambda index, _: index < chunks,
                                      lambda index, t: (index + 1, self._clip_chunk(*chunk(index), clip, points, t)),
                                      (tf.constant(0), totals))
        sums, nonfinite = totals
        # Outside the loop: a cross-replica variable update may not sit in control flow.
        self.nonfinite_examples.assign_add(nonfinite)
        return sums

    def _clip_chunk(self, x, y, mask, clip, points, totals):
        result = clipped_gradient_sum(self, self._chunk_loss(), x, y, mask, clip, engine=self._dp["engine"],
                                      points=points)
        real = tf.reduce_sum(mask)
        losses = tf.cast(result.losses, tf.float32)  # bfloat16 when the output layer computes in bfloat16
        mean_loss = tf.math.divide_no_nan(tf.reduce_sum(losses * tf.cast(mask, tf.float32)), real)
        self._loss_tracker.update_state(mean_loss + self._regularization_loss(), sample_weight=real)
        self.compute_metrics(x, self._targets(y), result.y_pred, sample_weight=mask)
        sums, nonfinite = totals
        return [s + c for s, c in zip(sums, result.clipped_sums)], nonfinite + result.nonfinite_count(mask)

    def _chunk_loss(self):
        """The per-example loss whose gradients are clipped (subclasses add terms)."""
        return self._dp_loss

    def _targets(self, y):
        """The labels inside ``y`` (subclasses may pack more per-example columns into it)."""
        return y

    def _regularization_loss(self):
        terms = [v.regularizer(v) for v in self.trainable_variables if getattr(v, "regularizer", None)]
        return tf.add_n(terms) if terms else 0.0

    def _regularization_gradients(self):
        """∇ of weight regularizers: a function of θ only, so public (no noise needed)."""
        if not any(getattr(v, "regularizer", None) for v in self.trainable_variables):
            return None
        with tf.GradientTape() as tape:
            penalty = self._regularization_loss()
        return tape.gradient(penalty, self.trainable_variables)

    # -------------------------------------------------------------------- fit
    def fit(
        self,
        x=None,
        y=None,
        batch_size: Optional[int] = None,
        epochs: int = 1,
        verbose="auto",
        callbacks=None,
        validation_split: float = 0.0,
        validation_data=None,
        initial_epoch: int = 0,
        steps_per_epoch: Optional[int] = None,
        physical_batch_size: Optional[int] = None,
        sampling_seed: Optional[int] = None,
        **kwargs,
    ):
        """Keras ``fit`` with Poisson sampling (rate q = batch_size / N) for arrays and
        unbatched ``tf.data`` datasets.

        An epoch is ⌈N/L⌉ steps. Batched datasets cannot be resampled: they are trained
        as given and accounted WITHOUT sampling amplification (each step a full Gaussian
        mechanism), with a warning.
        """
        self._require_dp_compiled()
        for unsupported in ("shuffle", "class_weight", "sample_weight"):
            if kwargs.get(unsupported) not in (None, True) or (unsupported != "shuffle" and unsupported in kwargs):
                raise ValueError(f"`{unsupported}` is not supported by DP fit (Poisson sampling replaces it).")
        kwargs.pop("shuffle", None)
        callbacks = list(callbacks or [])
        if isinstance(x, tf.data.Dataset) and is_batched_dataset(x, self):
            self._refuse_multi_worker("a batched dataset")
            return self._fit_fixed_batches(x, epochs, verbose, callbacks, validation_data, initial_epoch, steps_per_epoch, **kwargs)
        x, y = as_arrays(x, y)
        if validation_split:
            (x, y), validation_data = _split_tail(x, y, validation_split)
        num_examples = num_rows(x)
        if batch_size is None:
            raise ValueError("`batch_size` (the expected Poisson batch size L) is required for DP fit.")
        batch_size = _checks.batch_size_for(num_examples, batch_size)
        if self._dp["delta"] >= 1 / num_examples:
            warnings.warn(f"tf_dp: delta = {self._dp['delta']:g} >= 1/N = {1 / num_examples:.3g}: a mechanism that "
                          "publishes one random example outright meets such a delta. Use delta <= 1/N.", stacklevel=2)
        steps = steps_per_epoch or math.ceil(num_examples / batch_size)
        # Privacy callbacks go first so that user callbacks (TensorBoard, CSVLogger) see ε in the logs.
        callbacks = self._privacy_callbacks(num_examples, batch_size, steps * (epochs - initial_epoch)) + callbacks
        self._open_phase("poisson", batch_size / num_examples, num_examples, batch_size)
        if self.optimizer.secure_mode and sampling_seed is not None:
            raise ValueError("`secure_mode=True` samples batches from OS entropy; it accepts no `sampling_seed`.")
        steps_taken = StepsTaken(self.privacy_ledger)
        callbacks.append(steps_taken)  # last: its on_train_begin sees a ledger BackupAndRestore restored
        dataset = self._poisson_stream(x, y, num_examples, batch_size, physical_batch_size, sampling_seed,
                                       steps_taken)
        self._prebuild(x, y)
        return super().fit(
            dataset, epochs=epochs, verbose=verbose, callbacks=callbacks, validation_data=validation_data,
            initial_epoch=initial_epoch, steps_per_epoch=steps, shuffle=False, **kwargs,
        )

    def _fit_fixed_batches(self, dataset, epochs, verbose, callbacks, validation_data, initial_epoch, steps_per_epoch, **kwargs):
        warnings.warn(
            "tf_dp: fit() received a BATCHED dataset, which cannot be Poisson-resampled. Its steps are "
            "accounted as full Gaussian mechanisms without sampling amplification (much larger ε). "
            "Pass arrays or an unbatched dataset with batch_size=... for Poisson sampling.",
            stacklevel=3,
        )
        if self._dp["target_epsilon"] is not None:
            raise ValueError("`target_epsilon` calibration needs Poisson sampling: pass arrays or an unbatched dataset.")
        callbacks = [PrivacyReport()] + callbacks
        self._open_phase("batches", 1.0, 0, 0.0)
        return super().fit(dataset, epochs=epochs, verbose=verbose, callbacks=callbacks, validation_data=validation_data,
                           initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch, **kwargs)

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None, return_dict=False):
        """One DP step on an explicit batch: the noisy sum is averaged over its (public) size.
        Accounted as a Gaussian mechanism without sampling amplification."""
        self._require_dp_compiled()
        if sample_weight is not None or class_weight is not None:
            raise ValueError("`sample_weight`/`class_weight` are not supported by DP training in tf_dp.")
        if self.distribute_strategy.num_replicas_in_sync > 1:
            # Keras hands every replica the whole explicit batch: each example would be
            # clipped and summed R times (sensitivity R·C). Datasets are split correctly.
            raise ValueError("train_on_batch is not supported under a multi-replica tf.distribute strategy: "
                             "use fit(), which splits batches across replicas.")
        self._open_phase("batches", 1.0, 0, 0.0)
        if not self.built:
            self._prebuild(x, y)
        self._build_optimizer()
        return super().train_on_batch(x, y, return_dict=return_dict)

    def _poisson_stream(self, x, y, num_examples, batch_size, physical_batch_size, sampling_seed, steps_taken):
        """The Poisson batches ``fit`` trains on: the batch of step t at step t, one global
        batch per step, which tf.distribute replicas split by chunks (never duplicate)."""
        strategy, secure = self.distribute_strategy, self.optimizer.secure_mode
        extras = self._per_example_extras(num_examples)
        steps_taken = steps_taken.read
        if strategy.num_replicas_in_sync == 1:
            return poisson_dataset(x, y, num_examples, batch_size, physical_batch_size, sampling_seed, extras,
                                   secure=secure, first_step=steps_taken)
        if secure:
            self._refuse_multi_worker("secure_mode=True (each worker would draw its own OS-entropy batch)")
        seed = sampling_seed if secure else agreed_sampling_seed(strategy, sampling_seed)
        return distributed_poisson_dataset(strategy, x, y, num_examples, batch_size, physical_batch_size, seed,
                                           extras, secure=secure, first_step=steps_taken)

    def _refuse_multi_worker(self, what: str):
        """Workers would each read their own data, so one global step could read an example
        more than once (sensitivity above C) or not be the batch the accountant assumes."""
        if isinstance(self.distribute_strategy, tf.distribute.MultiWorkerMirroredStrategy):
            raise ValueError(
                f"tf_dp cannot train on {what} under MultiWorkerMirroredStrategy: workers could read the same "
                "examples in one step. Pass arrays (or an unbatched dataset) with batch_size=..., for which fit draws "
                "one shared Poisson batch per step and splits it across all workers."
            )

    def _per_example_extras(self, num_examples: int) -> dict:
        """Per-example arrays the Poisson stream carries besides x and y (none for DP-SGD)."""
        return {}

    def _require_dp_compiled(self):
        if not isinstance(getattr(self, "optimizer", None), DPOptimizer) or self._dp_loss is None:
            raise RuntimeError(f"Compile the {type(self).__name__} with a tf_dp optimizer and a loss before training.")

    def _open_phase(self, scheme, sampling_rate, num_examples, expected_batch_size):
        self._phase_arguments = (scheme, sampling_rate, num_examples, expected_batch_size)
        sigma = self.optimizer.noise_multiplier
        if sigma is None:
            raise ValueError(
                "The optimizer's `noise_multiplier` is None: set it, or pass `target_epsilon` to compile() "
                "so that fit() calibrates it."
            )
        self.privacy_ledger.open_phase(scheme, sampling_rate, sigma, num_examples, expected_batch_size,
                                       self._histogram_noise())

    def reopen_phase(self):
        """Re-records the running phase (after a callback such as BackupAndRestore has
        replaced the ledger with a checkpoint's): its steps are then composed correctly."""
        if getattr(self, "_phase_arguments", None):
            self._open_phase(*self._phase_arguments)

    def _histogram_noise(self) -> float:
        """Laplace scale of a histogram released from the same batch (RaCO-DP); 0: none."""
        return 0.0

    def _privacy_callbacks(self, num_examples, batch_size, planned_steps):
        target = self._dp["target_epsilon"]
        if target is None:
            return [PrivacyReport()]
        sigma = calibrate_noise_multiplier(
            target, num_examples, batch_size, steps=max(planned_steps, 1), delta=self._dp["delta"],
            accountant=self._dp["accountant"], prior_event=self._prior_event(),
        )
        self.optimizer.noise_multiplier = float(np.nextafter(np.float32(sigma), np.float32(np.inf)))  # float32 ≥ σ
        print(f"tf_dp: noise_multiplier calibrated to {sigma:.4f} for ε ≤ {target} at δ = {self._dp['delta']:g} "
              f"over {planned_steps} steps ({self._dp['accountant'].upper()}).")
        return [PrivacyReport(), PrivacyBudget(target)]

    def _prior_event(self):
        return self.privacy_ledger.event() if int(self.privacy_ledger.steps.numpy()) else None

    def _prebuild(self, x, y):
        """Builds model, metrics and optimizer from one example, since the Poisson stream's
        elements are not plain (x, y) batches."""
        sample = tf.nest.map_structure(lambda a: a[:1], (x, y))
        with self.distribute_strategy.scope():
            self._symbolic_build(data_batch=sample)
            self._build_optimizer()

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Under a tf.distribute strategy Keras would build by consuming one batch of the
        # training iterator; fit has already built the model (_prebuild), and a consumed
        # Poisson batch would shift the stream against the step count (see poisson_dataset).
        if iterator is not None and self.built and self.optimizer is not None and self.optimizer.built:
            return
        super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    def _build_optimizer(self):
        """Eagerly, so that optimizer state initialised from the weights (θ_{t−1} of
        DiSK/FIBER) is created before the train step is traced."""
        if not self.optimizer.built:
            self.optimizer.build(self.trainable_variables)

    # ------------------------------------------------------------- reporting
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
        return {
            "epsilon": self.get_epsilon(delta), "delta": delta, "accountant": self._dp["accountant"],
            "steps": int(self.privacy_ledger.steps.numpy()),
            "phases": [dataclasses.asdict(p) for p in phases],
            "adjacency": "add/remove one example",
            "tf_dp_version": _version(),
        }

    def export(self, filepath, format="tf_saved_model", verbose=None, **kwargs):
        """Keras ``export`` (a SavedModel whose serving graph is the model's inference call:
        no clipping, noise, histogram or optimizer), plus ``privacy.json`` with the ledger."""
        super().export(filepath, format=format, verbose=verbose, **kwargs)
        with open(os.path.join(filepath, PRIVACY_FILE), "w") as f:
            json.dump(self.privacy_report(), f, indent=2)

    # ------------------------------------ compile settings and ledger in .keras files
    def get_compile_config(self):
        config = super().get_compile_config()
        if config:
            settings = self._dp
            config["privacy"] = {
                "delta": settings["delta"], "accountant": settings["accountant"],
                "target_epsilon": settings["target_epsilon"], "clipping_engine": settings["engine"],
            }
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


class StepsTaken(keras.callbacks.Callback):
    """The number of DP steps taken as of the last finished batch, for the Poisson stream to
    read when an iterator starts. Read from the ledger once at the start of training (after
    BackupAndRestore may have restored it), then counted in Python: reading the variable
    inside a step would race with the step's own increment (tf.data starts the generator
    inside the step's graph), and reading it after every batch would stall the pipeline."""

    def __init__(self, ledger: PrivacyLedger):
        super().__init__()
        self._ledger = ledger
        self._value = int(ledger.steps.numpy())
        self._last_batch = -1

    def read(self) -> int:
        return self._value

    def on_train_begin(self, logs=None):
        self._value = int(self._ledger.steps.numpy())

    def on_epoch_begin(self, epoch, logs=None):
        self._last_batch = -1

    def on_train_batch_end(self, batch, logs=None):
        # ``batch`` is the last step of the execution (several with steps_per_execution > 1).
        self._value += batch - self._last_batch
        self._last_batch = batch


def _for_multi_worker_reduce(logs: dict) -> dict:
    """Keras 3 reduces step logs across workers with reduce("MEAN", axis=0), which fails on
    scalars (tensorflow/tensorflow#72388): give each a length-1 axis there."""
    strategy = tf.distribute.get_strategy()
    if not strategy.extended._in_multi_worker_mode():
        return logs
    return {name: tf.reshape(value, [1]) for name, value in logs.items()}


def _global(count: tf.Tensor) -> tf.Tensor:
    """An explicit batch's size over all replicas (tf.distribute splits it)."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return count
    return context.all_reduce(tf.distribute.ReduceOp.SUM, count)


def _split_tail(x, y, fraction):
    fraction = _checks.in_open_unit_interval("validation_split", fraction)
    n = num_rows(x)
    cut = n - int(round(n * fraction))
    head = lambda a: a[:cut]  # noqa: E731
    tail = lambda a: a[cut:]  # noqa: E731
    return (tf.nest.map_structure(head, x), head(y)), (tf.nest.map_structure(tail, x), tail(y))


@keras.saving.register_keras_serializable(package="tf_dp")
class DPModel(DPModelMixin, keras.Model):
    """A Keras Model trained with DP-SGD. Functional (``DPModel(inputs, outputs)``) or
    subclassed (override ``call``), like ``keras.Model``."""

    def __new__(cls, *args, **kwargs):
        if functional_init_arguments(args, kwargs) and not issubclass(cls, Functional):
            return keras.Model.__new__(functional_variant(cls))
        return super().__new__(cls, *args, **kwargs)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_privacy()


_FUNCTIONAL_VARIANTS: dict = {}


def functional_variant(cls: type, name: Optional[str] = None) -> type:
    """The class ``cls(inputs, outputs)`` instantiates: ``cls`` + Keras' Functional.

    Keras would otherwise rewrite ``cls.__bases__`` in place to inject Functional, which
    would turn every later subclassed use of the same class into a Functional model."""
    if cls not in _FUNCTIONAL_VARIANTS:
        variant = type(name or f"{cls.__name__}Functional", (cls, Functional), {"__module__": cls.__module__,
                       "__doc__": f"What ``{cls.__name__}(inputs, outputs)`` builds."})
        _FUNCTIONAL_VARIANTS[cls] = keras.saving.register_keras_serializable(package="tf_dp")(variant)
    return _FUNCTIONAL_VARIANTS[cls]


DPFunctional = functional_variant(DPModel, "DPFunctional")


@keras.saving.register_keras_serializable(package="tf_dp")
class DPSequential(DPModelMixin, keras.Sequential):
    """A ``keras.Sequential`` trained with DP-SGD."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_privacy()


def make_private(model: keras.Model) -> DPModel:
    """A DPModel over the same layers (and so the same weights) as a functional or
    Sequential Keras model."""
    if isinstance(model, DPModelMixin):
        return model
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    inputs, outputs = getattr(model, "inputs", None), getattr(model, "outputs", None)
    if not isinstance(model, Functional) or not inputs:
        raise TypeError(
            f"make_private needs a functional or Sequential model with known inputs; {model.name} is a "
            "subclassed or unbuilt model. Subclass tf_dp.DPModel instead of keras.Model, or build the "
            "Sequential with a keras.Input first."
        )
    return DPModel(model.inputs if len(model.inputs) > 1 else model.inputs[0],
                   model.outputs if len(model.outputs) > 1 else model.outputs[0], name=f"{model.name}_private")
