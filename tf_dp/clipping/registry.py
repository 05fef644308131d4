"""Per-layer rules for per-example gradient norms and clipped sums.

A rule turns what one forward/backward pass records for a layer — its inputs and the
gradient of Σ_i ℓ_i with respect to its (pre-activation) output — into, for every example
i, the squared norm ‖∂ℓ_i/∂θ_layer‖² and, given clip factors c_i, the clipped sum
Σ_i c_i ∂ℓ_i/∂θ_layer. Ghost rules do both without materialising per-example gradients
(ALGORITHMS §6, book-keeping of Bu et al. 2023). Layers without a rule fall back to
``tf.vectorized_map`` over that layer alone.

Add a rule for your own layer with ``register_ghost_rule(MyLayer, MyRule())``.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Optional

import tensorflow as tf


class Recording:
    """What one call of a layer left behind: the inputs a rule needs and the tensors whose
    gradients (output gradients s) it needs."""

    def __init__(self, inputs: Any, watched: list[tf.Tensor], extras: Any = None):
        self.inputs = inputs
        self.watched = watched
        self.extras = extras


class Contribution(abc.ABC):
    """A layer's per-example gradients in implicit (ghost) or explicit form."""

    @abc.abstractmethod
    def squared_norms(self) -> tf.Tensor:
        """[P] tensor: ‖∂ℓ_i/∂θ_layer‖² for each example i."""

    @abc.abstractmethod
    def weighted_sums(self, clip_factors: tf.Tensor) -> list[tf.Tensor]:
        """Σ_i c_i ∂ℓ_i/∂θ for each of the rule's variables, in ``GhostRule.variables`` order."""


class CombinedContribution(Contribution):
    """Several contributions of one layer (e.g. LoRA's A and B parts): their squared norms
    add up, and their weighted sums, in order, are reshaped to the variables' shapes."""

    def __init__(self, parts: list[Contribution], shapes: list):
        self.parts, self.shapes = parts, shapes

    def squared_norms(self):
        return tf.add_n([part.squared_norms() for part in self.parts])

    def weighted_sums(self, clip_factors):
        sums = [s for part in self.parts for s in part.weighted_sums(clip_factors)]
        return [tf.reshape(s, shape) for s, shape in zip(sums, self.shapes)]


class GhostRule(abc.ABC):
    """How to tap one layer class. Subclass and register for custom layers."""

    def applies_to(self, layer) -> bool:
        return True

    @abc.abstractmethod
    def variables(self, layer) -> list:
        """The trainable variables the rule accounts for, in a fixed order."""

    @abc.abstractmethod
    def tapped_call(self, layer, original_call: Callable, recordings: list, *args, **kwargs):
        """Computes the layer's output like ``original_call`` and appends a ``Recording``."""

    @abc.abstractmethod
    def contribution(self, layer, recordings: list[Recording], output_grads: list[list[tf.Tensor]]) -> Contribution:
        """Builds the layer's per-example contribution from its recordings and their gradients."""


_RULES: dict[type, GhostRule] = {}


def register_ghost_rule(layer_class: type, rule: GhostRule) -> None:
    """Registers ``rule`` for ``layer_class`` (and subclasses without a rule of their own)."""
    if not isinstance(layer_class, type):
        raise TypeError(f"`layer_class` must be a class, got {layer_class!r}.")
    if not isinstance(rule, GhostRule):
        raise TypeError(f"`rule` must be a tf_dp.clipping.GhostRule, got {type(rule).__name__}.")
    _RULES[layer_class] = rule


def ghost_rule_for(layer) -> Optional[GhostRule]:
    """The most specific registered rule that applies to ``layer``, else None."""
    for cls in type(layer).__mro__:
        rule = _RULES.get(cls)
        if rule is not None:
            return rule if rule.applies_to(layer) else None
    return None
