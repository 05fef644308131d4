"""PerExampleObjective: the per-example term whose gradient the DP step clips (docs/algorithms.md §1).

DP-SGD clips g_i = ∇ℓ_i, the gradient of example i's compiled loss (§1 step 3). A method built
on the same step may clip the gradient of another per-example term and pack more per-example
columns into y than the labels: RaCO-DP clips ∇(ℓ_i + L·W[π_i]·p̃(x_i)) (§5.3). Such a term is
an objective passed to the step as an argument (``DPTrainStep._dp_step(..., objective=...)``),
built for that step from the values it may read (for RaCO-DP: the step's noisy histogram) and
used in the same call: nothing is stored on the model between building and use.

Whatever the term, each example's gradient is clipped to C before the noise is added, so the
sensitivity of the clipped sum stays C (§1); values that are not data of the example (W, L)
must be public or released (RaCO-DP's W is post-processing of its noisy histogram, §5.2).
Per-example columns the term reads (RaCO-DP's group ids) reach the step as data: ``fit``'s
``per_example_extras`` carries them with each Poisson-sampled example (``StepPlan``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from tf_dp.models.losses import unpack_targets

INPUTS, TARGETS, WEIGHTS = "x", "y", "sample_weight"  # keys of targets packed with the inputs (compute_loss)

PerExampleLoss = Callable  # (y_true, y_pred) -> [P] losses, one per example of the chunk


@dataclass(frozen=True)
class PerExampleObjective:
    """The per-example term of one DP step and the labels metrics compare with.

    Attributes:
      loss: ``loss(y, y_pred) -> [P]``, the term term_i of each example whose gradient is
        clipped; None: the compiled per-example loss ℓ_i (DP-SGD, docs/algorithms.md §1).
        It must depend on example i's row of y and y_pred only (the chunk's other rows
        would make term_i a function of other examples).
      labels: ``labels(y)``, the labels inside y that the compiled metrics compare with the
        predictions; None: y itself (without its sample weights, if packed with them).
    """

    loss: Optional[PerExampleLoss] = None
    labels: Optional[Callable] = None

    def __post_init__(self):
        for name in ("loss", "labels"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"PerExampleObjective `{name}` must be a callable or None, got {value!r}.")

    def per_example_loss(self, compiled_loss: PerExampleLoss) -> PerExampleLoss:
        """The function whose per-example gradients are clipped.

        Args:
          compiled_loss: the model's compiled per-example loss ℓ(y, y_pred) -> [P].

        Returns:
          ``loss``, or ``compiled_loss`` when the objective has none.
        """
        return compiled_loss if self.loss is None else self.loss

    def labels_of(self, y):
        """The labels of ``y`` for the metrics: ``labels(y)``, or y's targets (§1)."""
        return unpack_targets(y)[0] if self.labels is None else self.labels(y)


COMPILED_LOSS = PerExampleObjective()  # DP-SGD's: ℓ_i of the compiled loss, y's own labels


def packed_targets(x, y):
    """{x, y, sample_weight} for a loss that reads the inputs (``ComputeLossTerms``).

    Args:
      x: the examples' inputs.
      y: their targets (None, or packed with sample weights in a ``WeightedTargets``).

    Returns:
      The dict, without the keys whose value is None.
    """
    targets, sample_weight = unpack_targets(y)
    packed = {INPUTS: x}
    if targets is not None:
        packed[TARGETS] = targets
    if sample_weight is not None:
        packed[WEIGHTS] = sample_weight
    return packed


def probe_targets(per_example_loss, x, y):
    """The targets the row-independence probe hands ``per_example_loss``.

    Args:
      per_example_loss: the loss the DP step clips.
      x, y: the probed rows' inputs and targets.

    Returns:
      ``packed_targets(x, y)`` for a loss that reads the inputs (``ComputeLossTerms``), else y.
    """
    return packed_targets(x, y) if getattr(per_example_loss, "reads_inputs", False) else y
