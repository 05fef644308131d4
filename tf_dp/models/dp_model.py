"""DPModel, DPSequential and make_private: Keras models whose train step is DP-SGD.

A DP model is a Keras model plus DPModelMixin, composed of one part per concern:
``step`` (the DP train step), ``fitting`` (which batches a step sees, phases of the
ledger), ``reporting`` (ε, export, saving); compile and the model classes live here.
"""

from __future__ import annotations

import weakref
from typing import Optional

import keras
import tensorflow as tf
from keras.src.models.functional import Functional
from keras.src.models.model import functional_init_arguments

from tf_dp import _checks
from tf_dp.accounting import ACCOUNTANTS, PrivacyLedger
from tf_dp.accounting.budget import StepLimit
from tf_dp.clipping import ENGINES
from tf_dp.models.fitting import DPFitting
from tf_dp.models.losses import per_example_loss
from tf_dp.models.reporting import PrivacyReporting
from tf_dp.models.step import DPTrainStep
from tf_dp.models.validation import check_model
from tf_dp.optimizers import DPOptimizer

DEFAULT_DELTA = 1e-5


def _accelerator_present() -> bool:
    return bool(tf.config.list_physical_devices("GPU") or tf.config.list_physical_devices("TPU"))


class DPModelMixin(DPTrainStep, DPFitting, PrivacyReporting):
    """The DP training behaviour shared by DPModel and DPSequential."""

    def _init_privacy(self):
        self.privacy_ledger = PrivacyLedger()
        self.step_limit = StepLimit()  # a privacy budget's limit, enforced inside the step
        # L of explicit batches (train_on_batch, batched datasets): declared, never realized.
        self._declared_batch_size = tf.Variable(1.0, trainable=False, name="declared_batch_size",
                                                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        # Examples whose gradient was NaN/Inf this epoch: they contribute zero (clip_factors).
        # A membership oracle for a NaN canary, so held where no saver reaches (not a Keras
        # metric, not a weight, not in tf.train.Checkpoint) and logged only without private_logs.
        self._untracked = _Untracked(nonfinite_examples=tf.Variable(
            0.0, trainable=False, name="nonfinite_examples", aggregation=tf.VariableAggregation.SUM))
        self._dp = {"delta": DEFAULT_DELTA, "accountant": "rdp", "target_epsilon": None, "engine": "ghost",
                    "private_logs": False}
        self._dp_loss = None

    @property
    def nonfinite_examples(self) -> tf.Variable:
        return self._untracked.nonfinite_examples

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
        private_logs: bool = False,
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
          private_logs: True makes ``fit`` log only ε (and the public noise scale) plus
            validation metrics: no train loss, metrics or non-finite count, which are exact
            functions of the private batches and outside ε. For logs that leave the trainer.
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
            "private_logs": _checks.boolean("private_logs", private_logs),
        }
        self._dp_loss = per_example_loss(loss, kwargs.get("loss_weights"), _output_names(self))
        if jit_compile == "auto":
            jit_compile = _accelerator_present() and not optimizer.secure_mode
        if jit_compile and optimizer.secure_mode:
            raise ValueError("`secure_mode=True` draws OS entropy inside the step, which XLA cannot compile: "
                             "use jit_compile=False.")
        # Keras applies sample weights only to `weighted_metrics`; the 0/1 padding mask of
        # Poisson chunks is such a weight, so every metric is made a weighted one.
        weighted = list(tf.nest.flatten(metrics or [])) + list(tf.nest.flatten(kwargs.pop("weighted_metrics", None) or []))
        super().compile(optimizer=optimizer, loss=loss, weighted_metrics=weighted or None, jit_compile=jit_compile, **kwargs)


def _output_names(model):
    """The output names of a functional model (None if it has none yet): a dict of losses is keyed by them."""
    try:
        return list(model.output_names) if getattr(model, "outputs", None) else None
    except (AttributeError, ValueError):
        return None


class _Untracked:
    """Attributes hidden from Keras/TF tracking (so from every saver): a plain object."""

    def __init__(self, **values):
        self.__dict__.update(values)


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
    inputs = getattr(model, "inputs", None)
    if not isinstance(model, Functional) or not inputs:
        raise TypeError(
            f"make_private needs a functional or Sequential model with known inputs; {model.name} is a "
            "subclassed or unbuilt model. Subclass tf_dp.DPModel instead of keras.Model, or build the "
            "Sequential with a keras.Input first."
        )
    private = DPModel(model.inputs if len(model.inputs) > 1 else model.inputs[0],
                      model.outputs if len(model.outputs) > 1 else model.outputs[0], name=f"{model.name}_private")
    # The ledger belongs to the weights: a second make_private of the same model continues
    # its record (and its noise counter) instead of starting a fresh one at step 0.
    ledger = _SHARED_LEDGERS.get(model)
    if ledger is None:
        _SHARED_LEDGERS[model] = private.privacy_ledger
    else:
        private.privacy_ledger = ledger
    return private


_SHARED_LEDGERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
