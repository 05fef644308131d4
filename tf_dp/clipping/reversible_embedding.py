"""Ghost rule for ``keras.layers.ReversibleEmbedding`` (and keras-hub's older one): one table E ∈ R^{V×d} used for the
token lookup and, with ``reverse=True``, for the output projection (tied input/output
embeddings of GPT-2, Gemma, Llama, BART, T5 causal LMs).

Per example i, lookups z_it = E[id_it] with output gradients s_it ∈ R^d, projections
logits_iu = h_iu Eᵀ with inputs h_iu ∈ R^d and output gradients e_iu ∈ R^V:

    G_lookup,i = Σ_t 1_{id_it} s_itᵀ,   G_proj,i = Σ_u e_iuᵀ h_iu,   g_i = G_lookup,i + G_proj,i

    ‖g_i‖² = Σ_{t,t'} [id_it = id_it'] (s_it·s_it')
           + Σ_{u,u'} (h_iu·h_iu')(e_iu·e_iu')
           + 2 Σ_{t,u} e_iu[id_it] (h_iu·s_it)               (docs/algorithms.md §6, the cross term)

Two forms, chosen by size (as Dense's explicit and Gram forms):

* explicit, where the per-example tables [P, V, d] fit ``dense.EXPLICIT_FLOATS``: ĝ_i =
  e_iᵀ h_i (one batched float32 matmul, the FLOPs of the weight gradient a plain step
  computes) with the rows s_it added at id_it, clipped against the norm of exactly that
  tensor, U_i = ‖ĝ_i‖(1 + γ)^½ + γ_{T1+T2+1} M_i (each entry a float32 sum of at most T1 + T2
  terms), and released as Σ_i c_i ĝ_i;
* Gram, otherwise: all three terms above in float64, clipped against U_i = sqrt(max(Ñ_i², 0)
  + γ_G M_i²) + γ_R M_i, and the clipped sum scatter(c_i s_it → row id_it) + Σ_i c_i e_iᵀ h_i
  in float64 — the float64 Gram of [P, T, V] and the float64 matmul made keras-hub GPT-2's
  DP step 1.5× a plain step at batch 64 (vocabulary 5000, width 128).

Both with M_i = Σ_t ‖s_it‖ + Σ_u ‖h_iu‖‖e_iu‖ ≥ ‖g_i‖ (rounding.py; every Gram term is
bounded by a product of two of M's terms, so the terms' absolute sum is ≤ M_i²).

With ``tie_weights=False`` the projection has its own table R ∈ R^{d×V}: a Dense contribution
without bias, and the lookups an Embedding contribution; their norms add (distinct
variables). keras-hub's own class is matched by name, so tf_dp never imports keras-hub.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_dp.clipping import rounding
from tf_dp.clipping.clip import sum_over_examples, weighted_row_sum
from tf_dp.clipping import dense
from tf_dp.clipping.dense import dense_contribution
from tf_dp.clipping.embedding import EmbeddingContribution, in_range_ids, zero_invalid
from tf_dp.clipping.lora import lora_enabled
from tf_dp.clipping.registry import (CombinedContribution, Contribution, GhostRule, Recording,
                                     register_ghost_rule, register_ghost_rule_by_public_name)

LOOKUP, PROJECTION = "lookup", "projection"


def _sequence(tensor, width) -> tf.Tensor:
    """[P, ..., width] → [P, T, width]."""
    tensor = tf.convert_to_tensor(tensor)
    return tf.reshape(tensor, tf.stack([tf.shape(tensor)[0], -1, width]))


class TiedEmbeddingContribution(Contribution):
    """g_i = G_lookup,i + G_proj,i of one tied table (module docstring), float64."""

    def __init__(self, ids, s, h, e, vocabulary_size: int):
        self.ids = ids  # [P, T1] int64
        self.s, self.h, self.e = (tf.cast(t, tf.float64) for t in (s, h, e))  # [P,T1,d], [P,T2,d], [P,T2,V]
        self.vocabulary_size = vocabulary_size

    def squared_norms(self):
        same_id = tf.cast(tf.equal(self.ids[:, :, None], self.ids[:, None, :]), tf.float64)
        lookup = tf.reduce_sum(same_id * tf.einsum("ptd,pud->ptu", self.s, self.s), axis=[1, 2])
        projection = tf.reduce_sum(tf.einsum("ptd,pud->ptu", self.h, self.h) *
                                   tf.einsum("ptv,puv->ptu", self.e, self.e), axis=[1, 2])
        e_at_ids = tf.gather(self.e, self.ids, axis=2, batch_dims=1)  # [P, T2, T1]: e_iu[id_it]
        cross = tf.reduce_sum(e_at_ids * tf.einsum("pud,ptd->put", self.h, self.s), axis=[1, 2])
        scale = _cancellation_scale(self.s, self.h, self.e)  # M_i
        steps = rounding.dimension(self.s, 1) + rounding.dimension(self.h, 1)
        gram_terms = steps * steps + rounding.dimension(self.s, 2) + rounding.dimension(self.e, 2) + 1
        return tf.square(rounding.certified_norm(lookup + projection + 2.0 * cross, scale, gram_terms, steps + 2))

    def weighted_sums(self, clip_factors):
        c = tf.cast(clip_factors, tf.float64)
        return [tf.cast(t, tf.float32) for t in sum_over_examples(self._weighted_sum, c, self.s, self.h, self.e)]

    def _weighted_sum(self, c, s, h, e):
        """[Σ_i c_i g_i]: rows c_i s_it added at id_it, plus (c ⊙ e)ᵀ h over all positions."""
        width = tf.shape(s)[-1]
        rows = tf.math.unsorted_segment_sum(tf.reshape(s * c[:, None, None], [-1, width]),
                                            tf.reshape(self.ids, [-1]), self.vocabulary_size)
        weighted_e = tf.reshape(e * c[:, None, None], [-1, tf.shape(e)[-1]])
        return [rows + tf.matmul(weighted_e, tf.reshape(h, [-1, width]), transpose_a=True)]


def _cancellation_scale(s, h, e) -> tf.Tensor:
    """M_i = Σ_t ‖s_it‖ + Σ_u ‖h_iu‖‖e_iu‖ (float64), ≥ ‖g_i‖ and ≥ the terms' absolute sum."""
    return tf.reduce_sum(rounding.row_norms(s), axis=1) + tf.reduce_sum(
        rounding.row_norms(h) * rounding.row_norms(e), axis=1)


