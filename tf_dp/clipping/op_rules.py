"""Op-level ghost rules: custom layers whose variables enter only known linear ops.

A layer that no registered rule models (a custom layer, a Keras layer without a rule such as
SeparableConv2D, a subclass with its own ``call``) is analysed in the graph its call builds
during the engine's traced forward pass: every read of each of its trainable variables v must
reach, through ops of v alone that keep its values (Identity, Cast, Reshape, Squeeze), an
op u of a known per-example form in which v is the weight operand and the other operand is a
per-example activation a (axis 0 = the examples, row i computed from example i):

    MatMul / BatchMatMul   z = a M            ∂ℓ_i/∂M = A_iᵀ S_i   (Dense rule, dense.py)
    Einsum                 z = einsum(a, M)   Dense form or explicit (einsum_dense.py)
    Conv2D (NHWC)          z = a ⋆ M          Dense on unfolded patches (conv.py)
    DepthwiseConv2dNative  z = a ⋆_dw M       explicit filter gradients (depthwise_conv.py)
    BiasAdd, Add, Sub      z = a ± b          ∂ℓ_i/∂b = s_i summed over the broadcast axes
    Mul                    z = a ⊙ g          ∂ℓ_i/∂g = (a_i ⊙ s_i) summed over the broadcast axes

with S = ∂(Σ_j ℓ_j)/∂z read off the same backward pass (z is watched). The per-example
gradient of v is the sum over its uses u of the use's gradient (chain rule, v entering only
through these ops): uses of one form with the same orientation are one Dense contribution on
their activations concatenated along T — every cross term ⟨G_u,i, G_u',i⟩ inside its Gram or
explicit form (docs/algorithms.md §6.3); any other mix is summed explicitly per example
([P, *v.shape]) before its norm is taken. Different variables' squared norms add up.

Per-example activations: a tensor is example-major when it is a batched argument of the call
or computed from example-major tensors (and tensors that do not depend on the batch) by ops
that keep axis 0 as the example axis and rows separate: element-wise ops without broadcasting
a new leading axis, reductions/concat/stack/expand-dims/squeeze away from axis 0, transposes
fixing axis 0, reshapes keeping the static product of the other axes, softmax over a last
axis ≥ 1, matmul/einsum/conv with a batch-free operand. Anything else — a variable under a
non-linearity (``matmul(x, tanh(W))``, ``W ** 2``), a read by a nested function, an activation
of unproven layout — sends the layer to the per-example replay (layer_per_example.py), with a
warning once per layer naming the reason. When another call of the layer is replayed (a
batch-free call), the replay of a call this rule recorded differentiates the layer's outputs
only (the recorded op outputs enter it under stop_gradient: their gradients already include
the paths through the later ops, so they would count those paths twice).
"""

from __future__ import annotations

import math
import types
import warnings
from typing import Optional

import keras
import tensorflow as tf

from tf_dp.clipping import dense
from tf_dp.clipping.conv import _patches
from tf_dp.clipping.einsum_dense import dense_form, per_example_equation
from tf_dp.clipping.layer_per_example import MaterializedContribution, independent_outputs
from tf_dp.clipping.registry import Contribution, GhostRule, Recording, register_op_level_rule, unit_variables

VALUE_KEEPING = frozenset({"Identity", "Cast", "Reshape", "Squeeze"})  # v → operand: same values, same order
ELEMENTWISE = frozenset({
    "Identity", "Cast", "Neg", "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Tanh", "Sigmoid", "Exp", "Expm1", "Log",
    "Log1p", "Sqrt", "Rsqrt", "Square", "Abs", "Sign", "Softplus", "Softsign", "Reciprocal", "Erf", "Erfc", "Floor",
    "Ceil", "Round", "Sin", "Cos", "StopGradient", "ZerosLike", "OnesLike", "IsNan", "IsFinite", "LogicalNot",
    "AddV2", "Add", "Sub", "Mul", "RealDiv", "DivNoNan", "Maximum", "Minimum", "SquaredDifference", "Pow",
    "Select", "SelectV2", "ClipByValue", "Greater", "GreaterEqual", "Less", "LessEqual", "Equal", "NotEqual",
    "LogicalAnd", "LogicalOr", "MulNoNan", "FloorDiv", "FloorMod", "BiasAdd",
})
REDUCTIONS = frozenset({"Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "EuclideanNorm"})
SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})
MAJOR, FREE, OTHER = "example-major", "batch-free", "unknown layout"


