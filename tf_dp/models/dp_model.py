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
from keras.src.backend.common import global_state
from keras.src.models.functional import Functional
from keras.src.models.model import functional_init_arguments

from tf_dp import _checks
from tf_dp.accounting import ACCOUNTANTS, PrivacyLedger
from tf_dp.accounting.budget import StepLimit
from tf_dp.accounting.callbacks import PrivacyBudget
from tf_dp.clipping import ENGINES
from tf_dp.clipping.registry import as_layer_registry
from tf_dp.models.custom_step import CustomTraining, keras_tensors_given, objective_loss, refuse_own_training_logic
from tf_dp.models.fitting import DPFitting
from tf_dp.models.plan import StepPlan
from tf_dp.models.reporting import PrivacyReporting
from tf_dp.models.step import DPTrainStep, StepDoor
from tf_dp.models.validation import check_model
from tf_dp.optimizers import DPOptimizer

DEFAULT_DELTA = 1e-5


def _accelerator_present() -> bool:
    return bool(tf.config.list_physical_devices("GPU") or tf.config.list_physical_devices("TPU"))


class DPModelMixin(CustomTraining, DPTrainStep, DPFitting, PrivacyReporting):
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
        # The step plan (tf_dp.models.plan) is a constant of the traced step, not state to save.
        self._untracked = _Untracked(nonfinite_examples=tf.Variable(
            0.0, trainable=False, name="nonfinite_examples", aggregation=tf.VariableAggregation.SUM),
            step_plan=StepPlan(ledger=self.privacy_ledger), step_door=StepDoor())
        self._dp = {"delta": DEFAULT_DELTA, "accountant": "rdp", "target_epsilon": None, "engine": "ghost",
                    "private_logs": False}
        self._dp_loss = None
        self._adopt_layers_ledger()

    # ------------------------------------------------- the ledger of the weights
    def _adopt_layers_ledger(self):
        """ε belongs to the weights, not to the model object: a DP model over layers that
        another DP model has trained (a new DPModel over them, ``make_private`` twice)
        continues that model's ledger — its record and its noise counter — instead of
        starting at step 0. Called at construction and at ``compile``."""
        others = _ledgers_of_layers(self, exclude=self.privacy_ledger)
        if len(others) > 1 or (others and int(self.privacy_ledger.steps.numpy()) > 0):
            raise ValueError(
                f"The layers of {self.name} were trained under {len(others) + 1} different privacy ledgers (of "
                "different DP models); tf_dp cannot compose them into one ε (the models may have seen the same "
                "data). Build the model from layers trained by one DP model (or by none).")
        self._use_ledger(others[0] if others else self.privacy_ledger)

    def continue_ledger_of(self, other) -> None:
        """Carries ``other``'s privacy record to this model, where tf_dp cannot see that the
        weights came from it: ``keras.models.clone_model`` + ``set_weights``, or weights
        copied by value in any other way. Both models then share one ledger (ε and noise
        counter), so further training of either is composed with all steps of both.

        Args:
          other: the DP model whose weights this model holds (or its ``privacy_ledger``).
        """
        ledger = getattr(other, "privacy_ledger", other)
        if not isinstance(ledger, PrivacyLedger):
            raise TypeError(f"`other` must be a DP model or a PrivacyLedger, got {type(other).__name__}.")
        if ledger is self.privacy_ledger:
            return
        if int(self.privacy_ledger.steps.numpy()) > 0:
            raise ValueError(f"{self.name} has taken DP steps under its own ledger: continue_ledger_of must be "
                             "called before its first step (right after copying the weights).")
        self._use_ledger(ledger)

    def _use_ledger(self, ledger: PrivacyLedger) -> None:
        """Makes ``ledger`` the model's, its layers' and the step plan's: a step traced with
        another ledger is retraced (the plan's setter), as it would count into the old one."""
        self.privacy_ledger = ledger
        _attach_ledger(self)
        self.step_plan = self.step_plan.replace(ledger=ledger)

    @property
    def nonfinite_examples(self) -> tf.Variable:
        return self._untracked.nonfinite_examples

    # ---------------------------------------------------------------- saving
    def fit(self, *args, **kwargs):
        """DPFitting.fit, after refusing checkpoints that would drop the privacy ledger
        (before any step is taken, so no budget is spent on a run that cannot be saved).
        The phase it opens closes when it returns: no DP step runs after it (``StepDoor``)."""
        _refuse_legacy_h5_callbacks(kwargs.get("callbacks", args[5] if len(args) > 5 else None))
        with self._step_door.open_phase():
            return super().fit(*args, **kwargs)

    def train_on_batch(self, *args, **kwargs):
        """DPFitting.train_on_batch; its phase closes when it returns (``StepDoor``). Called
        inside a ``fit`` (from a callback), it runs as a ``PrivateRun`` of its own; the fit's
        run is then restored and notes the ledger for its next execution, which the inner
        call's single execution does not."""
        outer = getattr(self, "_private_run", None) if self._step_door.phase_open else None
        try:
            with self._step_door.open_phase(one_execution=True):
                return super().train_on_batch(*args, **kwargs)
        finally:
            if outer is not None:
                object.__setattr__(self, "_private_run", outer)
                outer.note_ledger()

    def save(self, filepath, *args, **kwargs):
        """Keras ``save`` to ``.keras`` (which carries the privacy ledger); ``.h5`` is refused."""
        if _is_legacy_h5(filepath, kwargs):
            raise ValueError(_legacy_h5_message(f"{type(self).__name__}.save({str(filepath)!r})"))
        return super().save(filepath, *args, **kwargs)

    def get_config(self):
        if _in_legacy_h5_scope():  # keras.saving.save_model(model, "x.h5"), which bypasses save()
            raise ValueError(_legacy_h5_message(f"saving {self.name} to .h5"))
        return super().get_config()

    @classmethod
    def from_config(cls, config, custom_objects=None):
        if _in_legacy_h5_scope():
            raise ValueError(
                f"This .h5 file holds a tf_dp {cls.__name__} saved without its privacy ledger (the .h5 format "
                "cannot carry it; tf_dp no longer writes DP models to .h5), so the ε of its weights cannot be "
                "checked: tf_dp does not load it as a DP model. Fix: save DP models as .keras (model.save("
                "'model.keras'), ModelCheckpoint('best_model.keras')), which carries the ledger.")
        return super().from_config(config, custom_objects=custom_objects)

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
        layer_registry=None,
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
          layer_registry: the ``tf_dp.clipping.LayerRegistry`` whose ghost rules this model's
            layers take (None: the one ``make_private`` was given, else the default one).
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
            "layer_registry": as_layer_registry(self._untracked.__dict__.get("layer_registry") if layer_registry is None
                                                else layer_registry),
            "private_logs": _checks.boolean("private_logs", private_logs),
        }
        self._dp_loss = objective_loss(self, loss, kwargs.get("loss_weights"), _output_names(self))
        self._adopt_layers_ledger()  # a subclassed model's layers exist by now
        if jit_compile == "auto":
            jit_compile = _accelerator_present() and not optimizer.secure_mode
        if jit_compile and optimizer.secure_mode:
            raise ValueError("`secure_mode=True` draws OS entropy inside the step, which XLA cannot compile: "
                             "use jit_compile=False.")
        # Keras applies sample weights only to `weighted_metrics`; the 0/1 padding mask of
        # Poisson chunks is such a weight, so every metric is made a weighted one.
        weighted = (list(tf.nest.flatten(metrics or []))
                    + list(tf.nest.flatten(kwargs.pop("weighted_metrics", None) or [])))
        super().compile(optimizer=optimizer, loss=loss, weighted_metrics=weighted or None, jit_compile=jit_compile,
                        **kwargs)


