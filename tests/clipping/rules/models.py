"""Shared by the rule tests (tests/clipping/rules/test_<rule>.py, one file per rule module of
tf_dp/clipping/) and the engine tests: small Keras models exercising each rule, and the comparison
of a rule's per-example norms and clipped sum against the per-example loop of tests/harness.py."""

import keras
import numpy as np
import tensorflow as tf

from tests.harness import flat_norms, loop_per_example_gradients, sparse_ce
from tf_dp.clipping import clipped_gradient_sum, ghost_rule_for

BATCH = 6


def dense_model():
    inputs = keras.Input((7,))
    hidden = keras.layers.Dense(5, activation="tanh")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3)(hidden)), np.random.randn(BATCH, 7).astype("float32")


def dense_sequence_model():
    inputs = keras.Input((4, 6))
    hidden = keras.layers.Dense(5, activation="relu")(inputs)  # Dense on a sequence axis
    hidden = keras.layers.Dense(40, use_bias=False)(hidden)  # wide: takes the explicit (non-Gram) branch
    outputs = keras.layers.Dense(3)(keras.layers.Flatten()(hidden))
    return keras.Model(inputs, outputs), np.random.randn(BATCH, 4, 6).astype("float32")


def embedding_model():
    inputs = keras.Input((5,), dtype="int32")
    hidden = keras.layers.Embedding(11, 4)(inputs)
    hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(6, activation="relu")(hidden))
    ids = np.random.randint(0, 11, (BATCH, 5)).astype("int32")
    ids[0, :3] = 2  # repeated ids within one example exercise the cross terms
    return keras.Model(inputs, keras.layers.Dense(3)(hidden)), ids


def mixed_model():
    """Ghost rules (Embedding, Conv1D, LayerNorm, Dense) mixed with a per-example fallback
    (PReLU has trainable weights and no rule)."""
    inputs = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Embedding(9, 8)(inputs)
    hidden = keras.layers.Conv1D(4, 3)(hidden)
    hidden = keras.layers.PReLU()(hidden)
    hidden = keras.layers.LayerNormalization()(hidden)
    hidden = keras.layers.Dense(5, activation="relu")(keras.layers.Flatten()(hidden))
    return keras.Model(inputs, keras.layers.Dense(3)(hidden)), np.random.randint(0, 9, (BATCH, 6)).astype("int32")


def conv_model():
    inputs = keras.Input((9, 9, 2))
    hidden = keras.layers.Conv2D(3, 3, strides=2, padding="same", activation="relu")(inputs)
    hidden = keras.layers.Conv2D(4, 2, padding="valid", dilation_rate=1)(hidden)
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(hidden)))
    return model, np.random.randn(BATCH, 9, 9, 2).astype("float32")


def single_channel_conv_model():
    """C_in = 1 (the grouped route, where its kernel exists) with stride, both paddings, Conv1D, and a layer
    called twice (two recordings)."""
    inputs = keras.Input((9, 9, 1))
    shared = keras.layers.Conv2D(3, 3, strides=2, padding="same", activation="relu")
    hidden = keras.layers.Concatenate()([shared(inputs), shared(inputs * 0.5)])
    line = keras.layers.Conv1D(2, 3, strides=2, padding="valid")(keras.layers.Reshape((81, 1))(inputs))
    merged = keras.layers.Concatenate()([keras.layers.Flatten()(hidden), keras.layers.Flatten()(line)])
    return keras.Model(inputs, keras.layers.Dense(3)(merged)), np.random.randn(BATCH, 9, 9, 1).astype("float32")


def conv1d_model():
    inputs = keras.Input((10, 3))
    hidden = keras.layers.Conv1D(4, 3, strides=2, padding="same", activation="tanh")(inputs)
    hidden = keras.layers.Conv1D(2, 2, dilation_rate=2, use_bias=False)(hidden)
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(hidden)))
    return model, np.random.randn(BATCH, 10, 3).astype("float32")


