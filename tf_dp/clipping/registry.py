"""Per-layer rules for per-example gradient norms and clipped sums.

A rule turns what one forward/backward pass records for a layer — its inputs and the
gradient of Σ_i ℓ_i with respect to its (pre-activation) output — into, for every example
i, the squared norm ‖∂ℓ_i/∂θ_layer‖² and, given clip factors c_i, the clipped sum
Σ_i c_i ∂ℓ_i/∂θ_layer. Ghost rules do both without materialising per-example gradients
(docs/algorithms.md §6, book-keeping of Bu et al. 2023). Layers without a rule fall back to
``tf.vectorized_map`` over that layer alone.

Add a rule for your own layer with ``register_ghost_rule(MyLayer, MyRule())`` (every model), or
to a ``LayerRegistry`` of one's own given to one model (``compile(layer_registry=...)``).
"""

from __future__ import annotations

import abc
import inspect
import sys
from typing import Any, Callable, Optional

import keras
import tensorflow as tf


class Recording:
    """What one call of a layer left behind: the inputs a rule needs and the tensors whose
    gradients (output gradients s) it needs.

    Args:
      inputs: the layer call's inputs the rule needs.
      watched: the tensors whose gradients (output gradients s) the rule needs.
      extras: anything else the rule recorded, or None.
    """

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
    """How to tap one layer class. Subclass and register for custom layers.

    A rule models one computation: that of the class it was registered for, called with the
    arguments of its ``tapped_call``. ``ghost_rule_for`` never gives it to a subclass whose
    ``call`` differs, and the tap replays any call whose arguments ``accepts_call`` refuses
    per example instead (tap.py)."""

    def applies_to(self, layer) -> bool:
        return True

    def accepts_call(self, layer, args: tuple, kwargs: dict) -> bool:
        """Whether ``tapped_call`` models this call: its arguments bind to the signature of
        ``tapped_call`` (an argument the rule does not name, e.g. ``reverse=True`` on an
        Embedding subclass, is refused) and the first one is a tensor."""
        try:
            inspect.signature(self.tapped_call).bind(layer, None, None, *args, **kwargs)
        except TypeError:
            return False
        return bool(args) and _is_tensor(args[0])

    @abc.abstractmethod
    def variables(self, layer) -> list:
        """The trainable variables the rule accounts for, in a fixed order."""

    @abc.abstractmethod
    def tapped_call(self, layer, original_call: Callable, recordings: list, *args, **kwargs):
        """Computes the layer's output like ``original_call`` and appends a ``Recording``."""

    @abc.abstractmethod
    def contribution(self, layer, recordings: list[Recording], output_grads: list[list[tf.Tensor]]) -> Contribution:
        """Builds the layer's per-example contribution from its recordings and their gradients."""


def unit_variables(layer) -> list:
    """The trainable variables a tapped unit accounts for: its own, or for a recurrent layer
    (tapped whole: its cell runs inside a while loop) those of its cell."""
    owners = [layer]
    if isinstance(layer, keras.layers.RNN):
        owners = list(layer.cell._flatten_layers(include_self=True))
    # Keras keeps a variable in _trainable_variables after `v.trainable = False`
    # (e.g. a LoRA-frozen kernel): only trainable ones enter the per-example norm.
    return [v for owner in owners for v in owner._trainable_variables if v.trainable]