_LAYER_LEDGERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # layer -> the ledger that trains it


def _ledgers_of_layers(model, exclude) -> list:
    """The distinct ledgers, other than ``exclude``, attached to the model's layers."""
    found = [_LAYER_LEDGERS.get(layer) for layer in model._flatten_layers(include_self=False)]
    unique = {id(ledger): ledger for ledger in found if ledger is not None and ledger is not exclude}
    return list(unique.values())


def _attach_ledger(model) -> None:
    """Attaches the model's ledger to the layers its DP steps train (those with trainable
    weights, or not built yet): a later DP model over them continues it."""
    for layer in model._flatten_layers(include_self=False):
        if layer.trainable_weights or not layer.built:
            _LAYER_LEDGERS[layer] = model.privacy_ledger


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


_LEGACY_H5 = (".h5", ".hdf5")


def _is_legacy_h5(filepath, kwargs: dict) -> bool:
    """Keras' legacy HDF5 format (``.h5``/``.hdf5`` or save_format="h5"); ``.weights.h5`` is not it."""
    return str(filepath).endswith(_LEGACY_H5) or kwargs.get("save_format") in ("h5", "hdf5")


def _in_legacy_h5_scope() -> bool:
    """Keras' legacy HDF5 saver/loader is running (it serializes under ``use_legacy_config``)."""
    return bool(global_state.get_global_attribute("use_legacy_config", False))


def _legacy_h5_message(what: str) -> str:
    return (f"{what}: the legacy .h5 format cannot carry the privacy ledger (the record of every DP step, "
            "from which ε is computed and which keeps the noise counter from repeating), and a released model "
            "without it is one whose ε nobody can check. Fix: save as .keras — model.save('model.keras'), "
            "keras.callbacks.ModelCheckpoint('best_model.keras') — which carries the ledger "
            "(or save_weights('model.weights.h5'), which does too).")


def _refuse_legacy_h5_callbacks(callbacks) -> None:
    """Refuses ModelCheckpoint / PrivacyBudget callbacks that would save the model to .h5."""
    for callback in callbacks or []:
        if isinstance(callback, keras.callbacks.ModelCheckpoint) and not callback.save_weights_only:
            path = callback.filepath
        elif isinstance(callback, PrivacyBudget):
            path = getattr(callback, "save_path", None)
        else:
            continue
        if path is not None and _is_legacy_h5(path, {}):
            raise ValueError(_legacy_h5_message(f"{type(callback).__name__}({str(path)!r})"))


