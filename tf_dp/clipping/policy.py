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

import math
from typing import Optional, Sequence

import keras
import tensorflow as tf

from tf_dp import _checks
from tf_dp.clipping.clip import clip_factors

CLIPPING_POLICIES: dict = {}


def register_clipping(name: str):
    """Class decorator: registers a ClippingPolicy under ``name`` (``clipping="name"``).

    Args:
      name: the name users pass as ``clipping=``.

    Returns:
      A decorator that registers the class (also as Keras-serializable) and returns it.

    Raises:
      ValueError: another class is already registered under ``name`` (raised by the decorator).
    """
    def register(cls):
        if name in CLIPPING_POLICIES and CLIPPING_POLICIES[name] is not cls:
            raise ValueError(f"A clipping policy named {name!r} is already registered.")
        CLIPPING_POLICIES[name] = cls
        return keras.saving.register_keras_serializable(package="tf_dp")(cls)
    return register


class ClippingPolicy:
    """Base class. ``groups`` partitions the contributing layers; ``factors`` clips.

    The engine calls ``groups`` with the layers owning the model's trainable variables
    (while tracing, so before any step), sums each group's per-example squared norms
    U_{i,k}² (float64 upper bounds on ‖g_i^k‖²), calls ``factors`` and applies group k's
    factor to that group's layers (rounded toward zero to float32). ``sensitivity(C)`` must
    bound ‖(c_i^k g_i^k)_k‖ for every example: the noise std on the sum is σ times it."""

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

    def check_clip_norm(self, l2_norm_clip) -> None:
        """Raises ValueError if this policy cannot clip against ``l2_norm_clip`` (a number, or
        an adaptive bound such as tf_dp.clipping.AdaptiveClip); the optimizer calls it
        eagerly at construction, before training. Default: accepts any."""

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

    def __eq__(self, other) -> bool:  # stateless: every FlatClip is the same policy (one traced graph)
        return type(other) is FlatClip

    def __hash__(self) -> int:
        return hash(FlatClip)

    def __repr__(self) -> str:
        return "FlatClip()"


@register_clipping("per_layer")
class PerLayer(ClippingPolicy):
    """Per-layer clipping (docs/algorithms.md §13): every layer k owning trainable variables is
    its own group, ḡ_i^k = g_i^k · min(1, C_k/‖g_i^k‖), so the whole clipped vector has norm
    ≤ sqrt(Σ_k C_k²), the sensitivity.

    Args:
      thresholds: None — equal split C_k = C/√K over the K layers owning trainable variables
        (K is fixed when the step is traced), sensitivity C = ``l2_norm_clip``; or a dict
        {layer name or layer path: C_k} naming EVERY such layer — then the sensitivity is
        C = sqrt(Σ_k C_k²), and ``l2_norm_clip`` must equal it (relative tolerance 1e-6):
        a mismatch is refused, so the C the optimizer logs and saves is the true bound.
        A name that is not a trainable layer of the model, one that matches several
        layers, or a layer left without a threshold raises ValueError when the step is
        traced (before the first update), listing the layer names.
    """

    def __init__(self, thresholds: Optional[dict] = None):
        if thresholds is not None:
            if not isinstance(thresholds, dict) or not thresholds:
                raise TypeError("`thresholds` must be None (equal split C/√K) or a non-empty dict "
                                f"{{layer name: C_k}}, got {thresholds!r}.")
            thresholds = {str(name): _checks.positive(f"thresholds[{name!r}]", value,
                                                      "Each layer's clip bound C_k must be > 0.")
                          for name, value in thresholds.items()}
        self.thresholds = thresholds
        self._group_thresholds = None  # C_k per group, resolved by groups()

    def groups(self, layers):
        if self.thresholds is not None:
            self._group_thresholds = _thresholds_per_layer(self.thresholds, layers)
        return list(range(len(layers)))

    def factors(self, group_squared_norms, l2_norm_clip, mask):
        if self.thresholds is None:
            count = len(group_squared_norms)
            bounds = [tf.cast(l2_norm_clip, tf.float64) / math.sqrt(count)] * count
        else:
            if self._group_thresholds is None or len(self._group_thresholds) != len(group_squared_norms):
                raise ValueError("PerLayer.factors: groups() was not called with this model's layers.")
            self._assert_clip_matches(l2_norm_clip)
            bounds = self._group_thresholds
        return [clip_factors(squared, bound, mask) for squared, bound in zip(group_squared_norms, bounds)]

    def sensitivity(self, l2_norm_clip):
        if self.thresholds is None:
            return l2_norm_clip
        return self.total_bound()

    def total_bound(self) -> float:
        """sqrt(Σ_k C_k²) of the dict thresholds (the sensitivity)."""
        return math.sqrt(sum(value * value for value in self.thresholds.values()))

    def check_clip_norm(self, l2_norm_clip) -> None:
        if self.thresholds is None:
            return
        if hasattr(l2_norm_clip, "next_bound"):
            raise ValueError("PerLayer(thresholds={...}) has the fixed sensitivity sqrt(Σ C_k²); an adaptive "
                             "`l2_norm_clip` cannot move it. Use PerLayer() (C_t/√K per layer) with an "
                             "adaptive bound.")
        total = self.total_bound()
        if not math.isclose(float(l2_norm_clip), total, rel_tol=1e-6):
            raise ValueError(self._mismatch_message(l2_norm_clip))

    def _mismatch_message(self, l2_norm_clip) -> str:
        return (f"PerLayer(thresholds=...) bounds the whole clipped vector by sqrt(Σ C_k²) = {self.total_bound()!r}, "
                f"but `l2_norm_clip` is {l2_norm_clip}. Pass l2_norm_clip={self.total_bound()!r} (the sensitivity), "
                "or thresholds=None to split l2_norm_clip equally over the layers.")

    def _assert_clip_matches(self, l2_norm_clip) -> None:
        static = tf.get_static_value(l2_norm_clip) if tf.is_tensor(l2_norm_clip) else l2_norm_clip
        if static is not None:
            self.check_clip_norm(float(static))
            return
        total = self.total_bound()
        tf.debugging.assert_less_equal(tf.abs(tf.cast(l2_norm_clip, tf.float64) - total),
                                       tf.constant(1e-6 * total, tf.float64),
                                       message=self._mismatch_message("(a tensor) not equal to it"))

    def get_config(self) -> dict:
        return {"thresholds": None if self.thresholds is None else dict(self.thresholds)}

    def __repr__(self) -> str:
        return f"PerLayer(thresholds={self.thresholds!r})"


