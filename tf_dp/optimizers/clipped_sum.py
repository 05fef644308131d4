"""What a DP model hands its optimizer each step: one frozen value, through Keras' own
``optimizer.apply`` (as ``LossScaleOptimizer`` keeps Keras' contract).

``DPOptimizer.apply(ClippedSum(...), variables)`` runs the mechanism's chain on it
(docs/algorithms.md §1.2 steps 4–6); ``apply`` of raw gradients still raises."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence


@dataclasses.dataclass(frozen=True)
class ClippedSum:
    """One DP step's clipped per-example gradient sum and what its release depends on.

    Args:
      sums: Σ_i ḡ_i per trainable variable, each ḡ_i clipped to sensitivity S(C).
      expected_batch_size: L — the expected Poisson batch size or an explicit batch's size
        (never the realized one).
      dp_step: the ledger's DP step count before this step: the noise counter.
      noise_multiplier: σ of this step, the same read the ledger records (None: the
        optimizer's current value).
      release: 1.0, or 0.0 when the budget or the ledger refuses the step (then the update
        receives a zero gradient).
      public_gradients: data-independent gradient terms (weight regularizers) added after
        averaging; they cost no privacy.
      squared_norms: the batch's per-example squared norms [B] (an adaptive clip bound only).
      mask: the batch's 0/1 example mask [B] (an adaptive clip bound only).
    """

    sums: Sequence[Any]
    expected_batch_size: Any
    dp_step: Any
    noise_multiplier: Optional[Any] = None
    release: Optional[Any] = None
    public_gradients: Optional[Sequence[Any]] = None
    squared_norms: Optional[Any] = None
    mask: Optional[Any] = None
