"""Per-example clipped gradient sums: per-example norms → clip factors → Σ_i c_i g_i.

``engine="ghost"`` (default): one forward and one backward pass of the batch with every
trainable layer tapped. Layers with a ghost rule (Dense, Embedding, user-registered) give
their per-example squared norms and clipped sums from (inputs, output gradients) without
materialising per-example gradients; other layers are replayed per example by
``vectorized_map``. The squared norms of all layers add up to the flat norm ‖g_i‖² over
all trainable variables, which sets one clip factor per example. Each rule's squared norm
is an upper bound U_i² that holds under floating-point rounding (rounding.py); they add up
in float64 and the factor is rounded toward zero to float32, so ‖c_i ĝ_i‖ ≤ C up to the
relative rounding of the float32 sums (a few 2⁻²⁴).

Which tensors carry the example axis is read off the traced graph (a tensor does iff it is
computed from the batch inputs x; example_axis.py), so eager calls run as a graph. A layer
applied to batch-free tensors (a position range, a table of class features) gets exact
per-example gradients from its broadcast uses, or through the whole model (tap.py).

``engine="vectorized"``: per-example gradients of the whole model by ``vectorized_map``;
slow, used as the reference.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from tf_dp.clipping.clip import weighted_row_sum
from tf_dp.clipping.layer_per_example import MaterializedContribution, squared_row_norms
from tf_dp.clipping.per_example import per_example_gradients, total_embedding_lookups
from tf_dp.clipping.policy import ClippingPolicy, FlatClip, resolve_clipping
from tf_dp.clipping.rounding import FLOAT32_MAX, round_down_to_float32
from tf_dp.clipping.registry import LayerRegistry, as_layer_registry, unit_variables
from tf_dp.clipping.tap import LayerTap

ENGINES = ("ghost", "vectorized")
FLAT = FlatClip()


@dataclass
class ClippedBatch:
    """What the clipping engine returns for one physical batch.

    Attributes:
      clipped_sums: Σ_i c_i g_i, one tensor per trainable variable.
      y_pred: the model's outputs on the batch.
      losses: the per-example losses ℓ_i (masked rows included; weight them by the mask).
      squared_norms: U_i² ≥ ‖g_i‖², the certified squared norms clipped against.
    """

    clipped_sums: list  # Σ_i c_i g_i per trainable variable
    y_pred: object
    losses: tf.Tensor  # per-example losses ℓ_i (masked rows included, weight them by mask)
    squared_norms: tf.Tensor  # U_i² ≥ ‖g_i‖², the certified squared norm clipped against (float32, saturated)

    def nonfinite_count(self, mask) -> tf.Tensor:
        """Real (unmasked) examples whose gradient was NaN/Inf and so contributed zero."""
        bad = tf.logical_not(tf.math.is_finite(self.squared_norms))
        return tf.reduce_sum(tf.cast(bad, tf.float32) * tf.cast(mask, tf.float32))


@dataclass(frozen=True)
class EvaluationPoint:
    """One term of the per-example observation u_i = Σ_k coefficient_k · ∇ℓ(θ_k; x_i).

    ``weights`` are values for ``model.trainable_variables`` (None: the current θ). DP-SGD
    uses the single point (1, θ); DiSK/FIBER use (c, θ + γd) and (1 − c, θ).

    Attributes:
      coefficient: the term's coefficient_k.
      weights: values for ``model.trainable_variables`` (None: the current θ).
      view: the augmentation view index on the inputs' axis 1 (docs/algorithms.md §8), or None.
      targets_view: whether the targets carry the views on axis 1 too (user-level DP, §11).
    """

    coefficient: float
    weights: Optional[Sequence[tf.Tensor]] = None
    view: Optional[int] = None  # augmentation multiplicity (§8): index on the inputs' view axis (axis 1)
    targets_view: bool = False  # user-level DP (§11): the targets carry the views on axis 1 too


CURRENT_WEIGHTS = (EvaluationPoint(1.0),)


@dataclass(frozen=True)
class AugmentationViews:
    """Augmentation multiplicity (docs/algorithms.md §8): u_i = (1/K) Σ_k ∇ℓ(θ; x_i^(k)), clipped once.

    Each view is an evaluation point at the same weights with coefficient 1/K, so the ghost
    engine's per-layer recordings of the K passes are concatenated and the cross terms
    between views enter the per-example norm exactly. ``view_axis``: the inputs carry the K
    views on axis 1 (made by the data loader); else the K passes see the same inputs and
    the views come from the model's own random layers (e.g. RandomFlip in training mode).
    The train step passes its plan's views to ``clipped_gradient_sum``; default: one view.
    ``targets_per_view``: y (and its sample weights) carry the views on axis 1 as well —
    user-level DP (docs/algorithms.md §11), where view j is the user's j-th example with its
    own label: u = (1/m) Σ_j ∇ℓ(θ; x_{u,j}, y_{u,j})."""

    count: int = 1
    view_axis: bool = False
    targets_per_view: bool = False


ONE_VIEW = AugmentationViews()


def with_views(points: Sequence[EvaluationPoint], views: AugmentationViews) -> Sequence[EvaluationPoint]:
    """Each point repeated once per view with its coefficient divided by K (unchanged for K = 1)."""
    if views.count == 1 and not views.view_axis:
        return points
    return tuple(EvaluationPoint(p.coefficient / views.count, p.weights, k if views.view_axis else None,
                                 views.targets_per_view)
                 for p in points for k in range(views.count))


def view_of(x, view: Optional[int]):
    """The inputs of one view: x[:, view] on every leaf (x itself when ``view`` is None)."""
    return x if view is None else tf.nest.map_structure(lambda t: t[:, view], x)


def targets_of(y, point: EvaluationPoint):
    """The targets of ``point``'s view: y[:, view] when the targets carry views (§11), else y."""
    return view_of(y, point.view) if point.targets_view else y