class OpLevelRule(GhostRule):
    """Ghost norms from the linear ops a layer's variables enter (module docstring)."""

    def applies_to(self, layer) -> bool:
        return not isinstance(layer, keras.layers.RNN) and bool(self.variables(layer))

    def variables(self, layer):
        return unit_variables(layer)

    def accepts_call(self, layer, args, kwargs) -> bool:
        return bool(args) and tf.is_tensor(args[0]) and not tf.executing_eagerly()

    def tapped_call(self, layer, original_call, recordings, *args, **kwargs):
        outputs, uses, reason = _traced_call(self.variables(layer), original_call, args, kwargs)
        if uses is None:
            return _replay_instead(layer, original_call, recordings, outputs, reason, args, kwargs)
        outputs, indices = independent_outputs(outputs)
        flat = tf.nest.flatten(outputs)
        watched = [use.output for use in uses] + [flat[i] for i in indices]  # op outputs, then the layer's
        recording = Recording([use.activation for use in uses], watched, extras=uses)
        recording.replay = self._replay(layer, original_call, len(uses), indices)
        recordings.append(recording)
        return outputs

    def _replay(self, layer, original_call, count: int, indices: list):
        """The recording's replay for the per-example fallback (when another call of the layer
        is replayed): the watched op outputs under stop_gradient and the layer's outputs, so
        that the replay's vector-Jacobian product Σ_k J_kᵀ g_k counts the layer's outputs only
        (each op output's gradient already holds the paths through the later ops)."""
        def replay(*args, **kwargs):
            outputs, uses, reason = _traced_call(self.variables(layer), original_call, args, kwargs)
            if uses is None or len(uses) != count:
                raise ValueError(f"tf_dp: the per-example replay of layer {layer.name!r} does not build the ops its "
                                 f"batch call did ({reason or 'another number of uses'}); use "
                                 "clipping_engine='vectorized'.")
            flat = tf.nest.flatten(outputs)
            return [tf.stop_gradient(use.output) for use in uses] + [flat[i] for i in indices]
        return replay

    def contribution(self, layer, recordings, output_grads):
        variables = self.variables(layer)
        _require_no_later_uses(layer, [use for recording in recordings for use in recording.extras])
        by_variable = {index: [] for index in range(len(variables))}
        for recording, grads in zip(recordings, output_grads):
            for use, grad in zip(recording.extras, grads):
                by_variable[use.variable].append((use, tf.zeros_like(use.output) if grad is None else grad))
        return _LayerContribution([_variable_contribution(variables[k], by_variable[k]) for k in by_variable])


def _require_no_later_uses(layer, uses: list) -> None:
    """Refuses (ValueError) a variable value of the layer's calls that an op outside every
    call and outside the backward pass consumes (a value kept by the layer and used later by
    another layer): that use would be missing from the per-example gradient."""
    calls = set().union(*(use.call_ops for use in uses))
    for use in uses:
        for tensor in use.chain:
            for consumer in tensor.consumers():
                if consumer.name not in calls and not _is_backward(consumer):
                    raise ValueError(
                        f"tf_dp: a value of a variable of layer {layer.name!r} read in its call is used after the call "
                        f"by {consumer.type} op {consumer.name!r}: its per-example gradient would miss that use. Read "
                        "the variable where it is used, or use clipping_engine='vectorized'.")


def _is_backward(op) -> bool:
    """An op of the backward pass (GradientTape's ops are in name scope gradient_tape)."""
    return "gradient_tape/" in op.name or op.name.startswith("gradients/") or "/gradients/" in op.name


def _traced_call(variables, original_call, args, kwargs):
    """(outputs, uses, reason): the call run in the current graph, and ``find_uses`` on its ops."""
    graph = tf.compat.v1.get_default_graph()
    known = len(graph.get_operations())
    outputs = original_call(*args, **kwargs)
    new_ops = graph.get_operations()[known:]
    arguments = [t for t in tf.nest.flatten((args, kwargs)) if tf.is_tensor(t) and t.shape.rank]
    uses, reason = find_uses(variables, new_ops, arguments, tf.nest.flatten(outputs))
    return outputs, uses, reason


