"""Ghost rule for ``keras.layers.Embedding`` (LoRA-enabled ones: lora.py).

z_it = E[id_it]. The per-example gradient of the table is Σ_t e_{id_it} s_itᵀ, so

    ‖∂ℓ_i/∂E‖_F² = Σ_{t,t'} [id_it = id_it'] (s_it·s_it'),

and the clipped sum scatters c_i s_it into row id_it.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_dp.clipping import rounding
from tf_dp.clipping.clip import sum_over_examples
from tf_dp.clipping.dense import dense_contribution
from tf_dp.clipping.lora import lora_embedding_contribution, lora_embedding_tapped_call, lora_enabled
from tf_dp.clipping.registry import Contribution, GhostRule, Recording, register_ghost_rule


class EmbeddingContribution(Contribution):
    """Norms and sums in float64; the clip norm is the certified bound (rounding.py)
    U_i = sqrt(max(Ñ_i², 0) + γ_{T²+k+1} M_i²) + γ_{T+2} M_i with M_i = Σ_t ‖s_it‖: repeated
    ids with cancelling s_it make the float32 Ñ_i² arbitrarily small (or negative)."""

    def __init__(self, ids, output_grads, vocabulary_size: int):
        self.ids, self.vocabulary_size = ids, vocabulary_size  # [P, T]
        self.s = tf.cast(output_grads, tf.float64)  # [P, T, k], float64 under any compute policy

    def squared_norms(self):
        same_id = tf.cast(tf.equal(self.ids[:, :, None], self.ids[:, None, :]), self.s.dtype)
        squares = tf.reduce_sum(same_id * tf.einsum("ptk,puk->ptu", self.s, self.s), axis=[1, 2])
        steps, k = tf.shape(self.s)[1], tf.shape(self.s)[2]
        scale = tf.reduce_sum(rounding.row_norms(self.s), axis=1)
        return tf.square(rounding.certified_norm(squares, scale, steps * steps + k + 1, steps + 2))

    def weighted_sums(self, clip_factors):
        sums = sum_over_examples(self._scatter, tf.cast(clip_factors, self.s.dtype), self.s)
        return [tf.cast(t, tf.float32) for t in sums]

    def _scatter(self, c, s):
        weighted_s = s * c[:, None, None]
        return [tf.math.unsorted_segment_sum(tf.reshape(weighted_s, [-1, tf.shape(s)[-1]]), tf.reshape(self.ids, [-1]),
                                             self.vocabulary_size)]


class EmbeddingRule(GhostRule):
    """Embedding, and LoRA-enabled Embedding (adapters A, B trainable, E₀ frozen; see lora.py)."""

    def applies_to(self, layer) -> bool:
        return (
            getattr(layer, "quantization_mode", None) is None
            and not getattr(layer, "sparse", False)
            and (lora_enabled(layer) or getattr(getattr(layer, "_embeddings", None), "trainable", True))
        )

    def variables(self, layer):
        return [layer.lora_embeddings_a, layer.lora_embeddings_b] if lora_enabled(layer) else [layer.embeddings]

    def tapped_call(self, layer, original_call, recordings, inputs):
        ids = inputs if inputs.dtype in (tf.int32, tf.int64) else tf.cast(inputs, tf.int32)
        if lora_enabled(layer):
            z, recording = lora_embedding_tapped_call(layer, ids)
        else:
            z = keras.ops.take(layer.embeddings, ids, axis=0)
            recording = Recording(ids, [z])
        recordings.append(recording)
        return keras.ops.cast(z, layer.compute_dtype)

    def contribution(self, layer, recordings, output_grads):
        if lora_enabled(layer):
            grads = [tf.zeros_like(r.watched[0]) if g is None else g for r, (g,) in zip(recordings, output_grads)]
            return lora_embedding_contribution(layer, recordings, grads, EmbeddingContribution, dense_contribution)
        ids, grads = [], []
        for recording, (grad,) in zip(recordings, output_grads):
            batch = tf.shape(recording.inputs)[0]
            ids.append(tf.reshape(tf.cast(recording.inputs, tf.int64), [batch, -1]))
            grad = tf.zeros_like(recording.watched[0]) if grad is None else grad
            grads.append(tf.reshape(grad, tf.stack([batch, -1, tf.shape(grad)[-1]])))
        return EmbeddingContribution(tf.concat(ids, axis=1), tf.concat(grads, axis=1), layer.input_dim)


register_ghost_rule(keras.layers.Embedding, EmbeddingRule())
