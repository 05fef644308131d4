"""StepPlan: the options of one ``fit``/``train_on_batch`` call that shape the traced DP step.

Everything the compiled step reads besides its tensor inputs and the model's variables is a
constant of its trace: the ledger it records into, the views each unit contributes
(docs/algorithms.md §8, §11), the class-weight table and the nesting of fit's sample weights
(§1: ℓ_i is the weighted loss of example i), and the names of the per-example columns a
train step of its own reads with each example. They live in one frozen plan; the model holds
the current one (``DPTrainStep.step_plan``), and setting a plan that differs from it drops
the traced train function there and nowhere else, so a new option retraces by construction.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping, Optional, Tuple

import numpy as np
import tensorflow as tf

from tf_dp.clipping.engine import ONE_VIEW, AugmentationViews


@dataclass(frozen=True)
class StepPlan:
    """What the DP step of the current call runs and what its ledger records.

    Attributes:
      ledger: the PrivacyLedger the step records into (compared by identity).
      views: the views each sampled unit contributes, averaged before clipping:
        u_i = (1/K) Σ_k ∇ℓ(θ; x_i^(k)) (augmentation multiplicity, docs/algorithms.md §8;
        a user's m examples, §11). Default: one view.
      class_weights: (w_0, …, w_{K−1}), the loss weight of each class index as float32
        values (classes beyond the table weigh 1), or None.
      sample_weights: fit's per-example weights ([N] or [N, T] arrays, one per output if
        nested), carried with each Poisson-sampled example by the input pipeline. They are
        data, not constants of the trace: compared by their nesting only
        (``sample_weight_layout``).
      per_example_extras: fit's ``per_example_extras``, {name: array with one row per
        training example} carried with each Poisson-sampled example into the batch the
        train step receives (``data[name]``), for a per-example objective that reads
        more than x and y (tf_dp.models.objective). Data, compared by their names only
        (``extra_names``).
      mechanism: the run's ``tf_dp.mechanism.DPMechanism`` (sampling scheme, privatizer,
        clipping, clip bound), built and checked once per ``fit``/``train_on_batch``: what the
        model and the budget ask about the running mechanism (its ledger phase, whether a
        segment is accounted whole, the event of a phase). Not a constant of the trace: the
        step reads nothing from it, so it is not compared (a new fit does not retrace).
    """

    ledger: object = None
    views: AugmentationViews = ONE_VIEW
    class_weights: Optional[Tuple[float, ...]] = None
    sample_weights: object = field(default=None, compare=False, repr=False)
    sample_weight_layout: Optional[str] = field(default=None, init=False)
    per_example_extras: Optional[Mapping[str, object]] = field(default=None, compare=False, repr=False)
    extra_names: Tuple[str, ...] = field(default=(), init=False)
    mechanism: object = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.views, AugmentationViews):
            raise TypeError(f"`views` must be an AugmentationViews, got {self.views!r}.")
        if self.class_weights is not None and not isinstance(self.class_weights, tuple):
            raise TypeError(f"`class_weights` must be a tuple of floats (class index → weight), got "
                            f"{type(self.class_weights).__name__}: build it with class_weight_table(dict).")
        layout = None if self.sample_weights is None else repr(
            tf.nest.map_structure(lambda _: None, self.sample_weights))
        object.__setattr__(self, "sample_weight_layout", layout)  # frozen: set once, here
        object.__setattr__(self, "extra_names", _extra_names(self.per_example_extras))

    def replace(self, **changes) -> "StepPlan":
        """A copy with ``changes`` (the plan itself is never modified)."""
        return dataclasses.replace(self, **changes)


RESERVED_BATCH_KEYS = ("x", "y", "mask", "expected_batch_size")  # the Poisson batch's own entries


def _extra_names(extras) -> Tuple[str, ...]:
    """The sorted names of ``per_example_extras``, refusing what the batch cannot carry."""
    if extras is None:
        return ()
    if not isinstance(extras, Mapping):
        raise TypeError(f"`per_example_extras` must be a dict {{name: per-example array}}, got "
                        f"{type(extras).__name__}.")
    for name in extras:
        if not isinstance(name, str) or name in RESERVED_BATCH_KEYS or name.startswith("sample_weight"):
            raise ValueError(f"`per_example_extras` name {name!r} is not allowed: use a string other than "
                             f"{RESERVED_BATCH_KEYS} and not starting with 'sample_weight' (the batch's own "
                             "entries).")
    return tuple(sorted(extras))


def class_weight_table(class_weight: dict) -> Tuple[float, ...]:
    """{class index: weight} → (w_0, …, w_{K−1}) with K = the largest index + 1; classes not
    listed weigh 1, as in Keras. Weights are rounded to float32, the dtype the step uses.

    Args:
      class_weight: a non-empty dict {class index >= 0: weight}.

    Returns:
      The table as a tuple of floats (hashable, so a plan field).
    """
    if not isinstance(class_weight, dict) or not class_weight:
        raise TypeError(f"`class_weight` must be a non-empty dict {{class index: weight}}, got {class_weight!r}.")
    classes = [int(k) for k in class_weight]
    if min(classes) < 0:
        raise ValueError(f"`class_weight` keys must be class indices >= 0, got {sorted(classes)}.")
    table = np.ones(max(classes) + 1, np.float32)
    for key, weight in class_weight.items():
        table[int(key)] = float(weight)
    return tuple(float(w) for w in table)