class _Use:
    """One op u in which variable ``variable`` (an index) is the weight operand."""

    def __init__(self, variable: int, op, weight_index: int, activation, chain_shape):
        self.variable, self.op, self.weight_index = variable, op, weight_index
        self.activation, self.output = activation, op.outputs[0]
        self.operand_shape = chain_shape  # static shape of the operand as the op reads it


def find_uses(variables: list, new_ops: list, arguments: list, outputs: list = ()):
    """(uses, None) when every read of every variable among ``new_ops`` reaches a known op
    as its weight operand with an example-major activation (and no value of a variable is
    an output of the call, which later ops could use unseen), else (None, reason)."""
    values = _variable_values(variables, new_ops)
    if isinstance(values, str):
        return None, values
    layout = _layouts(new_ops, arguments, {t.ref() for tensors in values.values() for t in tensors})
    names = {op.name for op in new_ops}
    uses = []
    for index, tensors in values.items():
        before = len(uses)
        for tensor in tensors:
            found = _uses_of(index, tensor, layout, names,
                             {t.ref() for t in outputs if tf.is_tensor(t)})
            if isinstance(found, str):
                return None, f"variable {variables[index].path!r}: {found}"
            uses += found
        if len(uses) == before:
            return None, f"variable {variables[index].path!r} is read but reaches no op of the call"
    return uses, None


def _variable_values(variables: list, new_ops: list):
    """{variable index: [the tensors its reads give in the call]}, or a reason to refuse."""
    scope = keras.src.backend.get_stateless_scope() if keras.src.backend.in_stateless_scope() else None
    handles, values = {}, {k: [] for k in range(len(variables))}
    for index, variable in enumerate(variables):
        mapped = scope.get_current_value(variable) if scope is not None else None
        if mapped is not None:
            values[index].append(tf.convert_to_tensor(mapped))
            continue
        handle = getattr(getattr(variable, "value", None), "handle", None)
        if handle is None:
            return f"variable {variable.path!r} has no resource handle"
        handles[id(handle)] = index
    for op in new_ops:
        resources = [t for t in op.inputs if t.dtype == tf.resource]
        for resource in resources:
            index = handles.get(id(_outer_source(resource)))
            if index is None:
                continue
            if op.type != "ReadVariableOp":
                return f"variable {variables[index].path!r} is used by a {op.type} op"
            values[index].append(op.outputs[0])
    missing = [variables[k].path for k, tensors in values.items() if not tensors]
    if missing:
        return f"variables {missing} are not read in the call's graph"
    return values


def _outer_source(tensor):
    """The tensor a function graph's placeholder captures, followed out to the eager handle."""
    while getattr(tensor, "op", None) is not None and tensor.op.type == "Placeholder":
        external = next((e for e, i in getattr(tensor.graph, "captures", ()) if i.name == tensor.name), None)
        if external is None:
            return tensor
        tensor = external
    return tensor


def _uses_of(index: int, value, layout: dict, inside: set, outputs: set):
    """The known ops the read ``value`` reaches through value-keeping ops, or a reason."""
    uses, frontier, chain = [], [value], []
    while frontier:
        tensor = frontier.pop()
        chain.append(tensor)
        if tensor.ref() in outputs:
            return "the call returns it"
        for consumer in tensor.consumers():
            if consumer.name not in inside:
                continue
            if consumer.type in VALUE_KEEPING and consumer.inputs[0] is tensor:
                frontier += [consumer.outputs[0]]
                continue
            use = _known_use(index, consumer, tensor, layout)
            if isinstance(use, str):
                return use
            use.chain, use.call_ops = chain, inside
            uses.append(use)
    return uses


def _known_use(index: int, op, weight, layout: dict):
    """A ``_Use`` of ``weight`` by ``op``, or why ``op`` is no known use."""
    positions = [k for k, t in enumerate(op.inputs) if t is weight]
    if len(positions) != 1:
        return f"it reaches a {op.type} op {'twice' if positions else 'indirectly'}"
    position = positions[0]
    others = [t for k, t in enumerate(op.inputs) if k != position]
    kind = _linear_kind(op, position)
    if kind is None:
        return f"it enters a {op.type} op (no per-example rule for it)"
    activation = others[0]
    if layout.get(activation.ref()) != MAJOR:
        return f"the other operand of its {op.type} op has an {layout.get(activation.ref(), OTHER)}"
    if kind == "elementwise" and not (_broadcasts_within_rows(weight, op.outputs[0])
                                      and activation.shape.rank == op.outputs[0].shape.rank):
        return f"its {op.type} op broadcasts it against the example axis"
    return _Use(index, op, position, activation, tuple(weight.shape))


