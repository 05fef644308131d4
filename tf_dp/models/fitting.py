"""DP ``fit`` and ``train_on_batch``: which batches a step sees, and the phase the ledger opens.

Arrays and unbatched datasets are Poisson-sampled (q = L/N, the accountant's assumption).
Explicit batches (a batched dataset, ``train_on_batch``) cannot be resampled: each step is
accounted as a full Gaussian mechanism, and the noisy sum is divided by a DECLARED batch
size L — ``batch_size=``, or the dataset's static batch dimension, or the first batch of a
``train_on_batch`` phase — never by each batch's realized size, which changes with the
data under add/remove adjacency (docs/algorithms.md §7).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Optional

import numpy as np
import tensorflow as tf

from tf_dp import _checks
from tf_dp.accounting import calibrate_noise_multiplier, events
from tf_dp.accounting.callbacks import PrivacyBudget, PrivacyReport
from tf_dp.clipping.engine import ONE_VIEW, AugmentationViews
from tf_dp.mechanism import DPMechanism, FixedBatches
from tf_dp.sampling.tfds_sources import source_for_fit as tfds_source_for_fit
from tf_dp.models.data import (agreed_sampling_seed, distributed_poisson_dataset, is_batched_dataset, num_rows,
                               poisson_dataset, refuse_batched_records, refuse_duplicating_batches)
from tf_dp.models.fit_privacy import FitPrivacy
from tf_dp.models.losses import without_unused_targets
from tf_dp.models.private_run import PrivateRun, RunStart
from tf_dp.models.validation_split import carve_validation, keras_array
from tf_dp.models.row_independence import DONOR_SEARCH, GUARD_ROWS, check_rows_independent
from tf_dp.models.custom_step import reads_no_targets
from tf_dp.models.step import DPTrainStep, sample_weight_extras
from tf_dp.models.validation import refuse_lookups_rejecting_padding
from tf_dp.optimizers import DPOptimizer
from tf_dp.sampling.dataset_graph import TIMESERIES, keras_utility, keras_utility_note
from tf_dp.sampling.loader import augment_examples
from tf_dp.sampling.schemes import scheme_for_fit
from tf_dp.sampling.sources import MARKER, SourceError, example_source, no_targets_as_none
from tf_dp.sampling.users import user_ids_for_fit, user_index_of


class DPFitting:
    """``fit``/``train_on_batch`` of DP models (mixed into DPModelMixin)."""

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
        transform=None,
        augment=None,
        augmentation_multiplicity: int = 1,
        user_ids=None,
        examples_per_user: Optional[int] = None,
        sampling=None,
        per_example_extras: Optional[dict] = None,
        **kwargs,
    ):
        """Keras ``fit`` with Poisson sampling (rate q = batch_size / N) for arrays (numpy,
        ``numpy.memmap``, ``h5py``-like), unbatched ``tf.data`` datasets and random-access
        sources (``len(x)`` and ``x[i]`` → example i as (x, y), or as a record that
        ``transform(record)`` turns into one: ``tfds.data_source``, ArrayRecord, grain,
        ``tf_dp.sampling.TFRecordSource``); only the sampled examples are read. A
        ``tfds.data_source`` is parsed in the graph with its builder's features spec
        (``tf_dp.data.tfds.parsed_source``: its supervised keys, or ``transform`` when it
        traces as TensorFlow ops). ``validation_split`` takes the last fraction of any
        source's indices before sampling (N is the training part). Inputs are read as
        Keras reads them: a list or tuple of arrays is one input per entry of a
        multi-input model (``fit([x1, x2], y)``), a dict is named inputs, and text (numpy
        str/bytes arrays, object arrays or lists of Python str, tf.string tensors) is a
        fixed-shape tf.string column, e.g. for a TextVectorization or StringLookup inside
        the model; a Poisson chunk's padding rows are empty strings with mask 0.

        An epoch is ⌈N/L⌉ steps. Batched datasets cannot be resampled: they are trained
        as given, averaged over the declared ``batch_size`` (default: the dataset's static
        batch size) and accounted WITHOUT sampling amplification, with a warning. A batched
        dataset must present each example at most once per batch: a repeat, a concatenation
        with itself, an interleave of a captured dataset upstream of ``.batch()`` is refused
        (each copy would be clipped separately); ``ds.batch(L).repeat()`` is fine. A source's
        record i must be example i: records that are batches of the model's input are
        refused, and the model must be built (or have an ``Input``) for its shape to tell.
        ``sampling_seed`` makes the batches reproducible; like the noise seed it is a secret
        (amplification by sampling assumes the batches are unknown) and is never saved. After a
        rollback of the ledger (load_weights of an earlier file, BackupAndRestore) the seed is
        re-keyed, so no batch is drawn twice; on a resumed model it warns: resume with
        ``sampling_seed=None`` (docs/algorithms.md B.3).

        ``augment(x, seed) -> x'``: per-example augmentation (TensorFlow ops on one example,
        stateless randomness from ``seed``), run in the input pipeline.
        ``augmentation_multiplicity=K`` (docs/algorithms.md §8): K views per sampled example — K
        ``augment`` draws, or without ``augment`` K passes through the model's own random
        layers — whose gradients are averaged BEFORE clipping: one clipped vector per
        example, so the sensitivity stays C and ε is unchanged; compute grows with K.

        User-level DP (docs/algorithms.md §11): ``user_ids`` makes the privacy unit a USER, all
        examples with one id (ints, strings, any hashables). For a ``tf.data`` dataset or a
        source the id is a feature of each element: ``user_ids="uid"`` names a key of x's dict
        (a record field), removed from x before the model sees it; an array of ids (one per
        example) is accepted only beside arrays x, where row i of both is example i.
        ``batch_size`` is then L_u, the expected number of users per step: each user joins a
        step independently with q_u = L_u / N_u (N_u distinct ids) and contributes
        ``examples_per_user`` = m of their examples, cycled through in a secret random order
        (a user with fewer than m examples repeats some within a step); the m gradients are
        averaged, g_u = (1/m) Σ_j ∇ℓ(θ; x_{u,j}), and clipped ONCE to C, the noise is added
        once and the sum divided by L_u. The ledger's phase is Poisson with N = N_u and
        q = q_u, so ``get_epsilon()`` is per user. An epoch is ⌈N_u/L_u⌉ steps and
        ``physical_batch_size`` counts users per chunk (each with m examples). Never with a
        batched dataset (or ``train_on_batch``); for m > 1 not with ``augment``,
        ``augmentation_multiplicity`` > 1 or ``class_weight`` (``sample_weight`` works: each
        example keeps its own weight and label).

        ``per_example_extras`` ({name: array with one row per training example}) is for a
        model with a train step of its own: each array is carried with the Poisson-sampled
        examples, row for row, into the batch its ``train_step`` receives as ``data[name]``,
        where a per-example objective reads it (tf_dp.models.objective). Arrays and sources
        only; ``validation_split`` keeps the rows of the training part.
        """
        self._require_dp_compiled()
        privacy = FitPrivacy(batch_size, physical_batch_size, sampling_seed, self.optimizer.secure_mode, transform,
                             augment, augmentation_multiplicity, user_ids, examples_per_user, sampling,
                             per_example_extras)
        y = without_unused_targets(self._dp_loss, y)  # y=[y0, None] for loss=[fn, None], as Keras
        if kwargs.get("shuffle") not in (None, True):
            raise ValueError("`shuffle` is not supported by DP fit (Poisson sampling replaces it).")
        kwargs.pop("shuffle", None)
        sample_weight, class_weight = kwargs.pop("sample_weight", None), kwargs.pop("class_weight", None)
        keras_fit = dict(epochs=epochs, verbose=verbose, callbacks=list(callbacks or []),
                         validation_data=validation_data, initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch,
                         **kwargs)
        if isinstance(x, tf.data.Dataset) and is_batched_dataset(x, self):
            privacy.refuse_resampling("a batched dataset")
            self._refuse_multi_worker("a batched dataset")
            with self.use_plan(self._weights_plan(sample_weight, class_weight, where="dataset")):
                return self._fit_fixed_batches(x, batch_size, keras_fit)
        return self._fit_poisson(x, y, privacy, validation_split, sample_weight, class_weight, keras_fit)

    def _fit_poisson(self, x, y, privacy: FitPrivacy, validation_split, sample_weight, class_weight,
                     keras_fit: dict):
        """fit on arrays, an unbatched dataset or a source: Poisson-sampled batches drawn by
        the scheme ``privacy`` names, in one ``PrivateRun``."""
        _warn_about_windows(x)
        source = self._training_source(x, y, privacy.transform, reads_no_targets(self._dp_loss))
        source, user_ids = user_ids_for_fit(x, source, privacy.user_ids)  # ids travel with their rows (a key)
        sampling_arguments = {**privacy.sampling_arguments(), "user_ids": user_ids}
        all_rows = len(source)
        extras = self._checked_per_example_extras(privacy.per_example_extras, all_rows)
        validation_data = keras_fit["validation_data"]
        if validation_split:
            validation_batch = keras_fit.pop("validation_batch_size", None) or privacy.batch_size or 32
            source, validation_data, sample_weight = carve_validation(source, validation_split, sample_weight,
                                                                      validation_batch)
        if user_ids is not None:  # one id per row given; the validation tail's rows are never sampled
            sampling_arguments["user_ids"] = user_index_of(user_ids, all_rows)[:len(source)]
        if isinstance(validation_data, (tuple, list)):  # numpy string arrays as tf.string, which Keras reads
            validation_data = tuple(tf.nest.map_structure(keras_array, part) for part in validation_data)
        num_examples = len(source)
        refuse_batched_records(source, self, privacy.augment)
        refuse_lookups_rejecting_padding(self)
        plan = self._weights_plan(sample_weight, class_weight, num_examples).replace(
            per_example_extras={name: column[:num_examples] for name, column in extras.items()} or None)
        x, y = source.head(GUARD_ROWS + DONOR_SEARCH)  # what the guard and the build read: never all of the data
        y = no_targets_as_none(y)
        if privacy.augment is not None:
            x = augment_examples(privacy.augment, x)
        check_rows_independent(self, self._dp_loss, x, y)
        if privacy.batch_size is None:
            raise ValueError("`batch_size` (the expected Poisson batch size L) is required for DP fit.")
        scheme = scheme_for_fit(getattr(self.optimizer, "privatizer", None), num_examples,
                                _checks.batch_size_for(num_examples, privacy.batch_size), privacy.sampling,
                                **sampling_arguments)
        plan = plan.replace(views=self._views(privacy.augment, privacy.augmentation_multiplicity, scheme, plan))
        self._warn_about_delta(scheme.num_units)
        self._warn_if_the_unit_changes(scheme.ledger_scheme)
        epochs, initial_epoch = keras_fit["epochs"], keras_fit["initial_epoch"]
        steps = keras_fit["steps_per_epoch"] or math.ceil(scheme.num_units / scheme.expected_batch_size)
        # Privacy callbacks go first so that user callbacks (TensorBoard, CSVLogger) see ε in the logs.
        callbacks = self._privacy_callbacks(scheme, steps * (epochs - initial_epoch)) + keras_fit["callbacks"]
        run = self._start_run(DPMechanism.of(self.optimizer, scheme), callbacks, privacy.sampling_seed)
        callbacks.append(RunStart(run))  # last: its on_train_begin sees a ledger BackupAndRestore restored
        keras_fit.update(callbacks=callbacks, validation_data=validation_data, steps_per_epoch=steps)
        plan = plan.replace(mechanism=run.mechanism)  # the step plan holds the running mechanism
        with self.use_plan(plan), reading_errors_named(source, self):
            dataset = self._poisson_stream(source, scheme, privacy, run, plan.views)
            self._prebuild(x, y)
            return super().fit(dataset, shuffle=False, **keras_fit)

    def _start_run(self, mechanism: DPMechanism, callbacks=(), sampling_seed=None,
                   one_execution: bool = False) -> PrivateRun:
        """Records ``mechanism``'s phase in a new ``PrivateRun``, the call's host bookkeeping
        (tf_dp.models.private_run), which the train function's wrapper then consults.

        Args:
          mechanism: the call's mechanism.
          callbacks: the call's callbacks (its budgets among them).
          sampling_seed: the secret sampling seed, or None.
          one_execution: ``train_on_batch``.

        Returns:
          The run, also the model's ``_private_run``.
        """
        run = PrivateRun(self, mechanism, sampling_seed, one_execution=one_execution, callbacks=callbacks)
        object.__setattr__(self, "_private_run", run)  # untracked by Keras: never saved
        return run

    @staticmethod
    def _training_source(x, y, transform, targets_optional=False):
        """The random-access source fit samples from: a tfds.data_source parsed in the graph,
        else ``tf_dp.sampling.example_source`` of (x, y) — arrays x without y for a model
        that reads no targets (``targets_optional``: its own compute_loss or train_step)."""
        source = tfds_source_for_fit(x, transform) if y is None else None
        return source if source is not None else example_source(x, y, transform, targets_optional)

    def _warn_about_delta(self, num_units: int) -> None:
        if self._dp["delta"] >= 1 / num_units:
            warnings.warn(f"tf_dp: delta = {self._dp['delta']:g} >= 1/N = {1 / num_units:.3g}: a mechanism that "
                          "publishes one random example outright meets such a delta. Use delta <= 1/N.", stacklevel=3)

    def _warn_if_the_unit_changes(self, ledger_scheme: str) -> None:
        """A fit whose unit (example or user, docs/algorithms.md §11) differs from the steps the
        ledger already holds: ε composes both, and then holds per example only."""
        taken = [phase for phase in self.privacy_ledger.phases() if phase.steps > 0]
        before, now = events.privacy_unit(taken) if taken else None, events.scheme_unit(ledger_scheme)
        if before is None or before == now:
            return
        warnings.warn(f"tf_dp: this fit is {now}-level but the privacy ledger already holds {before}-level steps "
                      "(or a mix): get_epsilon() composes both and holds per EXAMPLE only — an example-level step "
                      "protects a user only by group privacy over all of the user's examples. For ε per user, "
                      "train every step of the model user-level (a fresh model for a user-level run); "
                      "privacy_report()['unit'] says which unit ε protects.", stacklevel=3)

    def _views(self, augment, multiplicity, scheme, plan) -> AugmentationViews:
        """The units' views: augmentation multiplicity, or a scheme's m examples per unit
        (user-level DP), each averaged before clipping (docs/algorithms.md §8, §11); ``plan``
        is the call's plan so far (its class weights)."""
        views = self._augmentation_setting(augment, multiplicity)
        if scheme.views == 1:
            return views
        if views != ONE_VIEW:
            raise ValueError(f"{scheme.name!r} sampling gives each unit {scheme.views} examples, which cannot be "
                             "combined with augmentation_multiplicity > 1: use one of them (the view axis holds "
                             "the unit's examples; K views of each would need a second view axis).")
        if augment is not None:
            raise ValueError(f"`augment` is not supported with {scheme.name!r} sampling: the input pipeline's views "
                             "are the unit's examples. Put random augmentation layers in the model instead.")
        if plan.class_weights is not None:
            raise ValueError(f"`class_weight` is not supported with {scheme.name!r} sampling: fold the class "
                             "weights into `sample_weight` (one weight per example), which is carried per example.")
        return AugmentationViews(scheme.views, view_axis=True, targets_per_view=True)  # each example its own label

    def _augmentation_setting(self, augment, multiplicity) -> AugmentationViews:
        """The views each sampled example contributes (augmentation multiplicity, docs/algorithms.md §8)."""
        if multiplicity == 1:  # both checked by FitPrivacy
            return ONE_VIEW
        if augment is None and not any(getattr(layer, "_seed_generators", None)
                                       for layer in self._flatten_layers(include_self=True)):
            raise ValueError(
                "augmentation_multiplicity > 1 needs random views: pass augment=fn (fn(x, seed) -> augmented x, "
                "run in the input pipeline), or put random augmentation layers in the model (e.g. "
                "keras.layers.RandomFlip, RandomCrop, RandomTranslation): without either, the K views would be "
                "identical.")
        return AugmentationViews(multiplicity, view_axis=augment is not None)

    def _fit_fixed_batches(self, dataset, batch_size, keras_fit: dict):
        """fit on a batched dataset: its batches as given, accounted without amplification.

        Args:
          dataset: the batched dataset.
          batch_size: the declared L, or None (the dataset's static batch size).
          keras_fit: Keras' fit arguments (epochs, callbacks, ...).

        Returns:
          Keras' History.
        """
        refuse_duplicating_batches(dataset)
        declared = declared_batch_size(dataset, batch_size)
        warnings.warn(
            "tf_dp: fit() received a BATCHED dataset, which cannot be Poisson-resampled. Its steps are "
            "accounted as full Gaussian mechanisms without sampling amplification (much larger ε), and each "
            f"noisy sum is divided by the declared batch size {declared}. "
            "Pass arrays or an unbatched dataset with batch_size=... for Poisson sampling."
            + keras_utility_note(dataset, batched=True),
            stacklevel=3,
        )
        if self._dp["target_epsilon"] is not None:
            raise ValueError("`target_epsilon` calibration needs Poisson sampling: pass arrays or an unbatched "
                             "dataset.")
        check_rows_independent(self, self._dp_loss, dataset)
        keras_fit["callbacks"] = [PrivacyReport()] + keras_fit["callbacks"]
        self._start_run(DPMechanism.of(self.optimizer, FixedBatches(declared)), keras_fit["callbacks"])
        return super().fit(dataset, **keras_fit)

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None, return_dict=False,
                       batch_size: Optional[int] = None, user_ids=None):
        """One DP step on an explicit batch, accounted as a Gaussian mechanism without
        sampling amplification. The noisy sum is divided by ``batch_size`` — a public
        constant declared by the first call of a phase (later calls may omit it); if
        omitted, the first batch's static size is taken as that constant, with a warning
        (it must not depend on the data) — never each later batch's own size. ``user_ids``
        is refused: user-level DP samples users, an explicit batch cannot be (§11)."""
        self._require_dp_compiled()
        if user_ids is not None:
            raise ValueError("['user_ids'] need fit() to sample from arrays or a random-access source; "
                             "train_on_batch's explicit batch cannot be resampled.")
        y = without_unused_targets(self._dp_loss, y)
        self.step_plan = self._weights_plan(sample_weight, class_weight, where="batch")  # until the next call
        if self.distribute_strategy.num_replicas_in_sync > 1:
            # Keras hands every replica the whole explicit batch: each example would be
            # clipped and summed R times (sensitivity R·C). Datasets are split correctly.
            raise ValueError("train_on_batch is not supported under a multi-replica tf.distribute strategy: "
                             "use fit(), which splits batches across replicas.")
        check_rows_independent(self, self._dp_loss, x, y, key_contents=False)
        if batch_size is None:
            phase = self.privacy_ledger.current_phase()
            running = phase is not None and phase.scheme == "batches" and phase.expected_batch_size > 0
            batch_size = phase.expected_batch_size if running else _static_batch_size(x)
        run = self._start_run(DPMechanism.of(self.optimizer, FixedBatches(_checks.positive("batch_size", batch_size))),
                              one_execution=True)
        self.step_plan = self.step_plan.replace(mechanism=run.mechanism)  # this call's plan holds its mechanism
        if not self.built:
            self._prebuild(x, y)
        self._build_optimizer()
        # The noise key is guarded by the train function itself (DPTrainStep.make_train_function).
        return super().train_on_batch(x, y, sample_weight=sample_weight, return_dict=return_dict)

    def _poisson_stream(self, source, scheme, privacy: FitPrivacy, run: PrivateRun,
                        views: AugmentationViews = ONE_VIEW):
        """The batches ``fit`` trains on, drawn by ``scheme``'s sampler: the batch of step t at
        step t (``run``'s position), one global batch per step, which tf.distribute replicas
        split by chunks (never duplicate), each worker reading only its replicas' examples
        from the source."""
        strategy, secure = self.distribute_strategy, self.optimizer.secure_mode
        physical_batch_size, sampling_seed = privacy.physical_batch_size, privacy.sampling_seed
        augment = privacy.augment
        extras = {**sample_weight_extras(self.step_plan.sample_weights), **(self.step_plan.per_example_extras or {})}
        augment_views = views.count if views.view_axis and augment is not None else 1
        loading = dict(source=source, augment=augment, views=augment_views, scheme=scheme,
                       first_step=run.position, seed_generation=run.seed_generation)
        size = scheme.expected_batch_size
        if strategy.num_replicas_in_sync == 1:
            return poisson_dataset(None, None, len(source), size, physical_batch_size, sampling_seed, extras,
                                   secure=secure, augment_seed=sampling_seed, **loading)
        if secure:
            self._refuse_multi_worker("secure_mode=True (each worker would draw its own OS-entropy batch)")
        seed = sampling_seed if secure else agreed_sampling_seed(strategy, sampling_seed)
        return distributed_poisson_dataset(strategy, None, None, len(source), size, physical_batch_size, seed,
                                           extras, secure=secure, augment_seed=seed, **loading)

    def _refuse_multi_worker(self, what: str):
        """Workers would each read their own data, so one global step could read an example
        more than once (sensitivity above C) or not be the batch the accountant assumes."""
        if isinstance(self.distribute_strategy, tf.distribute.MultiWorkerMirroredStrategy):
            raise ValueError(
                f"tf_dp cannot train on {what} under MultiWorkerMirroredStrategy: workers could read the same "
                "examples in one step. Pass arrays (or an unbatched dataset) with batch_size=..., for which fit draws "
                "one shared Poisson batch per step and splits it across all workers."
            )

    def _checked_per_example_extras(self, extras: Optional[dict], num_examples: int) -> dict:
        """fit's ``per_example_extras`` as numpy arrays with one row per example (all rows,
        before a validation split), for a model whose own train step reads them."""
        if extras is None:
            return {}
        if type(self).train_step is DPTrainStep.train_step:
            raise ValueError(f"`per_example_extras` are read by a train step of a model's own; "
                             f"{type(self).__name__} uses DPModel's, which reads none. Remove the argument.")
        columns = {name: np.asarray(column) for name, column in extras.items()}
        for name, column in columns.items():
            if column.ndim == 0 or column.shape[0] != num_examples:
                raise ValueError(f"`per_example_extras[{name!r}]` needs one row per training example "
                                 f"({num_examples}), got shape {list(column.shape)}.")
        return columns

    def _require_dp_compiled(self):
        if not isinstance(getattr(self, "optimizer", None), DPOptimizer) or self._dp_loss is None:
            raise RuntimeError(f"Compile the {type(self).__name__} with a tf_dp optimizer and a loss before training.")

    def _privacy_callbacks(self, scheme, planned_steps):
        """PrivacyReport, and with ``compile(target_epsilon=...)`` the calibrated σ and a
        PrivacyBudget that stops training at the target."""
        target = self._dp["target_epsilon"]
        if target is None:
            return [PrivacyReport()]
        self.optimizer.noise_multiplier = self._calibrated_noise_multiplier(scheme, target, planned_steps)
        return [PrivacyReport(), PrivacyBudget(target)]

    def _calibrated_noise_multiplier(self, scheme, target: float, planned_steps: int) -> float:
        """The smallest float32 σ whose ε over the planned steps (after the ledger's) is ≤ target."""
        sigma = calibrate_noise_multiplier(
            target, scheme.num_units, scheme.expected_batch_size, steps=max(planned_steps, 1), delta=self._dp["delta"],
            accountant=self._dp["accountant"], prior_event=self._prior_event(), scheme=scheme.ledger_scheme,
            parameter=scheme.ledger_parameter,
        )
        print(f"tf_dp: noise_multiplier calibrated to {sigma:.4f} for ε ≤ {target} at δ = {self._dp['delta']:g} "
              f"over {planned_steps} steps ({self._dp['accountant'].upper()}).")
        return float(np.nextafter(np.float32(sigma), np.float32(np.inf)))  # float32 ≥ σ

    def _prior_event(self):
        return self.privacy_ledger.event() if int(self.privacy_ledger.steps.numpy()) else None

    def _prebuild(self, x, y):
        """Builds model, metrics and optimizer from one example, since the Poisson stream's
        elements are not plain (x, y) batches."""
        sample = tf.nest.map_structure(lambda a: keras_array(a[:1]), (x,) if y is None else (x, y))  # fit(x)
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


