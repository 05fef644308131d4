"""The ReversibleEmbedding rule (tf_dp/clipping/reversible_embedding.py): a table used for the
token lookup and the output projection (tied or not, with a logit soft cap), in its explicit
and float64 Gram forms, against the per-example loop; its norm bound under cancellation; a
table used for lookups only takes the Embedding form."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.clipping.rules.models import assert_ghost_matches_loop, token_loss
from tf_dp.clipping import ghost_rule_for

BATCH, CLASSES = 4, 3


class TiedLanguageModel(keras.layers.Layer):
    """Token lookup and output projection through one keras.layers.ReversibleEmbedding."""

    def __init__(self, tie_weights=True, logit_soft_cap=None):
        super().__init__()
        self.embedding = keras.layers.ReversibleEmbedding(11, 4, tie_weights=tie_weights,
                                                          logit_soft_cap=logit_soft_cap)
        self.hidden = keras.layers.Dense(4, activation="tanh")

    def call(self, ids):
        return self.embedding(self.hidden(self.embedding(ids)), reverse=True)


@pytest.mark.parametrize("tie_weights, soft_cap, form", [(True, None, "explicit"), (True, None, "gram"),
                                                         (True, 2.0, "explicit"), (False, None, "explicit")])
def test_reversible_embedding_matches_loop(tie_weights, soft_cap, form, monkeypatch):
    from tf_dp.clipping import dense
    if form == "gram":  # the float64 Gram form, used where [P, V, d] per-example tables do not fit
        monkeypatch.setattr(dense, "EXPLICIT_FLOATS", 0)
    lm = TiedLanguageModel(tie_weights, soft_cap)
    inputs = keras.Input((5,), dtype="int32")
    model = keras.Model(inputs, lm(inputs))
    assert ghost_rule_for(lm.embedding) is not None  # lookup × projection cross terms in the rule
    ids = np.random.randint(0, 11, (BATCH, 5)).astype("int32")
    ids[0, :3] = 2
    assert_ghost_matches_loop(model, ids, np.roll(ids, -1, axis=1), token_loss)


@pytest.mark.parametrize("form", ["explicit", "gram"])
def test_tied_embedding_norm_is_safe_under_cancellation(form):
    # Lookup and projection gradients of one row cancel: G = M·u − (M·u + δ) = −δ with
    # M = 1e4. A float32 Gram form loses δ entirely; the rule's float64 Gram form and its
    # float32 explicit form, each with its certified bound, must stay ≥ ‖δ‖ and release at
    # most C per example.
    from tf_dp.clipping import reversible_embedding
    contribution_class = {"explicit": reversible_embedding.ExplicitTiedEmbeddingContribution,
                          "gram": reversible_embedding.TiedEmbeddingContribution}[form]
    rng = np.random.default_rng(0)
    width, vocabulary, big = 8, 5, 1e4
    u = rng.standard_normal((BATCH, 1, width)).astype("float32")
    delta = (1e-3 * rng.standard_normal((BATCH, 1, width))).astype("float32")
    s = big * u
    h = s + delta
    e = np.zeros((BATCH, 1, vocabulary), "float32")
    e[:, 0, 0] = -1.0
    ids = np.zeros((BATCH, 1), "int64")
    contribution = contribution_class(tf.constant(ids), tf.constant(s), tf.constant(h), tf.constant(e), vocabulary)
    exact = np.linalg.norm(s.astype(np.float64) - h.astype(np.float64), axis=(1, 2))  # row 0: s − h = −δ
    bound = np.sqrt(contribution.squared_norms().numpy())
    assert np.all(bound >= exact)
    clip = 1e-4
    for i in range(BATCH):
        factors = np.zeros(BATCH)
        factors[i] = clip / max(bound[i], clip)
        released = contribution.weighted_sums(tf.constant(factors))[0].numpy()
        assert np.linalg.norm(released) <= clip * (1 + 1e-6)


def test_a_reversible_embedding_used_only_for_lookups_is_an_embedding(monkeypatch):
    """BERT's token table is a ReversibleEmbedding never called with reverse=True: its
    gradient is a plain lookup gradient, taken by the Embedding form (no [P, V, d] tables)."""
    from tf_dp.clipping import reversible_embedding

    explicit = []
    monkeypatch.setattr(reversible_embedding.ExplicitTiedEmbeddingContribution, "__init__",
                        lambda self, *a: explicit.append(1) or pytest.fail("tied tables for lookups only"))
    inputs = keras.Input((6,), dtype="int32")
    table = keras.layers.ReversibleEmbedding(11, 4, tie_weights=True)
    pooled = keras.layers.GlobalAveragePooling1D()(table(inputs))
    model = keras.Model(inputs, keras.layers.Dense(CLASSES)(pooled))
    ids = np.random.randint(0, 11, (BATCH, 6)).astype("int32")
    ids[0, :3] = 2  # a repeated id within one example
    assert_ghost_matches_loop(model, ids)
    assert not explicit
