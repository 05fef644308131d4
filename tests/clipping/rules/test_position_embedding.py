"""The rule for keras-hub's PositionEmbedding (tf_dp/clipping/position_embedding.py): a table
longer than the sequence, called at start 0 and at a later start (rows padded before and after,
two recordings of one table), against the per-example loop."""

import keras
import numpy as np
import pytest

from tests.clipping.rules.models import BATCH, assert_ghost_matches_loop
from tf_dp.clipping import ghost_rule_for
from tf_dp.clipping.position_embedding import PositionEmbeddingRule

keras_hub = pytest.importorskip("keras_hub", reason="keras-hub is not installed (pip install tf_dp[hub])")


def test_position_embedding_rule_matches_loop():
    inputs = keras.Input((5,), dtype="int32")
    tokens = keras.layers.Embedding(11, 4)(inputs)
    positions = keras_hub.layers.PositionEmbedding(sequence_length=8)
    hidden = keras.layers.Concatenate(axis=1)([tokens + positions(tokens), tokens * positions(tokens, start_index=2)])
    hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(6, activation="tanh")(hidden))
    model = keras.Model(inputs, keras.layers.Dense(3)(hidden))
    assert isinstance(ghost_rule_for(positions), PositionEmbeddingRule)
    ids = np.random.randint(0, 11, (BATCH, 5)).astype("int32")
    assert_ghost_matches_loop(model, ids)