def _thresholds_per_layer(thresholds: dict, layers: Sequence) -> list:
    """C_k of each layer, matched by ``layer.path`` or ``layer.name``; every key must match
    exactly one layer and every layer exactly one key."""
    described = ", ".join(f"{layer.name!r} (path {_path(layer)!r})" for layer in layers)
    matches = {key: [i for i, layer in enumerate(layers) if key in (layer.name, _path(layer))] for key in thresholds}
    unknown = [key for key, found in matches.items() if not found]
    if unknown:
        raise ValueError(f"PerLayer thresholds name {unknown}, which are not trainable layers of the model. "
                         f"The layers owning trainable variables are: {described}.")
    ambiguous = [key for key, found in matches.items() if len(found) > 1]
    if ambiguous:
        raise ValueError(f"PerLayer thresholds {ambiguous} match several layers; name them by path. "
                         f"The layers owning trainable variables are: {described}.")
    owner = {}
    for key, (index,) in matches.items():
        if index in owner:
            raise ValueError(f"PerLayer thresholds {owner[index]!r} and {key!r} name the same layer "
                             f"{layers[index].name!r}; give it one threshold.")
        owner[index] = key
    missing = [layers[i].name for i in range(len(layers)) if i not in owner]
    if missing:
        raise ValueError(f"PerLayer thresholds give no C_k for layers {missing}; every layer owning trainable "
                         f"variables needs one. The layers are: {described}.")
    return [thresholds[owner[i]] for i in range(len(layers))]


def _path(layer) -> str:
    return getattr(layer, "path", None) or layer.name


@register_clipping("normalized")
class Normalized(ClippingPolicy):
    """Normalized ("automatic") clipping (docs/algorithms.md §13): c_i = C/(‖g_i‖ + γ) on the
    flat norm, so every clipped vector has norm C‖g_i‖/(‖g_i‖ + γ) < C, the sensitivity.
    Padding and non-finite examples get c_i = 0. (With U_i ≥ ‖g_i‖ the certified bound,
    c_i = C/(U_i + γ) only shrinks.)

    Args:
      gamma: γ > 0, the stabilizer (0.01): small γ approaches g_i/‖g_i‖ scaled by C.
    """

    def __init__(self, gamma: float = 0.01):
        self.gamma = _checks.positive("gamma", gamma, "Normalized clipping divides by ‖g_i‖ + gamma.")

    def factors(self, group_squared_norms, l2_norm_clip, mask):
        squared = tf.add_n(list(group_squared_norms))
        valid = tf.logical_and(tf.math.is_finite(squared), squared >= 0)
        safe = tf.where(valid, squared, tf.zeros_like(squared))
        clip = tf.cast(l2_norm_clip, squared.dtype)
        factors = tf.where(valid, clip / (tf.sqrt(safe) + self.gamma), tf.zeros_like(squared))
        return [factors * tf.cast(mask, factors.dtype)]

    def get_config(self) -> dict:
        return {"gamma": self.gamma}

    def __repr__(self) -> str:
        return f"Normalized(gamma={self.gamma!r})"


def resolve_clipping(clipping) -> ClippingPolicy:
    """``clipping=`` of a DP optimizer: None/"flat", a registered name, a policy or its config.

    Args:
      clipping: None, a registered policy name, a ``ClippingPolicy``, or a policy's config dict.

    Returns:
      The ``ClippingPolicy`` (``FlatClip`` for None).
    """
    return _checks.registered_part("clipping", clipping, CLIPPING_POLICIES, ClippingPolicy, FlatClip,
                                   "a tf_dp.clipping.ClippingPolicy")