def _linear_kind(op, position: int) -> Optional[str]:
    """The form of ``op`` linear in its input ``position`` (the weight), or None."""
    kind = op.type
    if kind == "MatMul" and position == 1 and not op.get_attr("transpose_a"):
        return "matmul"
    if kind in ("BatchMatMulV2", "BatchMatMulV3") and position == 1 and not op.get_attr("adj_x") \
            and op.inputs[1].shape.rank == 2:
        return "matmul"
    if kind == "Einsum" and len(op.inputs) == 2:
        return "einsum" if _einsum_with_weight_last(op, position) is not None else None
    if kind == "Conv2D" and position == 1 and op.get_attr("data_format") == b"NHWC" \
            and op.get_attr("padding") in (b"SAME", b"VALID") \
            and op.inputs[0].shape[-1] == op.inputs[1].shape[-2]:
        return "conv"
    if kind == "DepthwiseConv2dNative" and position == 1 and op.get_attr("data_format") == b"NHWC" \
            and op.get_attr("padding") in (b"SAME", b"VALID") and list(op.get_attr("dilations")) == [1, 1, 1, 1]:
        strides = list(op.get_attr("strides"))
        return "depthwise" if strides[1] == strides[2] else None
    if kind == "BiasAdd" and position == 1 and op.get_attr("data_format") == b"NHWC":
        return "elementwise"
    if kind in ("AddV2", "Add", "Mul") or (kind == "Sub"):
        return "elementwise"
    return None


def _einsum_with_weight_last(op, position: int) -> Optional[str]:
    """The op's equation with the weight as the second operand, if the activation's first
    axis is the output's first and the weight's equation has no ellipsis; else None."""
    equation = op.get_attr("equation").decode().replace(" ", "")
    inputs, output = equation.split("->")
    operands = inputs.split(",")
    activation, weight = operands[1 - position], operands[position]
    if "." in weight or "..." in activation[1:] or not output or not activation:
        return None
    rewritten = f"{activation},{weight}->{output}"
    return rewritten if per_example_equation(rewritten) is not None else None


def _broadcasts_within_rows(weight, output) -> bool:
    """A weight of rank ≤ the output's whose axis aligned with the example axis (if any) has
    size 1: it is broadcast to every example's row, never indexed by the example."""
    rank, out_rank = weight.shape.rank, output.shape.rank
    if rank is None or out_rank is None or rank > out_rank:
        return False
    return rank < out_rank or weight.shape[0] == 1


def _layouts(new_ops: list, arguments: list, weights: set) -> dict:
    """{tensor ref: MAJOR | FREE | OTHER} for the call's tensors (module docstring)."""
    layout = {t.ref(): MAJOR for t in arguments}
    for op in new_ops:
        inputs = [_layout_of(t, layout, weights) for t in op.inputs]
        result = FREE if all(k == FREE for k in inputs) or op.type in SHAPE_OPS else _major_if_kept(op, inputs)
        for output in op.outputs:
            layout.setdefault(output.ref(), result)
    return layout


def _layout_of(tensor, layout: dict, weights: set) -> str:
    if tensor.ref() in layout:
        return layout[tensor.ref()]
    if tensor.ref() in weights or tensor.dtype == tf.resource or tensor.op.type in ("Const", "ReadVariableOp") \
            or tensor.shape.rank == 0:  # a scalar holds no example rows (one that mixes them fails the row probe)
        return FREE
    return OTHER  # computed outside the call and not passed to it