def forward(model, x, weights: Optional[Sequence[tf.Tensor]] = None):
    """model(x, training=True), at ``weights`` instead of the variables' values if given.

    Args:
      model: a Keras model.
      x: its inputs.
      weights: values for ``model.trainable_variables``, in order, or None for their current values.

    Returns:
      The model's outputs.
    """
    if weights is None:
        return model(x, training=True)
    with keras.StatelessScope(state_mapping=list(zip(model.trainable_variables, weights))):
        return model(x, training=True)


def _trainable_units(model) -> list:
    """Layers (the model included) owning trainable variables of the model. A recurrent
    layer is one unit with its cell: the cell runs inside the layer's while loop, where
    its recorded inputs cannot be reached from outside, so the RNN layer is tapped instead."""
    trainable = {id(v) for v in model.trainable_variables}

    layers = list(model._flatten_layers(include_self=True))
    recurrent = [layer for layer in layers if isinstance(layer, keras.layers.RNN)]
    inside = {id(sub) for rnn in recurrent for sub in rnn.cell._flatten_layers(include_self=True)}
    return [layer for layer in layers
            if id(layer) not in inside and any(id(v) in trainable for v in unit_variables(layer))]


def _observation_losses(model, per_example_loss, x, y, points):
    """Σ_k coefficient_k · ℓ(θ_k; x_i) per example, and the predictions and losses at θ_t
    (the first point without weights — view 0 with views —, else the first) for metrics."""
    total, reported, at_current = 0.0, None, False
    for point in points:
        y_pred = forward(model, view_of(x, point.view), point.weights)
        losses = per_example_loss(targets_of(y, point), y_pred)
        total = total + point.coefficient * losses
        if reported is None or (point.weights is None and not at_current):
            reported, at_current = (y_pred, losses), point.weights is None
    return total, reported


def traced(function):
    """``function(model, loss, x, y, mask, clip, points, **options)`` run as a graph when
    called eagerly: the taps decide which tensors carry the example axis from the traced
    graph (example_axis.py), which eager tensors lack. One tf.function per model, loss and
    static part of the points and trainable-variable set (a layer frozen or unfrozen since the
    last call gets a graph of its own); tensors (the points' weights included) are its arguments."""
    def run(model, per_example_loss, x, y, mask, l2_norm_clip, points, **options):
        if not tf.executing_eagerly():
            return function(model, per_example_loss, x, y, mask, l2_norm_clip, points, **options)
        layout = tuple((p.coefficient, p.weights is None, p.view, p.targets_view) for p in points)
        trainable = tuple(id(v) for v in model.trainable_variables)  # alive as long as the model is
        key = (per_example_loss, layout, tuple(sorted(options.items())), trainable)
        graphs = model.__dict__.get("_tf_dp_traced_steps")
        if graphs is None:  # untracked by Keras (not a layer attribute), collected with the model
            graphs = {}
            object.__setattr__(model, "_tf_dp_traced_steps", graphs)
        if key not in graphs:
            def graph(x, y, mask, l2_norm_clip, weights):
                at = [EvaluationPoint(p.coefficient, w, p.view, p.targets_view) for p, w in zip(points, weights)]
                result = function(model, per_example_loss, x, y, mask, l2_norm_clip, at, **options)
                return result.clipped_sums, result.y_pred, result.losses, result.squared_norms
            graphs[key] = tf.function(graph, reduce_retracing=True)  # autograph, as fit compiles
        return ClippedBatch(*graphs[key](x, y, mask, l2_norm_clip, [p.weights for p in points]))
    return run


