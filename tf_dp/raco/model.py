"""RaCO-DP: private rate-constrained training by a primal-dual train step (docs/algorithms.md §5).

Each step, on one Poisson batch:
  1. Ĥ = H + Laplace(1/b): the histogram of tempered softmax outputs per (partition, class);
  2. Γ_j(Ĥ) and W[q, k] = Σ_j λ_j ∂Γ_j/∂p_k, read off Ĥ only (post-processing);
  3. each example's Lagrangian term ℓ_i + L · W[π_i]·p̃(x_i) (W constant) is clipped and
     noised exactly as DP-SGD: ĝ = (Σ_i clip_C(∇term_i) + N(0, σ²C²I)) / L;
  4. λ_j ← max(0, λ_j + η_λ (Γ_j(Ĥ) − γ_j))  (projected dual ascent, free).
The Gaussian and the Laplace read the same batch: one subsampled mechanism, accounted
jointly (tf_dp.raco.accounting).

RaCO-DP is a plug-in of the DP step built from its parts (docs/design.md): its sampling
scheme (tf_dp.raco.sampling) and accountant, the group ids as fit's ``per_example_extras``,
and step 3's term as a ``PerExampleObjective`` built from each step's Ĥ and passed to the
step through the public ``private_update`` (``lagrangian_objective``). It overrides no private
method of DPModel, calls none of its step, and keeps no state on the model between building a
value and using it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from tf_dp import _checks
from tf_dp.models.dp_model import DPModel, functional_variant
from tf_dp.models.objective import PerExampleObjective
from tf_dp.raco.constraints import Constraint, ConstraintSet
from tf_dp.raco.histogram import NoisyHistogram, tempered
from tf_dp.raco.sampling import JointPoissonSampling

_STORE_KEY = "raco_multipliers"
GROUPS = "groups"  # the per-example column of group ids in fit's batches


@keras.saving.register_keras_serializable(package="tf_dp")
class RateConstrainedModel(DPModel):
    """A DPModel trained under rate constraints (fairness and others) with RaCO-DP (docs/algorithms.md §5).

    ``compile(optimizer, loss, metrics, constraints=[...], num_groups=Z, histogram_noise=1/b,
    dual_learning_rate=η_λ, histogram_temperature=T, ...)`` and
    ``fit(x, y, groups=z, batch_size=L, ...)``. The model must output probabilities
    (softmax). λ are saved with the model and logged each epoch.

    Attributes:
      constraint_set: the compiled constraints Γ_j ≤ γ_j (§5.2).
      histogram: the NoisyHistogram Ĥ = H + Laplace(1/b) released each step (§5.1).
      multipliers: λ_j ≥ 0, updated by the dual step (§5.4), saved with the model.
      constraint_values: Γ_j(Ĥ) of the last released step.

    Args:
      *args: as for ``tf_dp.DPModel``: ``(inputs, outputs)`` for a functional model.
      **kwargs: any other argument of ``tf_dp.DPModel`` (e.g. ``name``).
    """

    def compile(self, optimizer=None, loss=None, metrics=None, *, constraints: Sequence[Constraint] = (),
                num_groups: int = 2, histogram_noise: float = 2.0, dual_learning_rate: float = 0.1,
                histogram_temperature: float = 1.0, fixed_penalty: Optional[float] = None,
                target_epsilon: Optional[float] = None, **kwargs):
        """DPModel.compile plus RaCO-DP's settings (docs/algorithms.md §5).

        Args:
          constraints: the rate constraints (DemographicParity, EqualizedOdds, ...).
          num_groups: Z, the number of sensitive groups (ids in [0, Z)).
          histogram_noise: the Laplace scale 1/b of Ĥ (§5.1), accounted jointly (§5.5).
          dual_learning_rate: η_λ of λ_j ← max(0, λ_j + η_λ (Γ_j(Ĥ) − γ_j)) (§5.4).
          histogram_temperature: T of the tempered probabilities p̃ (§5.1).
          fixed_penalty: λ replaces the dual ascent by the constant-λ baseline: each step
            penalises λ·max(0, Γ_j(Ĥ) − γ_j), i.e. multipliers λ·[Γ_j > γ_j] (a constant λ
            on every Γ_j would cancel: demographic-parity gaps of complementary groups sum to 0).
          target_epsilon: refused (calibrate with tf_dp.raco.calibrate_noise_multiplier).
          **kwargs: DPModel.compile's arguments.
        """
        if target_epsilon is not None:
            raise ValueError(
                "`target_epsilon` calibration of RateConstrainedModel is not built in: choose σ or the number of "
                "steps with tf_dp.raco.calibrate_noise_multiplier / calibrate_steps, and stop with "
                "tf_dp.PrivacyBudget(ε), which accounts the histogram jointly."
            )
        super().compile(optimizer=optimizer, loss=loss, metrics=metrics, **kwargs)
        num_classes = int(self.outputs[0].shape[-1]) if getattr(self, "outputs", None) else None
        if not num_classes or num_classes < 2:
            raise ValueError("RaCO-DP needs a model with a K ≥ 2 class softmax output (a Dense(K, 'softmax') "
                             "last layer).")
        self.constraint_set = ConstraintSet(constraints, num_groups, num_classes)
        self.histogram = NoisyHistogram(self.constraint_set.partitioning.size, histogram_noise, histogram_temperature)
        self.dual_learning_rate = _checks.non_negative("dual_learning_rate", dual_learning_rate)
        self.fixed_penalty = None if fixed_penalty is None else _checks.non_negative("fixed_penalty", fixed_penalty)
        self._raco_settings = {
            "constraints": list(constraints), "num_groups": num_groups, "histogram_noise": histogram_noise,
            "dual_learning_rate": dual_learning_rate, "histogram_temperature": histogram_temperature,
            "fixed_penalty": fixed_penalty,
        }
        count = len(self.constraint_set)
        if getattr(self, "multipliers", None) is None or self.multipliers.shape[0] != count:
            once = tf.VariableAggregation.ONLY_FIRST_REPLICA
            self.multipliers = tf.Variable(tf.zeros([count]), trainable=False, name="lagrange_multipliers",
                                           aggregation=once)
            self.constraint_values = tf.Variable(tf.zeros([count]), trainable=False, name="constraint_values",
                                                 aggregation=once)

    # ------------------------------------------------------------------ data
    def fit(self, x=None, y=None, groups=None, **kwargs):
        """DPModel.fit with RaCO-DP's joint Poisson sampling (docs/algorithms.md §5.5).

        Args:
          x, y: the training arrays (y: class ids in [0, K)).
          groups: each training example's sensitive-group id in [0, num_groups), carried
            with each sampled example as a per-example column (``per_example_extras``).
          **kwargs: DPModel.fit's arguments (``batch_size`` = L, ``epochs``, ...).

        Returns:
          The Keras History, with ``lambda_j`` and ``max_violation`` each epoch.
        """
        self._require_raco_compiled()
        if kwargs.get("validation_split"):
            raise ValueError("Pass `validation_data` instead of `validation_split` to RateConstrainedModel.fit.")
        if isinstance(x, tf.data.Dataset):
            raise ValueError("RateConstrainedModel.fit needs arrays x, y and groups (Poisson batches, accounted "
                             "jointly with the histogram); a tf.data.Dataset is not supported.")
        if kwargs.get("augmentation_multiplicity", 1) != 1:
            raise ValueError("RateConstrainedModel.fit takes no `augmentation_multiplicity`: its histogram Ĥ "
                             "counts one prediction per sampled example. Pass augmentation_multiplicity=1 "
                             "(augment=fn alone augments each example once).")
        if "per_example_extras" in kwargs:
            raise ValueError("RateConstrainedModel.fit carries `groups` itself: pass no `per_example_extras`.")
        scale = float(self.histogram.noise_scale)
        callbacks = [MultiplierReport(), *(kwargs.pop("callbacks", None) or [])]  # λ in the logs user callbacks see
        return super().fit(x, y, sampling=lambda n, size: JointPoissonSampling(n, size, histogram_noise=scale),
                           per_example_extras={GROUPS: self._checked_groups(groups, y)}, callbacks=callbacks,
                           **kwargs)

    def train_on_batch(self, *args, **kwargs):
        raise ValueError("RateConstrainedModel trains with fit(x, y, groups=..., batch_size=...) (Poisson batches).")

    def _checked_groups(self, groups, y) -> np.ndarray:
        if groups is None:
            raise ValueError("`groups` (one sensitive-group id per training example) is required.")
        groups = np.asarray(groups)
        if groups.ndim != 1 or not np.issubdtype(groups.dtype, np.integer):
            raise TypeError("`groups` must be a 1-D array of integer group ids.")
        if y is not None and len(groups) != len(y):
            raise ValueError(f"`groups` has {len(groups)} rows but `y` has {len(y)}.")
        count = self.constraint_set.num_groups
        if groups.min() < 0 or groups.max() >= count:
            raise ValueError(f"`groups` ids must lie in [0, num_groups={count}), got [{groups.min()}, {groups.max()}].")
        missing = sorted(set(range(count)) - set(np.unique(groups).tolist()))
        if missing:
            raise ValueError(f"Groups {missing} are absent from the training data; every constrained group needs "
                             "members (set num_groups to the number of groups present).")
        return groups.astype(np.int32)

    def _require_raco_compiled(self):
        if getattr(self, "constraint_set", None) is None:
            raise RuntimeError("Compile the RateConstrainedModel with `constraints=[...]` before fit.")

    # ------------------------------------------------------------- the step
    def train_step(self, data):
        """One RaCO-DP step (docs/algorithms.md §5): Ĥ, then the primal DP step on the
        Lagrangian terms built from Ĥ, then the dual step on λ, kept only if the step was released.

        Args:
          data: a Poisson batch from fit: x, y, mask, expected_batch_size and ``groups``.

        Returns:
          The step's logs.
        """
        x, y, mask, expected_batch_size = self._unpack_dp_batch(data)
        partitions = self.constraint_set.partitioning.ids(data[GROUPS], y)
        # ONE noisy histogram of the whole global batch, identical on every replica: the optimizer
        # all-reduces this replica's counts and adds one Laplace draw from its own key on its own
        # stream (DPOptimizer.release_sum, docs/algorithms.md §5); RaCO never sees the key.
        # Γ, N̂, W and the dual step below all read it, so they agree across replicas too.
        # The Laplace counter is the ledger's step count, like the Gaussian's: unique over the model's life.
        noisy = self.optimizer.release_sum(self._batch_histogram(x, partitions, mask), self.histogram.sum_noise(),
                                           self.privacy_ledger.steps.read_value())
        values = self.constraint_set.values(noisy)
        violated = values > self.constraint_set.bounds
        multipliers = self.multipliers.read_value()
        previous_values = self.constraint_values.read_value()
        if self.fixed_penalty is None:
            updated = tf.maximum(0.0, multipliers + self.dual_learning_rate * (values - self.constraint_set.bounds))
        else:
            multipliers = updated = self.fixed_penalty * tf.cast(violated, tf.float32)
        objective = lagrangian_objective(self._dp_loss, self.constraint_set.coefficients(noisy, multipliers),
                                         expected_batch_size, self.histogram.temperature)
        packed = tf.stack([tf.cast(y, tf.int32), partitions], axis=-1)
        logs, release = self.private_update(objective, data, targets=packed, return_release=True)
        # A step the privacy budget blocked releases nothing: λ and Γ keep their values.
        released = release > 0
        self.multipliers.assign(tf.where(released, updated, multipliers))
        self.constraint_values.assign(tf.where(released, values, previous_values))
        return logs

    def _batch_histogram(self, x, partitions, mask):
        """H over all chunks of this replica's share of the Poisson batch, at the current weights."""
        flat = lambda t: tf.reshape(t, tf.concat([[-1], tf.shape(t)[2:]], axis=0))  # noqa: E731
        probabilities = self(tf.nest.map_structure(flat, x), training=True)
        return self.histogram.counts(tf.stop_gradient(probabilities), flat(partitions), flat(mask))

    # -------------------------------------------------- saving the multipliers
    def save_own_variables(self, store):
        super().save_own_variables(store)
        if getattr(self, "multipliers", None) is not None:
            store[_STORE_KEY] = self.multipliers.numpy()

    def load_own_variables(self, store):
        keys = set(store.keys())
        if _STORE_KEY in keys and getattr(self, "multipliers", None) is not None:
            self.multipliers.assign(np.asarray(store[_STORE_KEY]))
        super().load_own_variables({k: store[k] for k in keys - {_STORE_KEY}})

    def get_compile_config(self):
        config = super().get_compile_config()
        if config and getattr(self, "_raco_settings", None):
            settings = dict(self._raco_settings)
            settings["constraints"] = [keras.saving.serialize_keras_object(c) for c in settings["constraints"]]
            config["raco"] = settings
        return config

    def compile_from_config(self, config):
        config = dict(config)
        raco = dict(config.pop("raco", {}))
        if raco:
            raco["constraints"] = [keras.saving.deserialize_keras_object(c) for c in raco["constraints"]]
        privacy = config.pop("privacy", {})
        self.compile(**keras.saving.deserialize_keras_object(config), **privacy, **raco)
        if self.built:
            self.optimizer.build(self.trainable_variables)