def _major_if_kept(op, inputs: list) -> str:
    """MAJOR if ``op`` keeps axis 0 of its example-major inputs as the example axis, rows apart."""
    if any(k == OTHER for k in inputs):
        return OTHER
    majors = [t for t, k in zip(op.inputs, inputs) if k == MAJOR]
    out = op.outputs[0] if op.outputs else None
    if out is None or out.shape.rank is None or any(t.shape.rank is None for t in majors):
        return OTHER
    rank, kind = out.shape.rank, op.type
    if kind in ELEMENTWISE:
        frees = [t for t, k in zip(op.inputs, inputs) if k == FREE]
        rows_kept = all(t.shape.rank is not None and (t.shape.rank < rank or t.shape[0] in (None, 1)) for t in frees)
        return MAJOR if rank >= 1 and rows_kept and all(t.shape.rank == rank for t in majors) else OTHER
    if kind in ("Softmax", "LogSoftmax"):
        return MAJOR if rank >= 2 else OTHER
    if kind in REDUCTIONS or kind in ("ArgMax", "ArgMin"):
        axes = _constant(op.inputs[1])
        return MAJOR if axes is not None and 0 not in _normalized(axes, op.inputs[0].shape.rank) \
            and inputs[1] == FREE else OTHER
    if kind == "ConcatV2":
        axis = _constant(op.inputs[-1])
        return MAJOR if axis is not None and 0 not in _normalized(axis, rank) else OTHER
    if kind == "Pack":
        return MAJOR if 0 not in _normalized(op.get_attr("axis"), rank) else OTHER
    if kind == "ExpandDims":
        axis = _constant(op.inputs[1])
        return MAJOR if axis is not None and 0 not in _normalized(axis, rank) and inputs[1] == FREE else OTHER
    if kind == "Squeeze":
        axes = list(op.get_attr("squeeze_dims"))
        return MAJOR if axes and 0 not in _normalized(axes, op.inputs[0].shape.rank) else OTHER
    if kind == "Transpose":
        perm = _constant(op.inputs[1])
        return MAJOR if perm is not None and list(perm)[0] == 0 and inputs[1] == FREE else OTHER
    if kind == "Reshape":
        return MAJOR if inputs[0] == MAJOR and _keeps_rows(op.inputs[0].shape, out.shape) else OTHER
    if kind == "MatMul":
        return MAJOR if inputs == [MAJOR, FREE] and not op.get_attr("transpose_a") else OTHER
    if kind in ("BatchMatMulV2", "BatchMatMulV3"):
        a, b = op.inputs[0].shape.rank, op.inputs[1].shape.rank
        if inputs == [MAJOR, FREE] and a >= 2 and a >= b and not op.get_attr("adj_x"):
            return MAJOR if a > b or b == 2 or op.inputs[1].shape[0] == 1 else OTHER
        return MAJOR if inputs == [MAJOR, MAJOR] and a == b >= 3 else OTHER
    if kind == "Einsum":
        return _einsum_layout(op, inputs)
    if kind in ("Conv2D", "DepthwiseConv2dNative", "MaxPool", "AvgPool", "Conv3D", "MaxPool3D", "AvgPool3D"):
        return MAJOR if inputs[0] == MAJOR and all(k == FREE for k in inputs[1:]) \
            and op.get_attr("data_format") in (b"NHWC", b"NDHWC") else OTHER
    return OTHER


def _einsum_layout(op, inputs: list) -> str:
    equation = op.get_attr("equation").decode().replace(" ", "")
    operands, output = equation.split("->")
    operands = operands.split(",")
    majors = [s for s, k in zip(operands, inputs) if k == MAJOR]
    frees = [s for s, k in zip(operands, inputs) if k == FREE]
    if not output or output.startswith("..."):
        return OTHER
    axis = output[0]
    if all(s and s[0] == axis for s in majors) and all(axis not in s and "..." not in s for s in frees):
        return MAJOR
    return OTHER


def _keeps_rows(before, after) -> bool:
    """A reshape keeps axis 0 when the other axes are static with the same product."""
    if before.rank is None or after.rank is None or before.rank < 1 or after.rank < 1:
        return False
    rest_before, rest_after = before[1:].as_list(), after[1:].as_list()
    if None in rest_before or None in rest_after:
        return False
    return math.prod(rest_before) == math.prod(rest_after) != 0


def _constant(tensor):
    value = tf.get_static_value(tensor)
    if value is None:
        return None
    return [int(v) for v in (value.ravel() if hasattr(value, "ravel") else [value])]


def _normalized(axes, rank: int) -> set:
    axes = axes if isinstance(axes, (list, tuple)) else [axes]
    return {a % rank if rank else a for a in axes}


