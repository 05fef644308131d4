"""Clipping policies: how each example's gradient is bounded (docs/algorithms.md §1 step 3, §13).

A policy is one part of the DP mechanism, chosen by the optimizer's ``clipping=`` argument
(default ``"flat"``: one threshold C on the flat norm over all trainable variables). The
engine (``tf_dp.clipping.engine``) computes every example's squared norm per contributing
layer; the policy groups the layers, turns the groups' squared norms into clip factors,
and states the bound on the whole clipped vector, which sets the noise std (σ times it).

Add a policy: subclass ``ClippingPolicy``, decorate it with ``@register_clipping("name")``,
and test that every example's clipped vector has norm ≤ ``sensitivity(C)`` against a
per-example loop (docs/design.md).
"""

from __future__ import annotations

from typing import Sequence

import keras
import tensorflow as tf

from tf_dp.clipping.clip import clip_factors

CLIPPING_POLICIES: dict = {}


def register_clipping(name: str):
    """Class decorator: registers a ClippingPolicy under ``name`` (``clipping="name"``)."""
    def register(cls):
        if name in CLIPPING_POLICIES and CLIPPING_POLICIES[name] is not cls:
            raise ValueError(f"A clipping policy named {name!r} is already registered.")
        CLIPPING_POLICIES[name] = cls
        return keras.saving.register_keras_serializable(package="tf_dp")(cls)
    return register


class ClippingPolicy:
    """Base class. ``groups`` partitions the contributing layers; ``factors`` clips."""

    def groups(self, layers: Sequence) -> list:
        """A group index (0..K−1) for each layer owning trainable variables, in order.
        Default: one group (the flat norm)."""
        return [0] * len(layers)

    def factors(self, group_squared_norms: Sequence[tf.Tensor], l2_norm_clip, mask) -> list:
        """Per group k, the factor c_i^k of every example (a [B] tensor, 0 for padding and
        non-finite examples), from the groups' squared norms U_{i,k}² (float64 upper bounds)."""
        raise NotImplementedError

    def sensitivity(self, l2_norm_clip):
        """The bound on every example's whole clipped vector: the noise std is σ times it."""
        return l2_norm_clip

    def get_config(self) -> dict:
        return {}

    @classmethod
    def from_config(cls, config: dict):
        return cls(**config)


@register_clipping("flat")
class FlatClip(ClippingPolicy):
    """c_i = min(1, C/‖g_i‖) on the flat norm over all trainable variables (docs/algorithms.md §1)."""

    def factors(self, group_squared_norms, l2_norm_clip, mask):
        return [clip_factors(tf.add_n(list(group_squared_norms)), l2_norm_clip, mask)]

    def __repr__(self) -> str:
        return "FlatClip()"


def resolve_clipping(clipping) -> ClippingPolicy:
    """``clipping=`` of a DP optimizer: None/"flat", a registered name, a policy or its config."""
    if clipping is None:
        return FlatClip()
    if isinstance(clipping, ClippingPolicy):
        return clipping
    if isinstance(clipping, str):
        if clipping not in CLIPPING_POLICIES:
            raise ValueError(f"`clipping` must be a tf_dp.clipping.ClippingPolicy or one of "
                             f"{sorted(CLIPPING_POLICIES)}, got {clipping!r}.")
        return CLIPPING_POLICIES[clipping]()
    if isinstance(clipping, dict):
        resolved = keras.saving.deserialize_keras_object(clipping)
        if isinstance(resolved, ClippingPolicy):
            return resolved
    raise TypeError(f"`clipping` must be a tf_dp.clipping.ClippingPolicy or one of {sorted(CLIPPING_POLICIES)}, "
                    f"got {clipping!r}.")
