"""The LoRA forms of the Dense, EinsumDense and Embedding rules (tf_dp/clipping/lora.py):
adapter gradients against the per-example loop, the frozen base kernel left out of the norms."""

import keras
import numpy as np
import pytest

from tests.clipping.rules.models import (BATCH, assert_ghost_matches_loop, attention_model,
                                         check_frozen_weights_do_not_enter_per_example_norms)
from tf_dp.clipping import ghost_rule_for


def lora_model():
    """LoRA adapters on a flat Dense and on a Dense applied to a sequence twice (shared);
    B made non-zero so both adapter gradients are non-trivial."""
    inputs = keras.Input((4, 6))
    sequence = keras.layers.Dense(5, activation="tanh")
    flat = keras.layers.Dense(3)
    hidden = keras.layers.Flatten()(keras.layers.Concatenate(axis=1)([sequence(inputs), sequence(inputs * 2.0)]))
    model = keras.Model(inputs, flat(hidden))
    for layer, rank in ((sequence, 2), (flat, 3)):
        layer.enable_lora(rank, lora_alpha=4)
        layer.lora_kernel_b.assign(np.random.randn(*layer.lora_kernel_b.shape).astype("float32"))
    return model, np.random.randn(BATCH, 4, 6).astype("float32")


def test_lora_ghost_rule_matches_loop():
    model, x = lora_model()
    assert {v.name for v in model.trainable_variables} == {"lora_kernel_a", "lora_kernel_b", "bias"}
    assert all(ghost_rule_for(layer) is not None for layer in model.layers if layer.trainable_weights)
    assert_ghost_matches_loop(model, x)


@pytest.mark.parametrize("freeze", ["lora"])
def test_frozen_weights_do_not_enter_per_example_norms(freeze):
    check_frozen_weights_do_not_enter_per_example_norms(freeze)


def test_lora_embedding_ghost_rule_matches_loop():
    """LoRA on an Embedding called twice (shared; repeated ids within an example exercise
    the cross terms of both adapter forms), next to a LoRA Dense on the sequence."""
    inputs = keras.Input((5,), dtype="int32")
    embedding = keras.layers.Embedding(11, 6)
    dense = keras.layers.Dense(4, activation="tanh")
    hidden = keras.layers.Concatenate(axis=1)([embedding(inputs), embedding(10 - inputs)])
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(dense(hidden)))
    model = keras.Model(inputs, outputs)
    for layer in (embedding, dense):
        layer.enable_lora(2, lora_alpha=3)
    embedding.lora_embeddings_b.assign(np.random.randn(2, 6).astype("float32"))
    dense.lora_kernel_b.assign(np.random.randn(2, 4).astype("float32"))
    ids = np.random.randint(0, 11, (BATCH, 5)).astype("int32")
    ids[0, :3] = 4
    assert {"lora_embeddings_a", "lora_embeddings_b"} <= {v.name for v in model.trainable_variables}
    assert ghost_rule_for(embedding) is not None
    assert_ghost_matches_loop(model, ids)


def test_lora_einsum_dense_ghost_rule_matches_loop():
    """LoRA on every EinsumDense of a MultiHeadAttention block (query/key/value: kernel
    [d, heads, key_dim]; output: [heads, key_dim, d]) and on a plain EinsumDense."""
    model, x = attention_model()
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, keras.layers.EinsumDense):
            layer.enable_lora(2, lora_alpha=3)
            layer.lora_kernel_b.assign(np.random.randn(*layer.lora_kernel_b.shape).astype("float32"))
    einsum_layers = [l for l in model._flatten_layers(include_self=False) if isinstance(l, keras.layers.EinsumDense)]
    assert len(einsum_layers) == 5 and all(ghost_rule_for(l) is not None for l in einsum_layers)
    assert_ghost_matches_loop(model, x)