def examples_of(tensor):
    """The leading size of ``tensor``: a Python int where static, else a scalar tensor."""
    static = tensor.shape[0] if tensor.shape.rank else None
    return static if static is not None else tf.shape(tensor)[0]


def as_graph_inputs(x):
    """x with numpy leaves as tensors, so that the model reads them from one tensor the taps know."""
    return tf.nest.map_structure(lambda v: tf.convert_to_tensor(v) if isinstance(v, (np.ndarray, np.generic)) else v, x)


@traced
def _ghost(model, per_example_loss, x, y, mask, l2_norm_clip, points, use_ghost_rules=True,
           clipping: ClippingPolicy = FLAT, layer_registry: Optional[LayerRegistry] = None) -> ClippedBatch:
    # Every point's forward pass records into the same taps; a layer's recordings are
    # concatenated along its sequence axis, so the cross terms between points (and
    # between repeated calls of a shared layer) enter the per-example norm exactly.
    x = as_graph_inputs(x)
    units = _trainable_units(model)
    group_of = _group_of_layer(clipping, units)
    tap = LayerTap(units, use_ghost_rules=use_ghost_rules, batch_size=examples_of(mask), batch_inputs=x,
                   layer_registry=layer_registry)
    with tap:
        with tf.GradientTape() as tape:
            for point in points:  # weight tensors, unlike variables, are not watched by default
                if point.weights is not None:
                    tape.watch(point.weights)
            observation, (y_pred, losses) = _observation_losses(model, per_example_loss, x, y, points)
            total = tf.reduce_sum(tf.cast(observation, tf.float32) * tf.cast(mask, tf.float32))
        # Variables also used outside their layer's call, batch-free outputs not only broadcast:
        shared = tap.whole_model_layers()
        output_grads = tape.gradient(total, tap.watched_tensors(skip=shared))
    contributions = tap.contributions(output_grads, skip=shared)
    contributions += _shared_contributions(model, per_example_loss, x, y, points, shared, tap.fallback)
    if use_ghost_rules:
        warn_slow_layers(model, [(layer, rule) for layer, rule, _ in contributions], tap.fallback, shared,
                         examples_of(mask))
    norms = [(group_of[id(layer)], tf.cast(c.squared_norms(), tf.float64)) for layer, _, c in contributions]
    squared_norms, group_norms = _flat_and_group_norms(norms, _group_count(group_of), tf.zeros_like(losses, tf.float64))
    factors = _float32_factors(clipping, group_norms, l2_norm_clip, mask)
    by_variable = {}
    for layer, rule, contribution in contributions:
        for variable, grad in zip(rule.variables(layer), contribution.weighted_sums(factors[group_of[id(layer)]])):
            by_variable[id(variable)] = grad
    sums = [tf.cast(by_variable[id(v)], v.dtype) if id(v) in by_variable else tf.zeros_like(v)
            for v in model.trainable_variables]
    return ClippedBatch(sums, y_pred, losses, _as_float32(squared_norms))


def _group_of_layer(clipping: ClippingPolicy, units: list) -> dict:
    """{id(layer): group index} from ``clipping.groups(units)``, checked (docs/algorithms.md §13)."""
    groups = list(clipping.groups(units))
    if len(groups) != len(units) or not all(isinstance(g, (int, np.integer)) and g >= 0 for g in groups):
        raise ValueError(f"{type(clipping).__name__}.groups must return one group index >= 0 per layer "
                         f"({len(units)} layers), got {groups!r}.")
    return {id(layer): int(group) for layer, group in zip(units, groups)}


def _group_count(group_of: dict) -> int:
    return max(group_of.values(), default=0) + 1