class ExplicitTiedEmbeddingContribution(Contribution):
    """g_i = G_lookup,i + G_proj,i held explicitly, [P, V, d] in float32 (module docstring)."""

    def __init__(self, ids, s, h, e, vocabulary_size: int):
        s, h, e = (tf.cast(t, tf.float32) for t in (s, h, e))
        examples, lookups, width = tf.shape(s)[0], tf.shape(s)[1], tf.shape(s)[2]
        projections = tf.einsum("puv,pud->pvd", e, h)  # Σ_u e_iuᵀ h_iu per example
        rows = tf.stack([tf.repeat(tf.range(examples, dtype=tf.int64), lookups), tf.reshape(ids, [-1])], axis=1)
        self.grads = tf.tensor_scatter_nd_add(projections, rows, tf.reshape(s, [-1, width]))  # + s_it at id_it
        self.scale = _cancellation_scale(s, h, e)
        self.terms = rounding.dimension(s, 1) + rounding.dimension(h, 1)

    def squared_norms(self):
        squares = rounding.squared_sum(rounding.per_example_rows(self.grads))
        return tf.square(rounding.certified_norm(squares, self.scale, 0, self.terms + 1, summed_dtype=tf.float32))

    def weighted_sums(self, clip_factors):
        return [weighted_row_sum(clip_factors, self.grads)]


def _explicit_fits(examples, vocabulary_size: int, width: int, steps) -> bool:
    """[P, V, d] fits the memory budget, and the float32 sums over the T1 + T2 positions keep a
    tight rounding bound (T·u ≤ 2⁻¹², as Dense's explicit form; never under TF32)."""
    tight = steps is not None and steps * rounding.unit_roundoff(tf.float32) <= 2.0 ** -12
    return tight and examples is not None and examples * vocabulary_size * width <= dense.EXPLICIT_FLOATS