def _replay_instead(layer, original_call, recordings, outputs, reason: str, args, kwargs):
    """The call as the per-example replay records it (layer_per_example.py), without calling
    the layer again; the tap replays the layer (``replay_instead``). Warns once per layer."""
    outputs, indices = independent_outputs(outputs)
    flat = tf.nest.flatten(outputs)
    recording = Recording((args, kwargs), [flat[i] for i in indices])

    def replay(*call_args, **call_kwargs):
        replayed = tf.nest.flatten(original_call(*call_args, **call_kwargs))
        return [replayed[i] for i in indices]

    recording.replay, recording.replay_instead = replay, reason
    recordings.append(recording)
    if not layer.__dict__.get("_tf_dp_op_rule_warned"):
        object.__setattr__(layer, "_tf_dp_op_rule_warned", True)  # untracked by Keras
        warnings.warn(f"tf_dp: layer {layer.name!r} ({type(layer).__name__}) has no ghost rule and its variables do "
                      f"not enter only ops with a per-example rule ({reason}): it is replayed per example.",
                      OpLevelReplayWarning, stacklevel=4)
    return outputs


class OpLevelReplayWarning(UserWarning):
    """A layer without a ghost rule whose graph the op-level rule cannot take: replayed."""


# --- contributions -----------------------------------------------------------------------------------------------


class _VariablePart:
    """A contribution for one variable and the map of its weighted sum to the variable."""

    def __init__(self, contribution: Contribution, to_variable):
        self.contribution, self.to_variable = contribution, to_variable


class _LayerContribution(Contribution):
    """Squared norms of the layer's variables added up; weighted sums per variable in order."""

    def __init__(self, parts: list):
        self.parts = parts

    def squared_norms(self):
        return tf.add_n([tf.cast(part.contribution.squared_norms(), tf.float64) for part in self.parts])

    def weighted_sums(self, clip_factors):
        return [part.to_variable(part.contribution.weighted_sums(clip_factors)[0]) for part in self.parts]


def _variable_contribution(variable, uses: list) -> _VariablePart:
    """One variable's contribution from all its uses (module docstring)."""
    shape = tuple(variable.shape)
    dense_uses = [(use, grad) for use, grad in uses if _dense_matrix(use) is not None]
    if len(dense_uses) == len(uses) and len({_dense_matrix(use)[2:] for use, _ in uses}) == 1:
        transposed = _dense_matrix(uses[0][0])[2]
        (use, grad), = uses if len(uses) == 1 else [(None, None)]
        if use is not None and use.op.type == "MatMul":  # [P, d] @ [d, k]: the product form ‖a_i‖²‖s_i‖²
            contribution = dense.DenseContribution(use.activation, grad, has_bias=False, flat=True)
        else:
            activations = [_dense_matrix(use)[0](use.activation) for use, _ in uses]
            grads = [_dense_matrix(use)[1](grad) for use, grad in uses]
            contribution = dense.DenseContribution(tf.concat(activations, axis=1), tf.concat(grads, axis=1),
                                                   has_bias=False, flat=False)
        return _VariablePart(contribution, lambda total: _matrix_to_variable(total, transposed, shape))
    per_example = tf.add_n([_explicit(use, grad, shape) for use, grad in uses])
    return _VariablePart(MaterializedContribution([per_example]), lambda total: tf.reshape(total, shape))


def _matrix_to_variable(total, transposed: bool, shape: tuple):
    return tf.reshape(tf.transpose(total) if transposed else total, shape)


def _dense_matrix(use):
    """(activation → [P, T, d], grad → [P, T, k], transposed, d, k) when the use is a Dense
    z = a M on flattened axes with M the weight as a [d, k] matrix (transposed: the weight is
    Mᵀ), else None."""
    op = use.op
    if op.type == "MatMul" or op.type.startswith("BatchMatMul"):
        transposed = op.get_attr("transpose_b") if op.type == "MatMul" else op.get_attr("adj_y")
        rows, cols = use.operand_shape
        d, k = (cols, rows) if transposed else (rows, cols)
        return _sequence(d), _sequence(k), bool(transposed), d, k
    if op.type == "Einsum":
        equation = _einsum_with_weight_last(op, use.weight_index)
        form = dense_form(equation)
        if form is None:
            return None
        contracted = math.prod(use.operand_shape[:form[0]])
        new = math.prod(use.operand_shape[form[0]:])
        return _sequence(contracted), _sequence(new), False, contracted, new
    if op.type == "Conv2D" and tuple(use.operand_shape[:2]) == (1, 1) and _unit_strides(op):
        _, _, d, k = use.operand_shape
        return _sequence(d), _sequence(k), False, d, k
    if op.type == "Conv2D":
        window = _conv_window(op, use.operand_shape)
        return (lambda a: _patches(window, a)), _sequence(use.operand_shape[-1]), False, \
            math.prod(use.operand_shape[:3]), use.operand_shape[-1]
    return None