class LayerRegistry:
    """Which ``GhostRule`` computes the per-example norms of which layer class: an object
    handed to the engine (``compile(layer_registry=...)``, ``make_private(...,
    layer_registry=...)``, ``clipped_gradient_sum(..., layer_registry=...)``), so that a rule
    added for one model affects no other. ``default_layer_registry()`` is the one prebuilt
    with tf_dp's rules (filled when tf_dp is imported; ``register_ghost_rule`` adds to it);
    ``copy()`` of it is the usual start of one's own. Layers without a rule take the
    op-level rule or the per-example replay (exact either way), whatever the registry.

    Args:
      rules: optional {layer class: GhostRule} to start with.
    """

    def __init__(self, rules: Optional[dict] = None):
        self._rules: dict[type, GhostRule] = {}
        self._by_name: dict[str, GhostRule] = {}  # "module.Class" of optional packages, never imported here
        self._by_public_name: dict[str, GhostRule] = {}  # "package.api.Class", resolved once the package is loaded
        for layer_class, rule in (rules or {}).items():
            self.register(layer_class, rule)

    def copy(self) -> "LayerRegistry":
        """A new registry holding this one's rules now; later changes to either stay apart.

        Returns:
          The copy.
        """
        other = LayerRegistry()
        other._rules, other._by_name = dict(self._rules), dict(self._by_name)
        other._by_public_name = dict(self._by_public_name)
        return other

    def register(self, layer_class: type, rule: GhostRule) -> "LayerRegistry":
        """Registers ``rule`` for ``layer_class`` (and subclasses that inherit its ``call``
        and have no rule of their own) in this registry.

        Args:
          layer_class: a Keras layer class.
          rule: the ``tf_dp.clipping.GhostRule`` computing its per-example gradient norms.

        Returns:
          This registry (calls chain).

        Raises:
          TypeError: ``layer_class`` is not a class or ``rule`` is not a GhostRule.
        """
        if not isinstance(layer_class, type):
            raise TypeError(f"`layer_class` must be a class, got {layer_class!r}.")
        self._rules[layer_class] = _checked_rule(rule)
        return self

    def register_by_name(self, qualified_name: str, rule: GhostRule) -> None:
        """Registers ``rule`` for the class defined as ``module.QualName`` (a class of an
        optional package such as keras-hub, matched without importing it). Prefer
        ``register_by_public_name`` where the package exports the class.

        Args:
          qualified_name: "module.QualName" of the defining module.
          rule: the GhostRule for that class.
        """
        self._by_name[qualified_name] = _checked_rule(rule)

    def register_by_public_name(self, public_name: str, rule: GhostRule) -> None:
        """Registers ``rule`` for the class an optional package exports as ``public_name``
        ("keras_hub.layers.ReversibleEmbedding": the module ``keras_hub.layers``, its attribute
        ``ReversibleEmbedding``). The package is never imported: the name is resolved on the
        first lookup after the user's own import loaded the module, and the rule is then
        registered for that class, unless one is registered for it already.

        Args:
          public_name: "module.Attribute", the module the package documents the class under.
          rule: the GhostRule for that class.
        """
        module, _, attribute = public_name.rpartition(".")
        rule = _checked_rule(rule)
        if not module or not attribute:
            raise ValueError(f"`public_name` must be 'module.Attribute', got {public_name!r}.")
        self._by_public_name[public_name] = rule

    def rule_for(self, layer) -> Optional[GhostRule]:
        """The most specific registered rule that applies to ``layer``, else None. A rule
        registered for a class C is used for a subclass only if the subclass inherits C's
        ``call`` unchanged (a subclass with its own ``call`` computes something else).

        Args:
          layer: a Keras layer.

        Returns:
          The ``GhostRule``, or None.
        """
        if self._by_public_name:
            self._resolve_public_names()
        for cls in type(layer).__mro__:
            rule = self._rules.get(cls) or self._by_name.get(f"{cls.__module__}.{cls.__qualname__}")
            if rule is not None:
                same_computation = getattr(type(layer), "call", None) is getattr(cls, "call", None)
                return rule if same_computation and rule.applies_to(layer) else None
        return None

    def resolve(self, layer) -> Optional[GhostRule]:
        """The rule the taps use for ``layer``: its registered rule (``rule_for``); else the
        op-level rule (op_rules.py), if it applies; else None (the per-example replay).

        Args:
          layer: a Keras layer.

        Returns:
          The ``GhostRule``, or None.
        """
        rule = self.rule_for(layer)
        if rule is None and _OP_LEVEL and _OP_LEVEL[0].applies_to(layer):
            return _OP_LEVEL[0]
        return rule

    def _resolve_public_names(self) -> None:
        """Keys the rules of public names whose module is loaded by their classes (without
        importing anything); a name the loaded package does not export stays unresolved."""
        for public_name in list(self._by_public_name):
            module_name, _, attribute = public_name.rpartition(".")
            cls = getattr(sys.modules.get(module_name), attribute, None)
            rule = self._by_public_name.pop(public_name, None) if isinstance(cls, type) else None
            if rule is not None:  # (None also when another thread resolved it first)
                self._rules.setdefault(cls, rule)


