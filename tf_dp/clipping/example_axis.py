"""Which tensors carry the example axis (docs/algorithms.md §6): decided from how they were
computed, never from a shape.

A layer's argument carries the example axis when its value depends on the model's batch
inputs x (the traced graph says so: walk back through the ops that computed it). Ops that
read only the shape of a tensor (Shape, Size, Rank) do not pass the dependence on: keras.io's
``positions = range(shape(x)[-1])`` is the same for every example. A tensor whose value does
not depend on x (a position range, a constant table of class features, a variable) is
batch-free, whatever its leading size: taking a [T] range for T examples is the error this
module exists to prevent.

A layer applied to batch-free tensors computes one output z shared by every example, so the
gradient of Σ_i ℓ_i with respect to z is a sum over examples, not a per-example gradient.
Where z is used only by broadcasting element-wise ops against a batched operand b
(``x + positions``, ``x * gate``) the per-example output gradient is exact and cheap:
out_i = op(b_i, z) involves z only in example i's row, so ∂ℓ_i/∂z is the vector-Jacobian
product of op(b, broadcast(z)) with the rows of ∂Σℓ/∂out (``per_example_cotangent``).
Any other use (``h @ zᵀ`` of a prototype head) is left to the exact whole-model route.
"""

from __future__ import annotations

import enum

import tensorflow as tf

SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})
BROADCAST_OPS = {"AddV2": tf.raw_ops.AddV2, "Add": tf.raw_ops.Add, "Sub": tf.raw_ops.Sub, "Mul": tf.raw_ops.Mul}
TRANSPARENT_OPS = frozenset({"Identity"})


class Dependence(enum.IntEnum):
    """How a tensor's value relates to the batch inputs (ordered: a combination takes the max)."""

    INDEPENDENT = 0  # computed from constants, variables, shapes: the same for every example
    UNKNOWN = 1  # reaches a graph input that is not a batch input (a loop variable, a function argument)
    DEPENDS = 2  # computed from the batch inputs


class BatchDependence:
    """Classifies graph tensors by their dependence on ``batch_inputs`` (memoized per op)."""

    def __init__(self, batch_inputs):
        flat = tf.nest.flatten(batch_inputs, expand_composites=True)
        self._sources = {t.ref() for t in flat if tf.is_tensor(t) and hasattr(t, "graph")}
        self._memo: dict = {}

    def of(self, tensor) -> Dependence:
        """The dependence of one tensor (eager tensors have no history: UNKNOWN)."""
        if not hasattr(tensor, "op") or not hasattr(tensor, "graph"):
            return Dependence.UNKNOWN
        if tensor.ref() in self._sources:
            return Dependence.DEPENDS
        return self._op_dependence(tensor.op)

    def _parents(self, op):
        """The tensors an op's outputs are computed from, or a Dependence for a graph input."""
        if op.type in SHAPE_OPS:
            return Dependence.INDEPENDENT
        if op.type == "Placeholder":
            external = _captured_external(op.outputs[0])
            if external is None:
                return Dependence.UNKNOWN
            if not hasattr(external, "op"):  # an eager value captured into the graph (a variable's handle)
                return Dependence.INDEPENDENT
            return [external]
        return list(op.inputs)

    def _op_dependence(self, root) -> Dependence:
        """Iterative post-order walk (graphs are deeper than Python's recursion limit)."""
        stack, visiting = [root], set()
        while stack:
            op = stack[-1]
            if op in self._memo:
                stack.pop()
                continue
            parents = self._parents(op)
            if isinstance(parents, Dependence):
                self._memo[op] = parents
                stack.pop()
                continue
            pending = [t.op for t in parents if t.ref() not in self._sources and t.op not in self._memo]
            if pending and op not in visiting:
                visiting.add(op)
                stack.extend(pending)
                continue
            self._memo[op] = max((self._tensor_dependence(t) for t in parents), default=Dependence.INDEPENDENT)
            stack.pop()
        return self._memo[root]

    def _tensor_dependence(self, tensor) -> Dependence:
        if tensor.ref() in self._sources:
            return Dependence.DEPENDS
        return self._memo.get(tensor.op, Dependence.UNKNOWN)  # unresolved only on a cycle


def _captured_external(placeholder):
    """The outer tensor a function graph's placeholder captures, or None (a plain argument)."""
    for external, internal in getattr(placeholder.graph, "captures", ()):
        if internal.name == placeholder.name:
            return external
    return None


class BroadcastUse:
    """One use of a batch-free tensor z: ``out = op(b, z)`` (or op(z, b)) broadcasting z against
    the batched operand b along the example axis."""

    def __init__(self, tensor, op, position: int):
        self.tensor, self.op, self.position = tensor, op, position

    @property
    def output(self):
        return self.op.outputs[0]

    def per_example_cotangent(self, output_grad, examples) -> tf.Tensor:
        """[P, *z.shape]: row i is ∂ℓ_i/∂z, the VJP of op(b, broadcast(z)) with ∂Σℓ/∂out's rows."""
        z, out = self.tensor, self.output
        expanded = tf.reshape(z, tf.concat([tf.ones([out.shape.rank - z.shape.rank], tf.int32),
                                            tf.shape(z)], axis=0))
        tiled = tf.broadcast_to(expanded, tf.concat([[examples], tf.shape(expanded)[1:]], axis=0))
        other = self.op.inputs[1 - self.position]
        with tf.GradientTape() as tape:
            tape.watch(tiled)
            operands = (other, tiled) if self.position == 1 else (tiled, other)
            recomputed = BROADCAST_OPS[self.op.type](x=operands[0], y=operands[1])
        grad = tape.gradient(recomputed, tiled, output_gradients=output_grad)
        return tf.reshape(grad, tf.concat([[examples], tf.shape(z)], axis=0))


def broadcast_uses(tensor, dependence: BatchDependence):
    """Every use of the batch-free ``tensor`` as a ``BroadcastUse``, or None if any use is not one
    (including uses through Identity ops). Call after the forward pass, before any gradient:
    the uses are read off the graph's consumers."""
    uses, pending = [], [tensor]
    while pending:
        current = pending.pop()
        for op in current.consumers():
            if op.type in TRANSPARENT_OPS:
                pending.append(op.outputs[0])
                continue
            use = _broadcast_use(current, op, dependence)
            if use is None:
                return None
            uses.append(use)
    return uses


def _broadcast_use(tensor, op, dependence: BatchDependence):
    """A BroadcastUse if ``op`` is an element-wise op broadcasting ``tensor`` along the example axis
    of a batched operand of the output's rank, else None."""
    if op.type not in BROADCAST_OPS or len(op.inputs) != 2:
        return None
    positions = [i for i, t in enumerate(op.inputs) if t is tensor]
    if len(positions) != 1:
        return None
    other, out = op.inputs[1 - positions[0]], op.outputs[0]
    if tensor.shape.rank is None or other.shape.rank is None or other.shape.rank != out.shape.rank:
        return None
    along_examples = tensor.shape.rank < out.shape.rank or tensor.shape[0] == 1
    if not along_examples or dependence.of(other) != Dependence.DEPENDS:
        return None
    return BroadcastUse(tensor, op, positions[0])