def grouped_conv_model():
    """groups > 1: Conv2D and Conv1D, one of them without bias (per-group Dense forms)."""
    inputs = keras.Input((7, 7, 4))
    hidden = keras.layers.Conv2D(6, 3, groups=2, padding="same", activation="tanh")(inputs)
    hidden = keras.layers.Conv2D(4, 2, strides=2, groups=2, use_bias=False)(hidden)
    line = keras.layers.Conv1D(4, 3, groups=4)(keras.layers.Reshape((9, 4))(hidden))
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(line)))
    return model, np.random.randn(BATCH, 7, 7, 4).astype("float32")


def layer_norm_model():
    inputs = keras.Input((4, 6))
    hidden = keras.layers.LayerNormalization()(keras.layers.Dense(5)(inputs))
    hidden = keras.layers.LayerNormalization(center=False)(keras.layers.Dense(3)(keras.layers.Flatten()(hidden)))
    return keras.Model(inputs, hidden), np.random.randn(BATCH, 4, 6).astype("float32")


def attention_model():
    inputs = keras.Input((5,), dtype="int32")
    hidden = keras.layers.Embedding(13, 8)(inputs)
    hidden = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(hidden, hidden)
    hidden = keras.layers.EinsumDense("abc,cd->abd", output_shape=(None, 6), bias_axes="d", activation="relu")(hidden)
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(hidden))
    return keras.Model(inputs, outputs), np.random.randint(0, 13, (BATCH, 5)).astype("int32")


def token_loss(y, logits):
    """Cross-entropy of a language model's next-token logits, averaged over the sequence."""
    return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True), axis=-1)


def uses_rule(model, layer_type):
    """Every layer of ``layer_type`` in ``model`` has a ghost rule (and there is one)."""
    layers = [layer for layer in model._flatten_layers() if isinstance(layer, layer_type)]
    return layers and all(ghost_rule_for(layer) is not None for layer in layers)


def assert_norms_close(engine_squared, true_norms, margin=1e-4):
    """The engine's clip norms are upper bounds of the true norms (never below, up to float32
    rounding of the reported value) and above them by less than ``margin`` (relative): the
    rounding bound over T positions adds ~T·2⁻²⁴·Σ_t‖a_t‖‖s_t‖ (tf_dp/clipping/rounding.py)."""
    got = np.sqrt(np.asarray(engine_squared, np.float64))
    np.testing.assert_array_less(true_norms * (1 - 1e-6), got)
    np.testing.assert_allclose(got, true_norms, rtol=margin)


def clipped_sum(per_example, engine_squared, clip, weights=None):
    """Σ_i w_i · min(1, C / U_i) · g_i with U_i the engine's clip norms (assert_norms_close
    checks those separately), one array per variable."""
    norms = np.sqrt(np.asarray(engine_squared, np.float64))
    weights = np.ones(len(norms)) if weights is None else weights
    factors = [min(1.0, clip / norm) if norm > 0 else 1.0 for norm in norms]
    return [sum(factors[i] * weights[i] * per_example[i][v] for i in range(len(norms)))
            for v in range(len(per_example[0]))]


def assert_ghost_matches_loop(model, x, y=None, loss=sparse_ce):
    """Ghost norms and the clipped sum (C = median norm, so half the batch is clipped)
    equal a Python loop over single examples (labels drawn in [0, 3) unless given)."""
    batch = len(tf.nest.flatten(x)[0])
    y = np.random.randint(0, 3, batch).astype("int32") if y is None else y
    per_example = loop_per_example_gradients(model, x, y, loss)
    norms = flat_norms(per_example)
    clip = float(np.median(norms))
    result = clipped_gradient_sum(model, loss, tf.nest.map_structure(tf.constant, x), tf.constant(y),
                                  tf.ones(batch), clip)
    assert_norms_close(result.squared_norms.numpy(), norms)
    for got, want in zip(result.clipped_sums, clipped_sum(per_example, result.squared_norms.numpy(), clip)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-6)


def assert_xla_matches_graph_mode(build, atol):
    """The norms and clipped sums (C = 0.5) of ``build()``'s model under XLA equal graph mode's."""
    model, x = build()
    y = np.random.randint(0, 3, BATCH).astype("int32")

    def clipped(x, y):
        result = clipped_gradient_sum(model, sparse_ce, x, y, tf.ones(BATCH), 0.5)
        return result.squared_norms, result.clipped_sums

    graph, xla = tf.function(clipped)(x, y), tf.function(clipped, jit_compile=True)(x, y)
    for a, b in zip(tf.nest.flatten(graph), tf.nest.flatten(xla)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=atol)