RateConstrainedFunctional = functional_variant(RateConstrainedModel, "RateConstrainedFunctional")


def lagrangian_objective(base_loss, coefficients, expected_batch_size, temperature: float) -> PerExampleObjective:
    """The per-example Lagrangian term of one RaCO-DP step (docs/algorithms.md §5.3):

        term_i = ℓ_i + L · Σ_k W[π_i, k] · p̃_k(x_i),   W under stop_gradient,

    so that (1/L) Σ_i ∇term_i = (1/L) Σ_i ∇ℓ_i + Σ_j λ_j ∇Γ_j. Its y is packed as
    [..., (label, partition π_i)]; the metrics read the label column.

    Args:
      base_loss: the compiled per-example loss ℓ(labels, probabilities) -> [P].
      coefficients: W [num_partitions, K], ``ConstraintSet.coefficients`` of this step's
        noisy histogram Ĥ and λ (post-processing of Ĥ, §5.2: public).
      expected_batch_size: L, the public constant ĝ is divided by.
      temperature: T of the tempered probabilities p̃ = softmax(log p / T) (§5.1).

    Returns:
      The PerExampleObjective the step clips: clip_C(∇term_i) for each example (§1 step 3).
    """
    def lagrangian_terms(packed, probabilities):
        labels, partitions = packed[..., 0], packed[..., 1]
        weights = tf.gather(tf.stop_gradient(coefficients), partitions)
        penalty = tf.reduce_sum(weights * tempered(probabilities, temperature), axis=-1)
        return base_loss(labels, probabilities) + tf.cast(expected_batch_size, penalty.dtype) * penalty

    return PerExampleObjective(loss=lagrangian_terms, labels=label_column)


def label_column(packed):
    """The labels of a RaCO-DP y packed as [..., (label, partition)]."""
    return packed[..., 0]


class MultiplierReport(keras.callbacks.Callback):
    """Logs λ_j (``lambda_j``) and the largest constraint slack Γ_j − γ_j each epoch."""

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        for index, value in enumerate(self.model.multipliers.numpy()):
            logs[f"lambda_{index}"] = float(value)
        logs["max_violation"] = float(np.max(self.model.constraint_values.numpy() - self.model.constraint_set.bounds))