def _flat_and_group_norms(norms: list, groups: int, zeros: tf.Tensor):
    """From (group, U²) pairs in float64: the flat squared norm Σ U² (summed in the given
    order, as the flat clip always did) and each group's sum (zeros for an empty group)."""
    flat = tf.add_n([squared for _, squared in norms]) if norms else zeros
    if groups == 1:
        return flat, [flat]
    per_group = [[squared for group, squared in norms if group == k] for k in range(groups)]
    return flat, [tf.add_n(terms) if terms else zeros for terms in per_group]


def _shared_contributions(model, per_example_loss, x, y, points, shared_layers, fallback) -> list:
    """(layer, rule, contribution) for layers whose variables another layer's call also
    reads (a weight shared by hand), and for layers whose batch-free outputs are used other
    than by a broadcast against the batch (LayerTap.whole_model_layers): u_i restricted to
    their variables, Σ_k a_k ∂ℓ(θ_k; x_i)/∂v,
    explicitly per example through the whole model — every use of v summed, so the norm
    includes the cross terms between uses exactly. Costs a per-example pass of the model."""
    if not shared_layers:
        return []
    owned = [fallback.variables(layer) for layer in shared_layers]
    variables = [v for group in owned for v in group]
    total = None
    for point in points:  # one per-example pass for all shared layers
        grads = per_example_gradients(model, per_example_loss, view_of(x, point.view), targets_of(y, point),
                                      weights=point.weights,
                                      only=variables)
        grads = [point.coefficient * g for g in grads]
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    result, start = [], 0
    for layer, group in zip(shared_layers, owned):
        result.append((layer, fallback, MaterializedContribution(total[start:start + len(group)])))
        start += len(group)
    return result


class SlowPathWarning(UserWarning):
    """Layers of a model whose per-example gradients take a per-example path (no ghost rule)."""


def warn_slow_layers(model, used_rules: list, fallback, whole_model_layers: list, examples) -> None:
    """Warns once per model, naming each layer whose per-example gradients come from the
    per-example replay of that layer (no ghost rule models its calls) or from per-example
    passes of the whole model (weights shared with another call, batch-free outputs), and
    what it costs: about P (the batch size) times the layer's, or the model's, own
    forward/backward work per step."""
    slow = [layer for layer, rule in used_rules if rule is fallback]
    if not slow or model.__dict__.get("_tf_dp_warned_slow_layers"):
        return
    object.__setattr__(model, "_tf_dp_warned_slow_layers", True)  # untracked by Keras
    whole = {id(layer) for layer in whole_model_layers}
    per_example = f"P={examples}" if isinstance(examples, int) else "P (the batch size)"
    parts = [f"per-example passes of the whole model for layer {layer.name!r} ({type(layer).__name__}): roughly "
             f"{per_example} times the model's forward/backward cost" if id(layer) in whole else
             f"per-example replay of layer {layer.name!r} ({type(layer).__name__}): roughly {per_example} times its "
             "forward/backward cost" for layer in slow]
    warnings.warn(
        "tf_dp: layers without a ghost rule run on the slow per-example path in each DP step: " + "; ".join(parts)
        + ". Register a GhostRule for them (tf_dp.clipping.register_ghost_rule) or use layers that have one "
        "(Dense, Embedding, Conv, LSTM/GRU/SimpleRNN without dropout, ...).", SlowPathWarning, stacklevel=3)


def _float32_factors(clipping: ClippingPolicy, group_norms: list, l2_norm_clip, mask) -> list:
    """Each group's clip factors from its float64 (certified) squared norms by the policy,
    rounded toward zero to float32 so that the cast never enlarges a factor."""
    factors = list(clipping.factors(group_norms, l2_norm_clip, mask))
    if len(factors) != len(group_norms):
        raise ValueError(f"{type(clipping).__name__}.factors must return one factor tensor per group "
                         f"({len(group_norms)}), got {len(factors)}.")
    return [round_down_to_float32(tf.cast(f, tf.float64)) for f in factors]


def _as_float32(squared_norms: tf.Tensor) -> tf.Tensor:
    """float64 squared norms for ClippedBatch, saturated at float32's maximum so that a huge
    but finite norm (whose example was clipped, not dropped) stays finite; NaN stays NaN."""
    return tf.cast(tf.minimum(squared_norms, FLOAT32_MAX), tf.float32)


