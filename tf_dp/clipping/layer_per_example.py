"""Fallback for layers without a ghost rule: per-example gradients of that layer only.

The layer's recorded inputs and output gradients s_i come from the shared batch
forward/backward pass; ``tf.vectorized_map`` then replays just this layer on each example
and takes its vector-Jacobian product with s_i, giving ∂ℓ_i/∂θ_layer explicitly. Cost is
per-example in this layer only, not in the whole model. Valid for layers whose output row
i depends only on input row i (layers that mix examples are refused by the model check).
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import keras
import tensorflow as tf

from tf_dp.clipping import rounding
from tf_dp.clipping.clip import weighted_row_sum
from tf_dp.clipping.kernels import crash_prone_batch_matmuls, require_grouped_conv_kernels
from tf_dp._xla import compiling_with_xla
from tf_dp.clipping.registry import Contribution, GhostRule, Recording, unit_variables


def squared_row_norms(per_example: tf.Tensor) -> tf.Tensor:
    """An upper bound on Σ_j g_ij² per row of a [P, ...] tensor, float64 (rounding.squared_sum)."""
    return rounding.squared_sum(rounding.per_example_rows(per_example))


def independent_outputs(outputs):
    """``outputs`` with each floating-point tensor replaced by an identity copy, and the
    flat indices of those copies.

    The copies are what later layers see, so the gradient of Σ_i ℓ_i with respect to copy k
    counts only the downstream uses of output k: a layer returning two tensors where one is
    computed from the other (T5's (output, position_bias, None), an RNN cell's (h, [h, c]))
    is then differentiated as VJP = Σ_k (∂out_k/∂θ)ᵀ s_k without counting a path twice.
    ``None`` and integer outputs are passed through untapped."""
    flat = tf.nest.flatten(outputs)
    indices = [i for i, v in enumerate(flat) if tf.is_tensor(v) and v.dtype.is_floating]
    for i in indices:
        copy = tf.identity(flat[i])
        mask = getattr(flat[i], "_keras_mask", None)
        if mask is not None:
            copy._keras_mask = mask
        flat[i] = copy
    return tf.nest.pack_sequence_as(outputs, flat), indices


class MaterializedContribution(Contribution):
    """Per-example gradients held explicitly: one [P, *shape] tensor per variable."""

    def __init__(self, per_example_grads: list[tf.Tensor]):
        self.per_example_grads = [tf.cast(g, tf.float32) for g in per_example_grads]

    def squared_norms(self):
        """Σ ĝ_i² bounded above (all terms positive: relative error ≤ γ_{n+1}): the squared
        norm of exactly what is released, c_i ĝ_i."""
        return tf.add_n([squared_row_norms(g) for g in self.per_example_grads])

    def weighted_sums(self, clip_factors):
        return [weighted_row_sum(clip_factors, g) for g in self.per_example_grads]


class LayerPerExampleRule(GhostRule):
    """Records (args, kwargs, outputs); per-example gradients by vectorized replay, or by
    a per-example ``tf.map_fn`` where ``vectorized_map`` cannot convert an op of the layer
    (softmax on rank > 5, BiasAddGrad on a non-trailing axis, control flow of recurrent
    layers)."""

    def __init__(self, tap):
        self._tap = tap

    def variables(self, layer):
        return unit_variables(layer)

    def values(self, layer) -> list:
        """The weight values in effect (possibly a perturbed point under a StatelessScope):
        the replay differentiates the layer at exactly these values."""
        return [tf.convert_to_tensor(v.value) for v in self.variables(layer)]

    def accepts_call(self, layer, args, kwargs) -> bool:
        return True

    def tapped_call(self, layer, original_call, recordings, *args, **kwargs):
        outputs, indices = independent_outputs(original_call(*args, **kwargs))
        flat = tf.nest.flatten(outputs)
        recording = Recording((args, kwargs), [flat[i] for i in indices])

        def replay(*call_args, **call_kwargs):
            replayed = tf.nest.flatten(original_call(*call_args, **call_kwargs))
            return [replayed[i] for i in indices]

        recording.replay = replay
        recordings.append(recording)
        return outputs

    def contribution(self, layer, recordings, output_grads):
        require_grouped_conv_kernels([layer], f"The per-example replay of layer {layer.name!r} (no ghost rule applies)")
        variables = self.variables(layer)
        total = None
        for recording, grads in zip(recordings, output_grads):
            per_example = self._replay(layer, recording, grads, variables)
            total = per_example if total is None else [a + b for a, b in zip(total, per_example)]
        return MaterializedContribution(total)

    def _replay(self, layer, recording: Recording, grads, variables):
        """[P, *shape] per-example gradients of one recorded call: for each example i, the
        vector-Jacobian product of the call on row i with its output gradients s_i.

        The arguments sliced per example are those the tap found to depend on the batch
        inputs (``recording.batched_inputs``); the others are shared by all examples. A
        batch-free call (no batched argument) has per-example output gradients [P, *shape]
        of its shared outputs, applied whole (tap.py)."""
        args, kwargs = recording.call_inputs
        values = recording.values
        batch_free = getattr(recording, "batch_free", False)
        if not batch_free:
            grads = [tf.zeros_like(w) if g is None else g for g, w in zip(grads, recording.watched)]
        flat_inputs = tf.nest.flatten((args, kwargs))
        batched = recording.batched_inputs

        def one_example(elems):
            example_inputs, example_grads = elems
            flat = list(flat_inputs)
            for index, value in zip(batched, example_inputs):
                flat[index] = value[None]
            call_args, call_kwargs = tf.nest.pack_sequence_as((args, kwargs), flat)
            with self._tap.paused(), tf.GradientTape() as tape:
                tape.watch(values)
                with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                    outputs = recording.replay(*call_args, **call_kwargs)
            output_grads = example_grads if batch_free else [g[None] for g in example_grads]
            vjp = tape.gradient(outputs, values, output_gradients=output_grads)
            return [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g) for g, v in zip(vjp, variables)]

        elems = ([flat_inputs[i] for i in batched], grads)
        signature = [tf.TensorSpec(v.shape, v.dtype) for v in values]
        with unrolled_recurrence(layer, args) as unrolled:
            if not unrolled and isinstance(layer, keras.layers.RNN) and compiling_with_xla():
                return _python_loop_map(one_example, elems, signature, layer)
            return per_example_map(one_example, elems, signature, layer.name)


@contextlib.contextmanager
def unrolled_recurrence(layer, args):
    """While the replay of ``layer`` is traced, a recurrent layer with a static number of
    steps runs unrolled: its while loop inside a per-example map does not compile under XLA
    (TensorListReserve of variants on XLA_CPU), and without control flow the replay can be
    vectorized. Same computation (Keras' ``unroll=True``); the layer is restored after.
    Yields whether it unrolled the layer."""
    steps = args[0].shape[1] if args and tf.is_tensor(args[0]) and args[0].shape.rank and args[0].shape.rank >= 2 \
        else None
    recurrent = isinstance(layer, keras.layers.RNN) and not layer.unroll
    if not recurrent or steps is None:
        yield False
        return
    layer.unroll = True
    try:
        yield True
    finally:
        layer.unroll = False


@contextlib.contextmanager
def calls_wrapped(model, applies, wrap):
    """While open, each layer of ``model`` with ``applies(layer)`` runs ``wrap(layer, call)``
    instead of its ``call`` (set per instance, so other models sharing the class are untouched,
    and restored on exit, whatever the instance had before)."""
    wrapped = []
    for layer in model._flatten_layers(include_self=True):
        if applies(layer):
            own = layer.__dict__.get("call")
            wrapped.append((layer, own))
            object.__setattr__(layer, "call", wrap(layer, own or type(layer).call.__get__(layer)))
    try:
        yield
    finally:
        for layer, own in wrapped:
            if own is None:
                layer.__dict__.pop("call", None)
            else:
                object.__setattr__(layer, "call", own)


def unrolled_sublayers(model):
    """While a per-example map of ``model`` is traced, each recurrent layer in it runs
    unrolled in every call whose number of steps is static (as ``unrolled_recurrence``)."""
    return calls_wrapped(model, lambda layer: isinstance(layer, keras.layers.RNN) and not layer.unroll,
                         _unrolling_call)


def _unrolling_call(layer, call):
    @functools.wraps(call)
    def unrolling(sequences, *args, **kwargs):
        static = tf.is_tensor(sequences) and sequences.shape.rank is not None and sequences.shape.rank >= 2 \
            and sequences.shape[1] is not None
        layer.unroll = static
        try:
            return call(sequences, *args, **kwargs)
        finally:
            layer.unroll = False
    return unrolling


def _python_loop_map(fn, elems, output_signature, layer):
    """Per-example replay of a recurrent layer with an unknown number of steps under XLA:
    its while loop inside a ``tf.map_fn`` does not compile there, so with a static batch
    size each example is replayed by its own copy of the graph (a Python loop; a warning
    names the layer); otherwise ``tf.map_fn``, which XLA may refuse."""
    examples = tf.nest.flatten(elems)[0].shape[0]
    if examples is None:
        warnings.warn(
            f"tf_dp: the per-example replay of recurrent layer {layer.name!r} ({type(layer).__name__}) has an unknown "
            "number of time steps and an unknown batch size, so its while loop runs inside tf.map_fn, which XLA may "
            "not compile: give the Input a static sequence length, or compile with jit_compile=False.",
            RuntimeWarning, stacklevel=4)
        return tf.map_fn(fn, elems, fn_output_signature=output_signature)
    warnings.warn(
        f"tf_dp: the per-example replay of recurrent layer {layer.name!r} ({type(layer).__name__}) has an unknown "
        f"number of time steps: under XLA it is traced once per example ({examples} copies; a static sequence length "
        "lets it run unrolled and vectorized).", RuntimeWarning, stacklevel=4)
    rows = [fn(tf.nest.map_structure(lambda e, i=i: e[i], elems)) for i in range(examples)]
    return [tf.stack(column) for column in zip(*rows)]


def per_example_map(fn, elems, output_signature, layer_name: str):
    """``tf.vectorized_map(fn, elems)``, or ``tf.map_fn`` (one example at a time) where pfor
    cannot convert an op or a tensor of the layer (recurrent control flow) is not
    accessible to it, or where the vectorized graph holds a batched matmul that crashes
    oneDNN (kernels.crash_prone_batch_matmuls: checked in the traced graph before anything
    runs); a layer neither can run names itself in the error."""
    if tf.executing_eagerly():  # trace first, so that the graph is checked before it runs
        return tf.function(lambda e: per_example_map(fn, e, output_signature, layer_name), autograph=False)(elems)
    graph = tf.compat.v1.get_default_graph()
    known = len(graph.get_operations())
    try:
        result = tf.vectorized_map(fn, elems)
    except Exception as error:  # pfor conversion errors have no common type
        return _map_one_by_one(fn, elems, output_signature, layer_name, f"vectorized_map failed "
                               f"({type(error).__name__}: {str(error)[:200]})")
    risky = crash_prone_batch_matmuls(graph.get_operations()[known:])
    if not risky:
        return result
    ops = ", ".join(sorted({f"{op.name} {[t.shape.as_list() for t in op.inputs[:2]]}" for op in risky})[:3])
    warnings.warn(
        f"tf_dp: per-example gradients of {layer_name!r} run one example at a time (tf.map_fn) instead of "
        f"vectorized: the vectorized graph has batched matmuls that crash TensorFlow's oneDNN kernel ({ops}). "
        "Slower, same result; TF_ENABLE_ONEDNN_OPTS=0 avoids the kernel.", RuntimeWarning, stacklevel=2)
    return _map_one_by_one(fn, elems, output_signature, layer_name, f"its vectorized graph crashes oneDNN ({ops})")


def _map_one_by_one(fn, elems, output_signature, layer_name: str, why_not_vectorized: str):
    """``tf.map_fn`` over the examples; if that fails too, an error naming the layer and both causes."""
    try:
        return tf.map_fn(fn, elems, fn_output_signature=output_signature)
    except Exception as error:
        raise ValueError(
            f"tf_dp cannot compute per-example gradients of layer {layer_name!r}: {why_not_vectorized}, and a "
            f"per-example map_fn failed too ({type(error).__name__}: {str(error)[:200]}). Register a GhostRule for "
            f"this layer (tf_dp.clipping.register_ghost_rule) or use clipping_engine='vectorized'.") from error