def _warn_about_windows(x) -> None:
    """Warns that the privacy unit is a window when ``x`` is timeseries_dataset_from_array's."""
    if isinstance(x, tf.data.Dataset) and keras_utility(x) == TIMESERIES:
        warnings.warn("tf_dp:" + keras_utility_note(x, batched=False), stacklevel=3)


def declared_batch_size(dataset: tf.data.Dataset, batch_size: Optional[int]) -> int:
    """The public L a batched dataset's noisy sums are divided by: ``batch_size`` if given,
    else the static batch dimension (``batch(L, drop_remainder=True)``), else the L of the
    pipeline's last ``batch(L)`` — a constant of the pipeline's code, not of the data."""
    if batch_size is not None:
        return _checks.positive_int("batch_size", batch_size)
    spec = dataset.element_spec
    first = tf.nest.flatten(spec[0] if isinstance(spec, tuple) else spec)[0]
    static = first.shape[0] if first.shape.rank else None
    static = static or _pipeline_batch_size(dataset)
    if static is None:
        raise ValueError(
            "fit() on a batched dataset needs the batch size to divide the noisy sum by: pass batch_size=... (the "
            "size your pipeline batches with), or batch with drop_remainder=True. tf_dp never divides by a "
            "batch's realized size, which depends on the data.")
    return int(static)