def _named_for_legacy_h5(cls: type) -> type:
    """Also registers ``cls`` under its bare class name, the name a legacy .h5 file gives
    it: ``keras.models.load_model`` then reaches ``from_config``, which refuses the file
    with the fix, instead of failing with "Unknown layer"."""
    keras.saving.get_custom_objects().setdefault(cls.__name__, cls)
    return cls


@_named_for_legacy_h5
@keras.saving.register_keras_serializable(package="tf_dp")
class DPModel(DPModelMixin, keras.Model):
    """A Keras Model trained with DP-SGD. Functional (``DPModel(inputs, outputs)``) or
    subclassed (override ``call``), like ``keras.Model``.

    Args:
      *args: as for ``keras.Model``: ``(inputs, outputs)`` for a functional model, nothing
        for a subclassed one.
      **kwargs: any other argument of ``keras.Model`` (e.g. ``name``).
    """

    def __new__(cls, *args, **kwargs):
        if (functional_init_arguments(args, kwargs) and keras_tensors_given(args, kwargs)
                and not issubclass(cls, Functional)):
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
                       "__doc__": f"What ``{cls.__name__}(inputs, outputs)`` builds.\n\n"
                       f"Args:\n  *args: ``(inputs, outputs)``, as for a functional ``keras.Model``.\n"
                       f"  **kwargs: any other argument of ``keras.Model`` (e.g. ``name``).\n"})
        registered = keras.saving.register_keras_serializable(package="tf_dp")(variant)
        _FUNCTIONAL_VARIANTS[cls] = _named_for_legacy_h5(registered)
    return _FUNCTIONAL_VARIANTS[cls]


DPFunctional = functional_variant(DPModel, "DPFunctional")


@_named_for_legacy_h5
@keras.saving.register_keras_serializable(package="tf_dp")
class DPSequential(DPModelMixin, keras.Sequential):
    """A ``keras.Sequential`` trained with DP-SGD.

    Args:
      *args: as for ``keras.Sequential``: the list of layers.
      **kwargs: any other argument of ``keras.Sequential`` (e.g. ``name``).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_privacy()


def _private_sequential(model: keras.Sequential) -> "DPSequential":
    """A DPSequential over the same layer objects (so the same weights), the model's Input
    included: built like ``model`` if it is built, else built on its first call or ``fit``,
    as Keras builds a Sequential without an Input."""
    for method in ("call", "train_step"):
        if getattr(type(model), method) is not getattr(keras.Sequential, method):
            raise TypeError(
                f"make_private cannot carry the `{method}` that {type(model).__name__} ({model.name}) overrides: "
                f"the private model would run keras.Sequential's instead. Fix: subclass tf_dp.DPSequential "
                f"instead of keras.Sequential (or pass a plain keras.Sequential).")
    return DPSequential(list(model._layers), trainable=model.trainable, name=f"{model.name}_private")


def make_private(model: keras.Model, *, layer_registry=None) -> DPModel:
    """A DP model over the same layers (and so the same weights) as a functional or
    Sequential Keras model: a DPModel for a functional model, a DPSequential for a
    Sequential (built or not).

    Args:
      model: a functional or Sequential Keras model (a DP model is returned as is).
      layer_registry: a ``tf_dp.clipping.LayerRegistry`` its ``compile`` uses unless given
        another (None: the default one).

    Returns:
      The DP model.

    Raises:
      TypeError: ``model`` is not a Keras model, or is a subclassed one.
    """
    private = _private_model(model)
    if layer_registry is not None:
        private._untracked.layer_registry = as_layer_registry(layer_registry)
    return private


def _private_model(model: keras.Model) -> DPModel:
    if isinstance(model, DPModelMixin):
        return model
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    refuse_own_training_logic(model)
    if isinstance(model, keras.Sequential):
        return _private_sequential(model)
    inputs = getattr(model, "inputs", None)
    if not isinstance(model, Functional) or not inputs:
        raise TypeError(
            f"make_private needs a functional or Sequential model; {model.name} is a subclassed model (or a "
            "functional one without inputs). Fix: subclass tf_dp.DPModel instead of keras.Model."
        )
    # The ledger belongs to the weights: a second make_private of the same model continues
    # its record (and its noise counter) instead of starting a fresh one at step 0.
    return DPModel(_structure(model, "inputs"), _structure(model, "outputs"), name=f"{model.name}_private")


def _structure(model: Functional, which: str):
    """The model's inputs or outputs as it was built with them: a dict stays a dict (so
    ``model(x)`` / ``predict`` of the private model return what the original returns)."""
    struct = getattr(model, f"_{which}_struct", None)
    if isinstance(struct, dict):
        return struct
    flat = getattr(model, which)
    return flat if len(flat) > 1 else flat[0]
