"""The chunk loop of every DP step (docs/algorithms.md §1 step 3): Σ over a batch's chunks of
Σ_i c_i u_i, one loop for the built-in step (``DPTrainStep``, the compiled loss or a
``PerExampleObjective`` of the model's outputs) and ``private_update`` (a per-example
objective of one's own, tf_dp.models.custom_step).

The loop is generalised over what is clipped: a per-chunk function ``clip_chunk(x, y, mask)``
returning the engine's ``ClippedBatch`` of one chunk, built by the caller with ``chunk_clipper``
from its (model, per-example loss) pair; both read the model's engine, clipping policy and
the plan's views (§8, §11) from the same place, so a view, a clipping policy or an engine
applies to both steps alike.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import tensorflow as tf

from tf_dp.clipping import clipped_gradient_sum


class ChunkTotals(NamedTuple):
    """What the loop sums over a batch's chunks.

    Attributes:
      sums: Σ_i c_i u_i, one tensor per trainable variable.
      squared_norms: every example's squared norm, concatenated over chunks ([chunks·P]),
        or None when not asked for (only an adaptive clip bound reads them).
      loss_total: Σ of the per-example terms over the real (mask 1) rows.
      nonfinite: real rows whose gradient was NaN/Inf (they contribute zero).
    """

    sums: list
    squared_norms: Optional[tf.Tensor]
    loss_total: tf.Tensor
    nonfinite: tf.Tensor


def chunk_clipper(owner, model, per_example_loss: Callable, clip, points) -> Callable:
    """The per-chunk clipping of ``model``'s per-example loss with ``owner``'s settings.

    Args:
      owner: the DP model whose step this is (its optimizer's clipping policy, its clipping
        engine and layer registry, and its step plan's views).
      model: the model whose ``trainable_variables`` are clipped (``owner`` itself, or
        ``private_update``'s objective model).
      per_example_loss: ``fn(y, y_pred) -> [P]``.
      clip: C, read once per step.
      points: the optimizer's evaluation points.

    Returns:
      ``clip_chunk(x, y, mask) -> ClippedBatch`` for one chunk.
    """
    settings = dict(engine=owner._dp["engine"], points=points, clipping=getattr(owner.optimizer, "clipping", None),
                    views=owner.step_plan.views)
    registry = owner._dp.get("layer_registry")  # the model's ghost rules (compile's layer_registry=), if it has some
    if registry is not None:
        settings["layer_registry"] = registry

    def clip_chunk(x, y, mask):
        return clipped_gradient_sum(model, per_example_loss, x, y, mask, clip, **settings)

    return clip_chunk


def clipped_sum_over_chunks(clip_chunk: Callable, x, y, mask, variables,
                            with_squared_norms: bool = False) -> ChunkTotals:
    """Σ over the chunks of ``mask`` ([chunks, P]) of ``clip_chunk``'s clipped sums.

    Args:
      clip_chunk: ``clip_chunk(x, y, mask) -> ClippedBatch`` for one chunk (``chunk_clipper``;
        the built-in step's also updates its train metrics).
      x: the batch's inputs, each leaf [chunks, P, ...].
      y: its targets, same leading axes.
      mask: the [chunks, P] 0/1 padding mask.
      variables: the trainable variables the sums are over (their shapes start the sums).
      with_squared_norms: also return every example's squared norm.

    Returns:
      The ChunkTotals.
    """
    def chunk(index):
        take = lambda t: tf.gather(t, index)  # noqa: E731
        return tf.nest.map_structure(take, x), tf.nest.map_structure(take, y), take(mask)

    def add_chunk(index, totals):
        chunk_x, chunk_y, rows = chunk(index)
        result = clip_chunk(chunk_x, chunk_y, rows)
        sums, norms, total, nonfinite = totals
        if not isinstance(norms, tuple):
            norms = norms.write(index, tf.cast(result.squared_norms, tf.float32))
        real = tf.where(tf.cast(rows, tf.bool), tf.cast(result.losses, tf.float32), 0.0)  # padding may be NaN
        return ([s + c for s, c in zip(sums, result.clipped_sums)], norms, total + tf.reduce_sum(real),
                nonfinite + result.nonfinite_count(rows))

    static_chunks = tf.nest.flatten(x)[0].shape[0]
    norms = tf.TensorArray(tf.float32, size=static_chunks if static_chunks else tf.shape(mask)[0],
                           element_shape=mask.shape[1:]) if with_squared_norms else ()
    totals = ([tf.zeros_like(v) for v in variables], norms, tf.constant(0.0), tf.constant(0.0))
    if static_chunks == 1:
        totals = add_chunk(0, totals)
    else:
        chunks = tf.shape(mask)[0]
        _, totals = tf.while_loop(lambda index, _: index < chunks,
                                  lambda index, t: (index + 1, add_chunk(index, t)), (tf.constant(0), totals))
    sums, norms, total, nonfinite = totals
    return ChunkTotals(sums, norms.concat() if with_squared_norms else None, total, nonfinite)