def _checked_rule(rule) -> GhostRule:
    if not isinstance(rule, GhostRule):
        raise TypeError(f"`rule` must be a tf_dp.clipping.GhostRule, got {type(rule).__name__}.")
    return rule


_DEFAULT = LayerRegistry()
# The default registry's tables, under their old names (tests patch them).
_RULES, _RULES_BY_NAME, _RULES_BY_PUBLIC_NAME = _DEFAULT._rules, _DEFAULT._by_name, _DEFAULT._by_public_name


def default_layer_registry() -> LayerRegistry:
    """The registry prebuilt with tf_dp's rules, used when none is passed; the one
    ``register_ghost_rule`` adds to.

    Returns:
      The default ``LayerRegistry``.
    """
    return _DEFAULT


def as_layer_registry(registry: Optional[LayerRegistry]) -> LayerRegistry:
    """``registry``, checked, or the default one for None.

    Args:
      registry: a ``LayerRegistry`` or None.

    Returns:
      The ``LayerRegistry`` to use.

    Raises:
      TypeError: ``registry`` is something else.
    """
    if registry is None:
        return _DEFAULT
    if not isinstance(registry, LayerRegistry):
        raise TypeError(f"`layer_registry` must be a tf_dp.clipping.LayerRegistry, got {type(registry).__name__}.")
    return registry


def register_ghost_rule(layer_class: type, rule: GhostRule) -> None:
    """Registers ``rule`` for ``layer_class`` (and subclasses without a rule of their own) in
    the default registry, so for every model not given a registry of its own.

    Args:
      layer_class: a Keras layer class.
      rule: the ``tf_dp.clipping.GhostRule`` computing its per-example gradient norms.

    Raises:
      TypeError: ``layer_class`` is not a class or ``rule`` is not a GhostRule.
    """
    _DEFAULT.register(layer_class, rule)


def register_ghost_rule_by_name(qualified_name: str, rule: GhostRule) -> None:
    """``LayerRegistry.register_by_name`` on the default registry.

    Args:
      qualified_name: "module.QualName" of the defining module.
      rule: the GhostRule for that class.
    """
    _DEFAULT.register_by_name(qualified_name, rule)


def register_ghost_rule_by_public_name(public_name: str, rule: GhostRule) -> None:
    """``LayerRegistry.register_by_public_name`` on the default registry.

    Args:
      public_name: "module.Attribute", the module the package documents the class under.
      rule: the GhostRule for that class.
    """
    _DEFAULT.register_by_public_name(public_name, rule)


_OP_LEVEL: list = []  # the op-level rule (op_rules.py), for layers no registered rule models


def register_op_level_rule(rule: GhostRule) -> None:
    """Sets the rule used for layers without a registered rule (op_rules.OpLevelRule)."""
    _OP_LEVEL[:] = [rule]


def ghost_rule_for(layer, layer_registry: Optional[LayerRegistry] = None) -> Optional[GhostRule]:
    """The most specific registered rule that applies to ``layer``, else None.

    A rule registered for a class C is used for a subclass only if the subclass inherits
    C's ``call`` unchanged: a subclass with its own ``call`` computes something else (a
    Dense subclass adding a term, keras-hub's ReversibleEmbedding), so it goes to the
    op-level rule (``resolve_rule``) unless a rule is registered for the subclass itself.

    Args:
      layer: a Keras layer.
      layer_registry: the ``LayerRegistry`` to look in (default: the default one).

    Returns:
      The ``GhostRule``, or None.
    """
    return as_layer_registry(layer_registry).rule_for(layer)


def resolve_rule(layer, layer_registry: Optional[LayerRegistry] = None) -> Optional[GhostRule]:
    """The rule the taps use for ``layer``: its registered rule (``ghost_rule_for``); else
    the op-level rule (op_rules.py: ghost norms from the linear ops the layer's variables
    enter, found in the graph of each call — or, for a call it cannot take, the per-example
    replay), if it applies; else None (the per-example replay).

    Args:
      layer: a Keras layer.
      layer_registry: the ``LayerRegistry`` to look in (default: the default one).

    Returns:
      The ``GhostRule``, or None.
    """
    return as_layer_registry(layer_registry).resolve(layer)


def _is_tensor(value) -> bool:
    return isinstance(value, (tf.Tensor, tf.Variable)) or tf.is_tensor(value)