# Test bodies shared by the rule files: each file parametrizes them over its own rule's models.

def check_norms_agree_ghost_vectorized_loop(build):
    model, x = build()
    if build is mixed_model:
        assert any(ghost_rule_for(layer) is None for layer in model.layers if layer.trainable_weights)
    y = np.random.randint(0, 3, BATCH).astype("int32")
    mask = tf.ones(BATCH)
    loop = flat_norms(loop_per_example_gradients(model, x, y))
    for engine in ("ghost", "vectorized"):
        result = clipped_gradient_sum(model, sparse_ce, tf.constant(x), tf.constant(y), mask, 1e9, engine=engine)
        # float32 sums of O(100) terms: relative error ~1e-6; 1e-4 leaves margin but
        # catches any missing cross term (those are O(1) relative).
        assert_norms_close(result.squared_norms.numpy(), loop)


def check_clipped_sum_matches_loop(build):
    model, x = build()
    y = np.random.randint(0, 3, BATCH).astype("int32")
    per_example = loop_per_example_gradients(model, x, y)
    norms = flat_norms(per_example)
    clip = float(np.median(norms))  # half the examples are clipped
    mask = np.ones(BATCH, "float32")
    mask[-1] = 0.0  # a padded row must contribute nothing
    result = clipped_gradient_sum(model, sparse_ce, tf.constant(x), tf.constant(y), tf.constant(mask), clip)
    assert_norms_close(result.squared_norms.numpy()[:-1], norms[:-1])  # the padded row has no gradient
    for got, want in zip(result.clipped_sums, clipped_sum(per_example, result.squared_norms.numpy(), clip, mask)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-6)


def check_every_layer_has_a_rule_and_matches_loop(build):
    model, x = build()
    assert all(ghost_rule_for(layer) is not None for layer in model.layers if layer.trainable_weights)
    assert_ghost_matches_loop(model, x)


def check_nan_example_adds_zero(build):
    # Example 0's loss is NaN, so every layer's output gradients (ghost forms, explicit
    # products, grouped route, per-example fallback) hold NaN in row 0: its clip factor is 0
    # and the sums must equal the clean sums over examples 1..5 exactly (0 · NaN must not leak).
    model, x = build()
    y = np.random.randint(0, 3, BATCH).astype("int32")
    poison = tf.constant([np.nan] + [1.0] * (BATCH - 1))

    def poisoned_ce(labels, logits):
        return sparse_ce(labels, logits) * poison[:tf.shape(labels)[0]]

    clean = clipped_gradient_sum(model, sparse_ce, tf.constant(x[1:]), tf.constant(y[1:]), tf.ones(BATCH - 1), 0.5)
    result = clipped_gradient_sum(model, poisoned_ce, tf.constant(x), tf.constant(y), tf.ones(BATCH), 0.5)
    for got, want in zip(result.clipped_sums, clean.clipped_sums):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    assert float(result.nonfinite_count(tf.ones(BATCH))) == 1.0


def check_frozen_weights_do_not_enter_per_example_norms(freeze):
    inputs = keras.Input((8,))
    dense = keras.layers.Dense(4)
    norm = keras.layers.LayerNormalization()
    model = keras.Model(inputs, keras.layers.Dense(3)(norm(dense(inputs))))
    if freeze == "lora":
        dense.enable_lora(2)
        dense.lora_kernel_b.assign(tf.ones_like(dense.lora_kernel_b))
    elif freeze == "bias":
        dense.bias.trainable = False
    else:
        norm.beta.trainable = False
    x = np.random.randn(BATCH, 8).astype("float32")
    y = np.random.randint(0, 3, BATCH).astype("int32")
    loop = flat_norms(loop_per_example_gradients(model, x, y))
    for engine in ("ghost", "vectorized"):
        result = clipped_gradient_sum(model, sparse_ce, tf.constant(x), tf.constant(y), tf.ones(BATCH), 1e9,
                                      engine=engine)
        assert_norms_close(result.squared_norms.numpy(), loop)
