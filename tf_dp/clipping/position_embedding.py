"""Rule for keras-hub's learned ``PositionEmbedding`` (GPT-2, BERT, …), matched by name.

z_i = P[start : start + T] broadcast to example i's [T, d]: row start + t of the table
receives s_it alone, so per example

    ∂ℓ_i/∂P = pad(S_i, start rows before, L − start − T after),   ‖∂ℓ_i/∂P‖² = Σ_t ‖s_it‖²,

with no sum over positions (each row one term: exact, no cancellation). Calls with
explicit ``positions`` (serving) are not modelled and are replayed per example instead.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_dp.clipping.layer_per_example import MaterializedContribution
from tf_dp.clipping.registry import GhostRule, Recording, register_ghost_rule_by_public_name


class PositionEmbeddingRule(GhostRule):
    def applies_to(self, layer) -> bool:
        return layer.position_embeddings.trainable

    def variables(self, layer):
        return [layer.position_embeddings]

    def tapped_call(self, layer, original_call, recordings, inputs, start_index=0):
        shape = keras.ops.shape(inputs)
        table = keras.ops.convert_to_tensor(layer.position_embeddings)
        rows = keras.ops.slice(table, (start_index, 0), (shape[-2], shape[-1]))
        z = keras.ops.broadcast_to(rows, shape)
        recordings.append(Recording(start_index, [z]))
        return z

    def contribution(self, layer, recordings, output_grads):
        length, width = layer.position_embeddings.shape
        total = 0.0
        for recording, (grad,) in zip(recordings, output_grads):
            grad = tf.zeros_like(recording.watched[0]) if grad is None else grad
            s = tf.cast(tf.reshape(grad, tf.stack([tf.shape(grad)[0], -1, width])), tf.float32)  # [P, T, d]
            start = tf.cast(recording.inputs, tf.int32)
            after = length - start - tf.shape(s)[1]
            total += tf.pad(s, tf.stack([[0, 0], tf.stack([start, after]), [0, 0]]))
        return MaterializedContribution([total])


# keras-hub's public name, resolved once keras_hub is imported (tf_dp never imports it).
register_ghost_rule_by_public_name("keras_hub.layers.PositionEmbedding", PositionEmbeddingRule())