class ReversibleEmbeddingRule(GhostRule):
    def applies_to(self, layer) -> bool:
        tables = [layer.embeddings] + ([] if layer.tie_weights else [layer.reverse_embeddings])
        return (getattr(layer, "quantization_mode", None) is None and not lora_enabled(layer)
                and getattr(layer, "reverse_dtype", None) is None and all(t.trainable for t in tables))

    def accepts_call(self, layer, args, kwargs) -> bool:
        return super().accepts_call(layer, args, kwargs) and isinstance(kwargs.get("reverse", False), bool) \
            and (len(args) < 2 or isinstance(args[1], bool))

    def variables(self, layer):
        return [layer.embeddings] + ([] if layer.tie_weights else [layer.reverse_embeddings])

    def tapped_call(self, layer, original_call, recordings, inputs, reverse=False):
        if not reverse:  # ids outside [0, V): as a plain Embedding (embedding.py)
            ids = inputs if inputs.dtype in (tf.int32, tf.int64) else tf.cast(inputs, tf.int32)
            ids, valid = in_range_ids(ids, layer.input_dim)
            z = keras.ops.take(layer.embeddings, ids, axis=0)
            recordings.append(Recording(ids, [z], extras=LOOKUP))
            return keras.ops.cast(zero_invalid(z, valid), layer.compute_dtype)
        kernel = keras.ops.transpose(layer.embeddings) if layer.tie_weights else layer.reverse_embeddings
        logits = keras.ops.matmul(inputs, kernel)
        recordings.append(Recording(inputs, [logits], extras=PROJECTION))
        if layer.logit_soft_cap is not None:
            logits = keras.ops.multiply(keras.ops.tanh(keras.ops.divide(logits, layer.logit_soft_cap)),
                                        layer.logit_soft_cap)
        return logits

    def contribution(self, layer, recordings, output_grads):
        width, vocabulary = layer.output_dim, layer.input_dim
        ids, s, h, e = [], [], [], []
        for recording, (grad,) in zip(recordings, output_grads):
            grad = tf.zeros_like(recording.watched[0]) if grad is None else grad
            batch = tf.shape(grad)[0]
            if recording.extras == LOOKUP:
                ids.append(tf.reshape(tf.cast(recording.inputs, tf.int64), tf.stack([batch, -1])))
                s.append(_sequence(grad, width))
            else:
                h.append(_sequence(recording.inputs, width))
                e.append(_sequence(grad, vocabulary))
        lookups_only = not h
        batch = tf.shape(output_grads[0][0] if output_grads[0][0] is not None else recordings[0].watched[0])[0]
        ids = tf.concat(ids, 1) if ids else tf.zeros(tf.stack([batch, 0]), tf.int64)
        s = tf.concat([tf.cast(t, tf.float32) for t in s], 1) if s else tf.zeros(tf.stack([batch, 0, width]))
        h = tf.concat([tf.cast(t, tf.float32) for t in h], 1) if h else tf.zeros(tf.stack([batch, 0, width]))
        e = tf.concat([tf.cast(t, tf.float32) for t in e], 1) if e else tf.zeros(tf.stack([batch, 0, vocabulary]))
        if layer.tie_weights and lookups_only:  # BERT's token table: a plain Embedding's gradient
            return EmbeddingContribution(ids, s, vocabulary)
        if layer.tie_weights:
            steps = None if s.shape[1] is None or h.shape[1] is None else s.shape[1] + h.shape[1]
            if _explicit_fits(s.shape[0], vocabulary, width, steps):
                return ExplicitTiedEmbeddingContribution(ids, s, h, e, vocabulary)
            return TiedEmbeddingContribution(ids, s, h, e, vocabulary)
        lookup = EmbeddingContribution(ids, s, vocabulary)
        projection = dense_contribution([h], [e], has_bias=False)
        return CombinedContribution([lookup, projection], [tuple(v.shape) for v in self.variables(layer)])


_RULE = ReversibleEmbeddingRule()
if hasattr(keras.layers, "ReversibleEmbedding"):  # Keras ≥ 3.12 (what keras-hub 0.32 uses)
    register_ghost_rule(keras.layers.ReversibleEmbedding, _RULE)
# keras-hub's public name, resolved once keras_hub is imported (tf_dp never imports it).
register_ghost_rule_by_public_name("keras_hub.layers.ReversibleEmbedding", _RULE)