def _vectorized(model, per_example_loss, x, y, mask, l2_norm_clip, points, clipping: ClippingPolicy = FLAT
                ) -> ClippedBatch:
    grads = None
    for point in points:
        at_point = per_example_gradients(model, per_example_loss, view_of(x, point.view), targets_of(y, point),
                                         weights=point.weights)
        at_point = [point.coefficient * g for g in at_point]
        grads = at_point if grads is None else [a + b for a, b in zip(grads, at_point)]
    group_of_variable = _group_of_variable(clipping, model)
    norms = [(group_of_variable[id(v)], squared_row_norms(g)) for v, g in zip(model.trainable_variables, grads)]
    squared_norms, group_norms = _flat_and_group_norms(norms, _group_count(group_of_variable),
                                                       tf.zeros_like(norms[0][1]))
    factors = _float32_factors(clipping, group_norms, l2_norm_clip, mask)
    sums = [weighted_row_sum(factors[group_of_variable[id(v)]], g) for v, g in zip(model.trainable_variables, grads)]
    with total_embedding_lookups(model):  # the lookups of the map: ids out of range give zeros
        _, (y_pred, losses) = _observation_losses(model, per_example_loss, x, y, points)
    return ClippedBatch(sums, y_pred, losses, _as_float32(squared_norms))


def _group_of_variable(clipping: ClippingPolicy, model) -> dict:
    """{id(variable): group} for every trainable variable: the group of the layer owning it."""
    units = _trainable_units(model)
    group_of = _group_of_layer(clipping, units)
    owner = {id(v): group_of[id(unit)] for unit in units for v in unit_variables(unit)}
    if _group_count(group_of) == 1:
        return {id(v): 0 for v in model.trainable_variables}
    orphans = [v.path for v in model.trainable_variables if id(v) not in owner]
    if orphans:
        raise ValueError(f"{type(clipping).__name__}: trainable variables {orphans} belong to no layer.")
    return owner


def clipped_gradient_sum(
    model,
    per_example_loss: Callable,
    x,
    y,
    mask,
    l2_norm_clip,
    engine: str = "ghost",
    points: Sequence[EvaluationPoint] = CURRENT_WEIGHTS,
    clipping: Optional[ClippingPolicy] = FLAT,
    views: AugmentationViews = ONE_VIEW,
    layer_registry: Optional[LayerRegistry] = None,
) -> ClippedBatch:
    """Σ_i mask_i · c_i · u_i over the batch, with the per-example observation
    u_i = Σ_k a_k ∇ℓ(θ_k; x_i) (u_i = g_i for DP-SGD) flat over ``model.trainable_variables``;
    with augmentation multiplicity K each term is averaged over the K views of x_i.

    Args:
      model: a Keras model.
      per_example_loss: ``fn(y, y_pred)`` returning the [P] per-example losses.
      x: the physical batch's inputs.
      y: its targets.
      mask: the [P] 0/1 padding mask.
      l2_norm_clip: C, the clipping norm.
      engine: "ghost" (ghost norms) or "vectorized" (per-example gradients).
      points: the ``EvaluationPoint`` terms of u_i (default: the current weights, coefficient 1).
      clipping: the ClippingPolicy (docs/algorithms.md §13; a registered name or None =
        FlatClip: c_i = min(1, C/‖u_i‖)). Group k of its layers gets the factors c_i^k the
        policy computes from the group's squared norms; ``squared_norms`` of the result stay
        the flat ‖u_i‖² (upper bounds) whatever the policy.
      views: the views of each unit on x (and y), averaged before clipping
        (docs/algorithms.md §8, §11); the train step passes its plan's.
      layer_registry: the ``LayerRegistry`` whose ghost rules the layers take (None: the
        default one; ``engine="vectorized"`` uses none).

    Returns:
      A ClippedBatch: Σ_i c_i^k u_i^k per trainable variable, predictions, per-example
      losses and flat squared norms.
    """
    clipping = resolve_clipping(clipping)
    points = with_views(points, views)
    x, y, mask = tf.nest.map_structure(tf.convert_to_tensor, (x, y, mask))  # numpy arrays (labels) too
    if engine == "ghost":
        return _ghost(model, per_example_loss, x, y, mask, l2_norm_clip, points, clipping=clipping,
                      layer_registry=as_layer_registry(layer_registry))
    if engine == "vectorized":
        return _vectorized(model, per_example_loss, x, y, mask, l2_norm_clip, points, clipping=clipping)
    raise ValueError(f"`engine` must be one of {ENGINES}, got {engine!r}.")
