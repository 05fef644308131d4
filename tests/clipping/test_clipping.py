"""Per-example norms and clipped sums: ghost == vectorized_map == a Python loop."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.harness import flat_norms, loop_per_example_gradients, sparse_ce
from tf_dp.clipping import GhostRule, clipped_gradient_sum, ghost_rule_for, register_ghost_rule

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


MODELS = [dense_model, dense_sequence_model, embedding_model, mixed_model]


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


@pytest.mark.parametrize("build", MODELS, ids=lambda f: f.__name__)
def test_norms_agree_ghost_vectorized_loop(build):
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


@pytest.mark.parametrize("build", MODELS, ids=lambda f: f.__name__)
def test_clipped_sum_matches_loop(build):
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


def test_each_clipped_contribution_is_bounded_by_clip():
    model, x = dense_model()
    y = np.random.randint(0, 3, BATCH).astype("int32")
    x[0] *= 1000.0  # gradient norm far above C
    clip = 1e-3
    for i in range(BATCH):
        mask = np.zeros(BATCH, "float32")
        mask[i] = 1.0
        result = clipped_gradient_sum(model, sparse_ce, tf.constant(x), tf.constant(y), tf.constant(mask), clip)
        norm = np.sqrt(sum(float(tf.reduce_sum(tf.square(g))) for g in result.clipped_sums))
        assert norm <= clip * (1 + 1e-5)


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
    _assert_ghost_matches_loop(model, x)


def test_register_rule_validates_arguments():
    with pytest.raises(TypeError, match="layer_class"):
        register_ghost_rule("Dense", None)
    with pytest.raises(TypeError, match="GhostRule"):
        register_ghost_rule(keras.layers.Dense, object())
    assert issubclass(type(ghost_rule_for(keras.layers.Dense(2))), GhostRule)


def test_unknown_engine_is_refused():
    model, x = dense_model()
    with pytest.raises(ValueError, match="engine"):
        clipped_gradient_sum(model, sparse_ce, x, np.zeros(BATCH, "int32"), tf.ones(BATCH), 1.0, engine="fast")


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


@pytest.mark.parametrize("build", [single_channel_conv_model, conv_model], ids=lambda f: f.__name__)
def test_grouped_route_in_example_groups_matches_loop(monkeypatch, build):
    # Large physical batches are cut into groups of examples for the grouped-convolution
    # call; groups of 4 and a remainder must give the same norms and sums as the loop.
    from tf_dp.clipping import conv

    monkeypatch.setattr(conv, "_EXAMPLES_PER_CALL", 4)  # BATCH = 6: groups of 4 and 2
    monkeypatch.setattr(conv, "_GROUPED_MAX_CHANNELS", 16)  # also C_in = 2 (conv_model)
    model, x = build()
    _assert_ghost_matches_loop(model, x)


def test_gram_form_beyond_the_memory_budget_matches_loop(monkeypatch):
    # Per-example kernel gradients over the budget: unfolded patches, Gram form only (never
    # the explicit [P, d, k] products), for conv layers and Dense on sequences alike.
    from tf_dp.clipping import dense

    monkeypatch.setattr(dense, "EXPLICIT_FLOATS", 0)
    explicit = []
    monkeypatch.setattr(dense.DenseContribution, "_per_example_kernel_grads",
                        lambda self: explicit.append(self) or pytest.fail("explicit form over the budget"))
    for build in (conv_model, single_channel_conv_model, dense_sequence_model):
        model, x = build()
        _assert_ghost_matches_loop(model, x)
    assert not explicit


def test_conv_rules_under_xla_match_graph_mode(monkeypatch):
    # Under XLA the conv rule takes the unfolded route (the grouped filter gradient's XLA CPU
    # kernel is pathologically slow); both routes must give the same norms and sums.
    from tf_dp.clipping import conv

    routes = []
    choose = conv._uses_grouped_route
    monkeypatch.setattr(conv, "_uses_grouped_route", lambda *args: routes.append(choose(*args)) or routes[-1])
    for build in (conv_model, single_channel_conv_model):
        model, x = build()
        y = np.random.randint(0, 3, BATCH).astype("int32")

        def clipped(x, y):
            result = clipped_gradient_sum(model, sparse_ce, x, y, tf.ones(BATCH), 0.5)
            return result.squared_norms, result.clipped_sums

        graph, xla = tf.function(clipped)(x, y), tf.function(clipped, jit_compile=True)(x, y)
        for a, b in zip(tf.nest.flatten(graph), tf.nest.flatten(xla)):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-6)
    grouped_kernel = conv.grouped_conv_filter_gradient_available()  # oneDNN off: unfolded everywhere
    assert False in routes and (True in routes) == grouped_kernel


def test_embedding_and_attention_rules_under_xla_match_graph_mode():
    # The Embedding rule groups repeated ids without tf.unique, so it compiles under XLA.
    for build in (embedding_model, attention_model):
        model, x = build()
        y = np.random.randint(0, 3, BATCH).astype("int32")

        def clipped(x, y):
            result = clipped_gradient_sum(model, sparse_ce, x, y, tf.ones(BATCH), 0.5)
            return result.squared_norms, result.clipped_sums

        graph, xla = tf.function(clipped)(x, y), tf.function(clipped, jit_compile=True)(x, y)
        for a, b in zip(tf.nest.flatten(graph), tf.nest.flatten(xla)):  # XLA fuses attention differently
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5)


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


def test_without_grouped_kernel_every_conv_takes_the_unfolded_route(monkeypatch):
    # Where TensorFlow has no grouped filter-gradient kernel (oneDNN off), the single-channel
    # layers that would take the grouped route are unfolded instead; force that on any machine.
    from tf_dp.clipping import conv

    monkeypatch.setattr(conv, "grouped_conv_filter_gradient_available", lambda: False)
    routes = []
    choose = conv._uses_grouped_route
    monkeypatch.setattr(conv, "_uses_grouped_route", lambda *args: routes.append(choose(*args)) or routes[-1])
    model, x = single_channel_conv_model()
    _assert_ghost_matches_loop(model, x)
    assert routes and not any(routes)


def layer_norm_model():
    inputs = keras.Input((4, 6))
    hidden = keras.layers.LayerNormalization()(keras.layers.Dense(5)(inputs))
    hidden = keras.layers.LayerNormalization(center=False)(keras.layers.Dense(3)(keras.layers.Flatten()(hidden)))
    return keras.Model(inputs, hidden), np.random.randn(BATCH, 4, 6).astype("float32")


def _assert_ghost_matches_loop(model, x):
    """Ghost norms and the clipped sum (C = median norm, so half the batch is clipped)
    equal a Python loop over single examples."""
    y = np.random.randint(0, 3, BATCH).astype("int32")
    per_example = loop_per_example_gradients(model, x, y)
    norms = flat_norms(per_example)
    clip = float(np.median(norms))
    result = clipped_gradient_sum(model, sparse_ce, tf.constant(x), tf.constant(y), tf.ones(BATCH), clip)
    assert_norms_close(result.squared_norms.numpy(), norms)
    for got, want in zip(result.clipped_sums, clipped_sum(per_example, result.squared_norms.numpy(), clip)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("build", [conv_model, single_channel_conv_model, conv1d_model, grouped_conv_model,
                                   layer_norm_model],
                         ids=lambda f: f.__name__)
def test_conv_ghost_rule_matches_loop(build):
    model, x = build()
    assert all(ghost_rule_for(layer) is not None for layer in model.layers if layer.trainable_weights)
    _assert_ghost_matches_loop(model, x)


def _loop_at(model, x, y, weights):
    originals = [v.numpy() for v in model.trainable_variables]
    for v, w in zip(model.trainable_variables, weights):
        v.assign(w)
    try:
        return loop_per_example_gradients(model, x, y)
    finally:
        for v, w in zip(model.trainable_variables, originals):
            v.assign(w)


@pytest.mark.parametrize("build", [dense_model, mixed_model, conv_model], ids=lambda f: f.__name__)
@pytest.mark.parametrize("engine", ["ghost", "vectorized"])
def test_two_point_observation_is_clipped_as_one_vector(build, engine):
    """u_i = c·∇ℓ(θ+γd; x_i) + (1−c)·∇ℓ(θ; x_i), combined BEFORE clipping (DiSK/FIBER)."""
    from tf_dp.clipping import EvaluationPoint

    model, x = build()
    y = np.random.randint(0, 3, BATCH).astype("int32")
    shifted = [v.numpy() + 0.3 * np.random.randn(*v.shape).astype("float32") for v in model.trainable_variables]
    c = 1.7  # c = (1−κ)/(κγ) may exceed 1: then 1 − c < 0
    at_shift, at_current = _loop_at(model, x, y, shifted), loop_per_example_gradients(model, x, y)
    u = [[c * a + (1 - c) * b for a, b in zip(at_shift[i], at_current[i])] for i in range(BATCH)]
    norms = flat_norms(u)
    clip = float(np.median(norms))
    points = (EvaluationPoint(c, [tf.constant(w) for w in shifted]), EvaluationPoint(1 - c))
    result = clipped_gradient_sum(model, sparse_ce, tf.constant(x), tf.constant(y), tf.ones(BATCH), clip,
                                  engine=engine, points=points)
    assert_norms_close(result.squared_norms.numpy(), norms)
    for got, want in zip(result.clipped_sums, clipped_sum(u, result.squared_norms.numpy(), clip)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-5)


def test_nonfinite_example_contributes_zero_and_is_counted():
    model, x = dense_model()
    y = np.random.randint(0, 3, BATCH).astype("int32")
    clean = clipped_gradient_sum(model, sparse_ce, tf.constant(x[1:]), tf.constant(y[1:]), tf.ones(BATCH - 1), 0.5)
    poisoned = x.copy()
    poisoned[0, 0] = np.nan
    for engine in ("ghost", "vectorized"):
        result = clipped_gradient_sum(model, sparse_ce, tf.constant(poisoned), tf.constant(y), tf.ones(BATCH), 0.5,
                                      engine=engine)
        for got, want in zip(result.clipped_sums, clean.clipped_sums):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-7)
        assert float(result.nonfinite_count(tf.ones(BATCH))) == 1.0


@pytest.mark.parametrize("build", MODELS + [conv_model, single_channel_conv_model, layer_norm_model],
                         ids=lambda f: f.__name__)
def test_nan_example_adds_zero_in_every_rule(build):
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


@pytest.mark.parametrize("freeze", ["lora", "bias", "layer_norm_beta"])
def test_frozen_weights_do_not_enter_per_example_norms(freeze):
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
    _assert_ghost_matches_loop(model, ids)


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
    _assert_ghost_matches_loop(model, x)


def attention_model():
    inputs = keras.Input((5,), dtype="int32")
    hidden = keras.layers.Embedding(13, 8)(inputs)
    hidden = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(hidden, hidden)
    hidden = keras.layers.EinsumDense("abc,cd->abd", output_shape=(None, 6), bias_axes="d", activation="relu")(hidden)
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(hidden))
    return keras.Model(inputs, outputs), np.random.randint(0, 13, (BATCH, 5)).astype("int32")


def test_einsum_dense_and_attention_use_ghost_rules_and_match_loop():
    from tf_dp.clipping.einsum_dense import dense_form

    assert dense_form("abc,cde->abde") == (1, 2) and dense_form("abcd,cde->abe") == (2, 1)
    assert dense_form("ab,bc->ac") == (1, 1) and dense_form("...b,bc->...c") == (1, 1)
    assert dense_form("abc,dc->abd") is None  # transposed kernel: not a Dense form
    model, x = attention_model()
    einsums = [layer for layer in model._flatten_layers() if isinstance(layer, keras.layers.EinsumDense)]
    assert len(einsums) == 5 and all(ghost_rule_for(layer) is not None for layer in einsums)
    _assert_ghost_matches_loop(model, x)