def _static_batch_size(x) -> int:
    """The first explicit batch's size, taken as the phase's declared L (with a warning)."""
    size = num_rows(x)
    warnings.warn(
        f"tf_dp: train_on_batch without batch_size= divides this and later noisy sums by {size}, the size of this "
        "first batch, taken as a public constant: it must not depend on the data (under add/remove adjacency a "
        "data-dependent size leaks, docs/algorithms.md §7). Pass batch_size=L to declare it.",
        UserWarning, stacklevel=4)  # the caller of DPModelMixin.train_on_batch
    return size


def _pipeline_batch_size(dataset) -> Optional[int]:
    """L of the last ``Dataset.batch(L)`` in the pipeline, if tf.data exposes it."""
    while dataset is not None:
        size = getattr(dataset, "_batch_size", None)
        if size is not None:
            value = tf.get_static_value(size)
            return int(value) if value is not None and value > 0 else None
        dataset = getattr(dataset, "_input_dataset", None)
    return None


@contextlib.contextmanager
def reading_errors_named(source=None, model=None):
    """A source error raised inside the input pipeline reaches the user as SourceError
    (naming the index and the expected spec), not as an opaque tf.errors op error; a
    record the in-graph parse of a SerializedSource fails on is found and named too.

    Sampled records that failed to read or parse trained as zero-weight examples (the
    loader's ``zero_weight_unreadable``): after training, and only then, their total over the
    steps trained is reported (``report_unreadable``)."""
    log = source.unreadable_log() if hasattr(source, "unreadable_log") else None
    if log is not None:
        log.clear()
    try:
        yield
        if log is not None and model is not None:
            report_unreadable(model, source, log)
    except tf.errors.OpError as error:
        message = error.message or ""
        if MARKER not in message:
            named = source.diagnose() if hasattr(source, "diagnose") else None
            if named is not None:
                raise named from error
            raise
        detail = message[message.index(MARKER) + len(MARKER) + 2:].split("\n")[0]
        raise SourceError(detail) from error


def report_unreadable(model, source, log) -> None:
    """Sets ``model.unreadable_examples`` (and the History's) to the number of sampled records
    of the steps trained that failed to read or parse and contributed nothing, and warns when
    there were any, naming a few. Like ``nonfinite_examples`` this count is an exact function of
    the private batches, outside ε: it is reported as one total after training (never per
    step, which would say when a record was sampled), and not at all with
    ``compile(private_logs=True)`` (then None)."""
    total = None if model._dp["private_logs"] else log.total(below_step=int(model.privacy_ledger.steps.numpy()))
    object.__setattr__(model, "unreadable_examples", total)  # untracked by Keras: never saved
    history = getattr(model, "history", None)
    if history is not None:
        history.unreadable_examples = total
    if total:
        named = "; ".join(f"example {index}: {why}" for index, why in sorted(source.unreadable_named().items()))
        warnings.warn(
            f"tf_dp: {total} sampled record(s) could not be read or parsed during training and were trained on as "
            f"zero-weight examples (contributing nothing; the sampling and ε are unchanged). First seen: {named}. "
            "Fix or remove these records; `model.unreadable_examples` holds the total (an exact function of the "
            "private batches, outside ε, like nonfinite_examples).", UserWarning, stacklevel=4)