def _sequence(width):
    return lambda tensor: tf.reshape(tensor, tf.stack([tf.shape(tensor)[0], -1, width]))


def _unit_strides(op) -> bool:
    return list(op.get_attr("strides")) == [1, 1, 1, 1] and list(op.get_attr("dilations")) == [1, 1, 1, 1]


def _conv_window(op, kernel_shape):
    """What conv._patches reads of a layer, from a Conv2D op."""
    strides, dilations = list(op.get_attr("strides")), list(op.get_attr("dilations"))
    return types.SimpleNamespace(rank=2, kernel_size=tuple(kernel_shape[:2]), strides=(strides[1], strides[2]),
                                 dilation_rate=(dilations[1], dilations[2]),
                                 padding=op.get_attr("padding").decode().lower())


def _explicit(use, grad, shape: tuple) -> tf.Tensor:
    """[P, *shape] per-example gradients of the variable through one use, float32."""
    op, a, s = use.op, tf.cast(use.activation, tf.float32), tf.cast(grad, tf.float32)
    matrix = _dense_matrix(use)
    if matrix is not None:
        to_a, to_s, transposed, _, _ = matrix
        per_example = tf.einsum("ptd,ptk->pdk", to_a(a), to_s(s))
        if transposed:
            per_example = tf.transpose(per_example, [0, 2, 1])
        return tf.reshape(per_example, (-1,) + shape)
    if op.type == "Einsum":
        equation = per_example_equation(_einsum_with_weight_last(op, use.weight_index))
        return tf.reshape(tf.einsum(equation, a, s), (-1,) + shape)
    if op.type == "DepthwiseConv2dNative":
        return tf.reshape(_depthwise_filter_grads(op, use.operand_shape, a, s), (-1,) + shape)
    if op.type == "Sub" and use.weight_index == 1:
        s = -s
    if op.type == "Mul":
        s = a * s
    return tf.reshape(_unbroadcast(s, use.operand_shape), (-1,) + shape)


def _unbroadcast(s, operand_shape: tuple) -> tf.Tensor:
    """[P, *operand_shape]: s summed over the axes the operand is broadcast along."""
    rank = s.shape.rank
    leading = list(range(1, rank - len(operand_shape) + (1 if len(operand_shape) == rank else 0)))
    trailing = [rank - len(operand_shape) + j for j, size in enumerate(operand_shape)
                if size == 1 and rank - len(operand_shape) + j > 0]
    summed = tf.reduce_sum(s, axis=sorted(set(leading + trailing)), keepdims=True) if leading or trailing else s
    return tf.reshape(summed, tf.concat([tf.shape(s)[:1], [-1]], axis=0))


def _depthwise_filter_grads(op, kernel_shape, inputs, grads):
    """[P, kh, kw, C, M]: one depthwise filter-gradient call, examples as channels (depthwise_conv.py)."""
    kh, kw, channels, multiplier = kernel_shape
    examples = tf.shape(inputs)[0]
    stride = list(op.get_attr("strides"))[1]

    def as_channels(tensor):
        shape = tf.shape(tensor)
        return tf.reshape(tf.transpose(tensor, [1, 2, 0, 3]), tf.stack([1, shape[1], shape[2], shape[0] * shape[3]]))

    filter_grad = tf.compat.v1.nn.depthwise_conv2d_native_backprop_filter(
        as_channels(inputs), tf.stack([kh, kw, examples * channels, multiplier]), as_channels(grads),
        strides=[1, stride, stride, 1], padding=op.get_attr("padding").decode())
    filter_grad = tf.reshape(filter_grad, tf.stack([kh, kw, examples, channels, multiplier]))
    return tf.transpose(filter_grad, [2, 0, 1, 3, 4])


OP_LEVEL_RULE = OpLevelRule()
register_op_level_rule(OP_LEVEL_RULE)
