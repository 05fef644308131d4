"""Per-example gradients of the whole model by ``tf.vectorized_map`` (the reference path).

Materialises g_i = ∂ℓ(θ; x_i)/∂θ for every example: exact for any model whose examples do
not interact (a per-example ``tf.map_fn`` where ``vectorized_map`` cannot convert the
model, e.g. recurrent layers), and memory-bound (P copies of the gradient). The fast engine
(``tf_dp.clipping.engine``) must agree with it.

Token ids outside [0, V) (docs/algorithms.md §6.2): while the map is traced, every
Embedding (and ReversibleEmbedding's lookup) counts a negative id from the end and looks
up a zero vector with no gradient for an id still out of range — Keras' result on a GPU,
and the ghost rules' (``tf_dp.clipping.embedding``). Plain Keras fails on a CPU there, and
a failure at the step that first samples such an example would tell when it was sampled.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import keras
import tensorflow as tf

from tf_dp.clipping.embedding import in_range_ids, zero_invalid
from tf_dp.clipping.kernels import require_grouped_conv_kernels
from tf_dp.clipping.layer_per_example import calls_wrapped, per_example_map, unrolled_sublayers


def per_example_gradients(
    model, per_example_loss: Callable, x, y, weights: Optional[Sequence[tf.Tensor]] = None, only=None
) -> list[tf.Tensor]:
    """[P, *shape] per-example gradients for each of ``model.trainable_variables`` (or of the
    variables in ``only``, in that order), at the variables' values or at ``weights``.

    Args:
      model: a Keras model.
      per_example_loss: ``fn(y, y_pred)`` returning the [P] per-example losses.
      x: the batch's inputs.
      y: the batch's targets.
      weights: values for ``model.trainable_variables``, in order, or None for their current values.
      only: a subset of the trainable variables to differentiate, or None for all.

    Returns:
      One [P, *shape] tensor per variable.
    """
    require_grouped_conv_kernels([model], "engine='vectorized' (per-example gradients by vectorized_map)")
    variables = model.trainable_variables
    values = [tf.convert_to_tensor(v.value) for v in variables] if weights is None else list(weights)
    if only is not None:
        position = {id(v): j for j, v in enumerate(variables)}
        return _subset_gradients(model, per_example_loss, x, y, variables, values, [position[id(v)] for v in only])

    def one_example(example):
        x_i, y_i = tf.nest.map_structure(lambda t: t[None], example)
        with tf.GradientTape() as tape:
            tape.watch(values)
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                loss = per_example_loss(y_i, model(x_i, training=True))[0]
        grads = tape.gradient(loss, values)
        return [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g) for g, v in zip(grads, values)]

    signature = [tf.TensorSpec(v.shape, v.dtype) for v in values]
    # recurrent layers without a while loop (XLA compiles them inside the map); lookups total on every device
    with unrolled_sublayers(model), total_embedding_lookups(model):
        return per_example_map(one_example, (x, y), signature, model.name)  # map_fn where pfor cannot convert


def _subset_gradients(model, per_example_loss, x, y, variables, values, indices) -> list[tf.Tensor]:
    """Per-example gradients of the variables at ``indices`` only (the others held at their values)."""
    def one_example(example):
        x_i, y_i = tf.nest.map_structure(lambda t: t[None], example)
        with tf.GradientTape() as tape:
            watched = [values[j] for j in indices]
            tape.watch(watched)
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                loss = per_example_loss(y_i, model(x_i, training=True))[0]
        grads = tape.gradient(loss, watched)
        return [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g) for g, v in zip(grads, watched)]

    signature = [tf.TensorSpec(values[j].shape, values[j].dtype) for j in indices]
    with unrolled_sublayers(model), total_embedding_lookups(model):
        return per_example_map(one_example, (x, y), signature, model.name)


def total_embedding_lookups(model):
    """While the map is traced, each Embedding in ``model`` (ReversibleEmbedding's forward
    lookup included) looks up z_t = E[id_t + V·[id_t < 0]] where that is in [0, V) and
    z_t = 0 (no gradient) elsewhere."""
    return calls_wrapped(model, lambda layer: isinstance(layer, keras.layers.Embedding), _total_lookup)


def _total_lookup(layer, call):
    @functools.wraps(call)
    def lookup(inputs, *args, **kwargs):
        if kwargs.get("reverse", args[0] if args else False):  # ReversibleEmbedding's logits: no ids
            return call(inputs, *args, **kwargs)
        ids = inputs if inputs.dtype in (tf.int32, tf.int64) else tf.cast(inputs, tf.int32)
        ids, valid = in_range_ids(ids, layer.input_dim)
        outputs = call(ids, *args, **kwargs)
        return zero_invalid(outputs, valid)

    return lookup
