"""Ghost rule for ``keras.layers.Embedding`` (LoRA-enabled ones: lora.py).

z_it = E[id_it]. The per-example gradient of the table is Σ_t e_{id_it} s_itᵀ, so

    ‖∂ℓ_i/∂E‖_F² = Σ_{t,t'} [id_it = id_it'] (s_it·s_it') = Σ_v ‖Σ_{t: id_it = v} s_it‖²,

computed in the explicit (right-hand) form, and the clipped sum scatters c_i s_it into row id_it.

Ids outside [0, V) (docs/algorithms.md §6.2): a negative id counts from the end (id + V),
as Keras' ``ops.take`` does on every backend; an id still outside [0, V) (≥ V, or < −V)
looks up a zero vector and has no gradient — what Keras computes on a GPU. On a CPU plain
Keras fails there instead, and a failure at the first step that samples such an example
would tell when it was sampled, so the DP step never fails: the tapped lookup
(``in_range_ids``, ``zero_invalid``) is that total function on every device and under XLA,
and the norms are those of its gradient.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_dp.clipping import rounding
from tf_dp.clipping.clip import sum_over_examples
from tf_dp.clipping.dense import dense_contribution
from tf_dp.clipping.lora import lora_embedding_contribution, lora_embedding_tapped_call, lora_enabled
from tf_dp.clipping.registry import Contribution, GhostRule, Recording, register_ghost_rule


def in_range_ids(ids, vocabulary_size: int):
    """(ids in [0, V), valid): negative ids counted from the end (id + V, as ``ops.take``);
    ids still out of range are replaced by 0 and marked invalid."""
    ids = tf.where(ids < 0, ids + tf.cast(vocabulary_size, ids.dtype), ids)
    valid = tf.logical_and(ids >= 0, ids < vocabulary_size)
    return tf.where(valid, ids, tf.zeros_like(ids)), valid


def zero_invalid(z, valid):
    """The looked-up rows z with zero vectors at invalid positions. Record z itself: its
    output gradient is then zero at an invalid position, so the norms carry no term for it."""
    return tf.where(valid[..., None], z, tf.zeros_like(z))


class EmbeddingContribution(Contribution):
    """Per-example rows in explicit form: r_iv = Σ_{t: id_it = v} s_it for each distinct id v
    of example i (at most T rows per example, so P·T·k work, not the T²·k of the Gram form
    Σ_{t,t'} [id_it = id_it'] (s_it·s_it'), whose cancellation — repeated ids with opposite
    s_it — made the float32 norm arbitrarily small or negative).

    Clip norm U_i = (Σ_v ‖r̂_iv‖²)^½ (1 + γ)^½ + Σ_v γ_{n_iv − 1} Σ_{t: id_it = v} ‖s_it‖,
    n_iv the positions of id v in example i (a row of one position is exact), is ≥ the exact
    norm and the norm of the released Σ_v c_i r̂_iv (rounding.py); the clipped sum scatters
    c_i r̂_iv into row v."""

    def __init__(self, ids, output_grads, vocabulary_size: int):
        self.ids, self.vocabulary_size = ids, vocabulary_size  # [P, T]
        s = tf.convert_to_tensor(output_grads)
        self.s = s if s.dtype == tf.float64 else tf.cast(s, tf.float32)  # [P, T, k]; float32 under bfloat16 too
        examples, steps = tf.shape(ids, out_type=tf.int32)[0], tf.shape(ids, out_type=tf.int32)[1]
        # Row of position t: the first position t' of example i with the same id (static
        # sizes, so XLA compiles it; [P, T, T] like the Gram form's id mask).
        positions = tf.range(steps)
        same = tf.equal(ids[:, :, None], ids[:, None, :])
        first = tf.reduce_min(tf.where(same, positions[None, None, :], steps), axis=2)  # [P, T]
        self.slot = tf.reshape(tf.range(examples)[:, None] * steps + first, [-1])
        self.num_rows = examples * steps  # rows of positions that repeat an earlier id stay zero
        self.rows = tf.math.unsorted_segment_sum(tf.reshape(self.s, [-1, tf.shape(self.s)[-1]]), self.slot,
                                                 self.num_rows)
        self.row_example = tf.repeat(tf.range(examples), steps)
        self.row_id = tf.reshape(ids, [-1])
        self.examples, self.steps = examples, rounding.dimension(ids, 1)  # T: static if known (γ_T folds)

    def squared_norms(self):
        squares = tf.math.unsorted_segment_sum(rounding.squared_sum(self.rows), self.row_example, self.examples)
        count = tf.math.unsorted_segment_sum(tf.ones_like(self.slot, tf.float64), self.slot, self.num_rows)  # n_iv
        row_scale = tf.math.unsorted_segment_sum(tf.reshape(rounding.row_norms(self.s), [-1]), self.slot,
                                                 self.num_rows)  # Σ_{t in the row} ‖s_it‖
        row_error = tf.math.multiply_no_nan(rounding.gamma(count - 1.0, self.s.dtype), row_scale)  # ≥ ‖r̂ − r‖
        error = tf.math.unsorted_segment_sum(row_error, self.row_example, self.examples)
        return tf.square(tf.sqrt(squares * (1.0 + rounding.gamma(self.steps))) + error)  # T rows at most

    def weighted_sums(self, clip_factors):
        c = tf.gather(tf.cast(clip_factors, self.s.dtype), self.row_example)  # c_i of each row
        sums = sum_over_examples(self._scatter, c, self.rows)
        return [tf.cast(t, tf.float32) for t in sums]

    def _scatter(self, c, rows):
        return [tf.math.unsorted_segment_sum(rows * c[:, None], self.row_id, self.vocabulary_size)]


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
        ids, valid = in_range_ids(ids, layer.input_dim)
        if lora_enabled(layer):
            z, recording = lora_embedding_tapped_call(layer, ids)
        else:
            z = keras.ops.take(layer.embeddings, ids, axis=0)
            recording = Recording(ids, [z])
        recordings.append(recording)
        return keras.ops.cast(zero_invalid(z, valid), layer.compute_dtype)

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
