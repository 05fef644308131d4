"""keras-hub models (small random configs, built from constructors — nothing downloaded):
the ghost engine's norms and clipped sums equal a per-example loop's."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.harness import flat_norms, loop_per_example_gradients, sparse_ce
from tf_dp.clipping import clipped_gradient_sum, ghost_rule_for

keras_hub = pytest.importorskip("keras_hub", reason="keras-hub is not installed (pip install tf_dp[hub])")

BATCH = 3
VOCABULARY = 40


def token_loss(y, logits):
    """ℓ_i: mean over positions of the next-token cross-entropy."""
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True), axis=-1)


def assert_ghost_matches_loop(model, x, y, loss, engine="ghost"):
    per_example = loop_per_example_gradients(model, x, y, loss)
    norms = flat_norms(per_example)
    clip = float(np.median(norms))
    result = clipped_gradient_sum(model, loss, tf.nest.map_structure(tf.constant, x), tf.constant(y),
                                  tf.ones(BATCH), clip, engine=engine)
    got = np.sqrt(result.squared_norms.numpy().astype(np.float64))
    np.testing.assert_allclose(got, norms, rtol=1e-4)
    factors = np.minimum(1.0, clip / got)
    for v, total in enumerate(result.clipped_sums):
        want = sum(factors[i] * per_example[i][v] for i in range(BATCH))
        np.testing.assert_allclose(total.numpy(), want, rtol=1e-4, atol=1e-6)


def lm_batch(length=6):
    ids = np.random.randint(1, VOCABULARY, (BATCH, length)).astype("int32")
    ids[0, :3] = 5  # repeated ids: the lookup's own cross terms
    return {"token_ids": ids, "padding_mask": np.ones_like(ids)}, np.roll(ids, -1, axis=1)


def test_gpt2_causal_lm_tied_embeddings_match_loop():
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=VOCABULARY, num_layers=1, num_heads=2, hidden_dim=8,
                                             intermediate_dim=16, max_sequence_length=8, dropout=0.0)
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    assert ghost_rule_for(backbone.token_embedding) is not None  # tied lookup + projection, with cross terms
    assert_ghost_matches_loop(model, *lm_batch(), token_loss)


def test_gemma_causal_lm_matches_loop(engine="ghost"):
    backbone = keras_hub.models.GemmaBackbone(vocabulary_size=VOCABULARY, num_layers=1, num_query_heads=2,
                                              num_key_value_heads=1, hidden_dim=8, intermediate_dim=16, head_dim=4,
                                              dropout=0.0)
    assert_ghost_matches_loop(keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None), *lm_batch(),
                              token_loss, engine)


def test_gemma_causal_lm_vectorized_engine_in_a_subprocess():
    """The whole-model vectorized engine (softmax of rank 6 under pfor → map_fn). oneDNN's
    batched matmul aborted the process inside vectorized_map on keras-hub models (now routed
    around, see test_keras_hub.run_case); it runs apart so a crash cannot take the run with it."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = (f"import sys; sys.path.insert(0, {root!r}); import tests.keras_code.test_keras_hub_clipping as t; "
            "t.test_gemma_causal_lm_matches_loop('vectorized')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])


def test_bert_text_classifier_matches_loop():
    backbone = keras_hub.models.BertBackbone(vocabulary_size=VOCABULARY, num_layers=1, num_heads=2, hidden_dim=8,
                                             intermediate_dim=16, max_sequence_length=8, dropout=0.0)
    model = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=3, preprocessor=None, dropout=0.0)
    ids = np.random.randint(1, VOCABULARY, (BATCH, 6)).astype("int32")
    x = {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": np.ones_like(ids)}
    assert_ghost_matches_loop(model, x, np.random.randint(0, 3, BATCH).astype("int32"), sparse_ce)


def test_vit_image_classifier_matches_loop():
    backbone = keras_hub.models.ViTBackbone(image_shape=(8, 8, 3), patch_size=4, num_layers=1, num_heads=2,
                                            hidden_dim=8, mlp_dim=16, dropout_rate=0.0, attention_dropout=0.0)
    model = keras_hub.models.ViTImageClassifier(backbone=backbone, num_classes=3, preprocessor=None, dropout=0.0)
    x = np.random.randn(BATCH, 8, 8, 3).astype("float32")
    assert_ghost_matches_loop(model, x, np.random.randint(0, 3, BATCH).astype("int32"), sparse_ce)


def test_t5_backbone_matches_loop():
    backbone = keras_hub.models.T5Backbone(vocabulary_size=VOCABULARY, num_layers=1, num_heads=2, hidden_dim=8,
                                           intermediate_dim=16, key_value_dim=4, dropout=0.0)
    ids = np.random.randint(1, VOCABULARY, (BATCH, 5)).astype("int32")
    x = {"encoder_token_ids": ids, "encoder_padding_mask": np.ones_like(ids),
         "decoder_token_ids": ids[:, ::-1].copy(), "decoder_padding_mask": np.ones_like(ids)}
    inputs = {k: keras.Input((5,), dtype="int32", name=k) for k in x}
    outputs = backbone(inputs)["decoder_sequence_output"]
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(outputs)))
    assert_ghost_matches_loop(model, x, np.random.randint(0, 3, BATCH).astype("int32"), sparse_ce)
