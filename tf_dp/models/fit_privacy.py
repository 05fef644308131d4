"""``fit``'s DP keywords, parsed and validated once (as jax_privacy's ``DPKerasConfig`` is)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from tf_dp import _checks
from tf_dp.sampling import seed_guard


@dataclasses.dataclass(frozen=True)
class FitPrivacy:
    """The DP keywords of one ``DPModel.fit`` call beside Keras' own, checked in the constructor.

    Args:
      batch_size: the expected batch size L (Poisson sampling) or the declared L of a batched
        dataset; None only for a batched dataset with a static batch size.
      physical_batch_size: examples per chunk of a Poisson batch, or None (one chunk).
      sampling_seed: the secret seed of the batches, or None (OS entropy); never shown.
      secure_mode: the optimizer's secure mode, which samples from OS entropy and takes no seed.
      transform: turns a source's record into an example (x, y), or None.
      augment: ``augment(x, seed) -> x'``, per-example augmentation in the input pipeline.
      augmentation_multiplicity: K views per sampled example, averaged before clipping.
      user_ids: the user of each example (user-level DP), or None.
      examples_per_user: m examples per sampled user, or None.
      sampling: the sampling scheme's name, or None (the optimizer's default).
      per_example_extras: {name: one row per example} for a train step of the model's own.
    """

    batch_size: Optional[int] = None
    physical_batch_size: Optional[int] = None
    sampling_seed: Optional[int] = None
    secure_mode: bool = False
    transform: Optional[Callable] = None
    augment: Optional[Callable] = None
    augmentation_multiplicity: int = 1
    user_ids: Any = None
    examples_per_user: Optional[int] = None
    sampling: Any = None
    per_example_extras: Optional[dict] = None

    def __post_init__(self):
        seed_guard.check_sampling_seed(self.sampling_seed)
        if self.secure_mode and self.sampling_seed is not None:
            raise ValueError("`secure_mode=True` samples batches from OS entropy; it accepts no `sampling_seed`.")
        _checks.positive_int("augmentation_multiplicity", self.augmentation_multiplicity)
        if self.augment is not None and not callable(self.augment):
            raise TypeError(f"`augment` must be a callable augment(x, seed) -> x, got {self.augment!r}.")
        if self.per_example_extras is not None and not isinstance(self.per_example_extras, dict):
            raise TypeError(f"`per_example_extras` must be a dict {{name: per-example array}}, got "
                            f"{type(self.per_example_extras).__name__}.")

    def __repr__(self) -> str:
        return f"FitPrivacy(batch_size={self.batch_size}, sampling={self.sampling!r}, <seed hidden>)"

    def sampling_arguments(self) -> dict:
        """The keywords the sampling scheme is built with (``scheme_for_fit``).

        Returns:
          {"user_ids": ..., "examples_per_user": ...}.
        """
        return {"user_ids": self.user_ids, "examples_per_user": self.examples_per_user}

    def refuse_resampling(self, what: str) -> None:
        """Refuses the keywords that need fit to sample from arrays or a source.

        Args:
          what: what was given instead (a batched dataset).
        """
        arguments = {**self.sampling_arguments(), "per_example_extras": self.per_example_extras}
        given = sorted(name for name, value in arguments.items() if value is not None)
        if given:
            raise ValueError(f"{given} need fit() to sample from arrays or a random-access source; {what} cannot "
                             "be resampled.")
