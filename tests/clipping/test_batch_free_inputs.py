"""Layers applied to tensors that do not depend on the batch (docs/algorithms.md §6): a [T] position
range, a [K, f] table of class features. Which tensors carry the example axis is decided from
how they were computed, never from their leading size, so these layers get exact per-example
gradients whether that size equals the batch size P or not.

Patterns: keras.io's ``TokenAndPositionEmbedding`` (text classification with a transformer,
miniature GPT: ``pos_emb(range(maxlen))`` added to the token embeddings), a Dense over a
positional table added to the activations, and a prototype head ``h · Dense(classes)ᵀ``.
References are independent: a tf.GradientTape per example, and the clipped sums of
neighbouring batches (σ = 0).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.harness import flat_norms, loop_per_example_gradients, sparse_ce
from tf_dp.clipping import clipped_gradient_sum, per_example_gradient_norms

ENGINES = ("ghost", "vectorized")
STEPS, VOCABULARY, WIDTH, CLASSES = 6, 11, 8, 3
CLIP = 0.05


class TokenAndPositionEmbedding(keras.layers.Layer):
    """keras.io's layer: token embeddings plus the embeddings of positions 0..T-1."""

    def __init__(self, maxlen, vocab_size, embed_dim, positions_from_shape=True, **kwargs):
        super().__init__(**kwargs)
        self.maxlen, self.positions_from_shape = maxlen, positions_from_shape
        self.token_emb = keras.layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = keras.layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = keras.ops.shape(x)[-1] if self.positions_from_shape else self.maxlen
        positions = tf.range(start=0, limit=maxlen, delta=1)
        positions = self.pos_emb(positions)
        x = self.token_emb(x)
        return x + positions


class PositionalTable(keras.layers.Layer):
    """x + Dense(table): a Dense over a constant [T, f] table, broadcast to the batch."""

    def __init__(self, steps, features, width, **kwargs):
        super().__init__(**kwargs)
        self.table = np.random.default_rng(5).normal(size=(steps, features)).astype("float32")
        self.project = keras.layers.Dense(width, activation="tanh")

    def call(self, x):
        return x + self.project(keras.ops.convert_to_tensor(self.table))


class PrototypeHead(keras.layers.Layer):
    """logits = h · Dense(class_features)ᵀ: a Dense applied to a constant [K, f] table."""

    def __init__(self, classes, features, width, **kwargs):
        super().__init__(**kwargs)
        self.class_features = np.random.default_rng(6).normal(size=(classes, features)).astype("float32")
        self.embed = keras.layers.Dense(width)

    def call(self, h):
        prototypes = self.embed(keras.ops.convert_to_tensor(self.class_features))
        return tf.matmul(h, prototypes, transpose_b=True)


def text_classifier(positions_from_shape=True):
    """keras.io's text classifier (transformer block cut to one attention layer)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((STEPS,), dtype="int32")
    x = TokenAndPositionEmbedding(STEPS, VOCABULARY, WIDTH, positions_from_shape)(inputs)
    x = x + keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(x, x)
    x = keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(WIDTH, activation="relu")(x))
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(x))


def positional_dense_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((STEPS, WIDTH))
    x = PositionalTable(STEPS, 5, WIDTH)(keras.layers.Dense(WIDTH)(inputs))
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(x))


def prototype_model(classes):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((WIDTH,))
    h = keras.layers.Dense(WIDTH, activation="tanh")(inputs)
    return keras.Model(inputs, PrototypeHead(classes, 5, WIDTH)(h))


def token_data(examples):
    rng = np.random.default_rng(examples)
    return rng.integers(0, VOCABULARY, (examples, STEPS)).astype("int32"), rng.integers(0, CLASSES, examples)


def dense_data(examples, shape=(STEPS, WIDTH), classes=CLASSES):
    rng = np.random.default_rng(examples)
    return rng.normal(size=(examples, *shape)).astype("float32"), rng.integers(0, classes, examples)


# name → (model, x, y); the batch P equals the batch-free leading size (T or K) or not
CASES = {
    "token_and_position_P_eq_T": lambda: (text_classifier(), *token_data(STEPS)),
    "token_and_position_P_ne_T": lambda: (text_classifier(), *token_data(STEPS + 3)),
    "constant_positions_P_eq_T": lambda: (text_classifier(False), *token_data(STEPS)),
    "positional_dense_P_eq_T": lambda: (positional_dense_model(), *dense_data(STEPS)),
    "positional_dense_P_ne_T": lambda: (positional_dense_model(), *dense_data(STEPS - 2)),
    "prototype_K_eq_P": lambda: (prototype_model(6), *dense_data(6, (WIDTH,), 6)),
    "prototype_K_ne_P": lambda: (prototype_model(4), *dense_data(7, (WIDTH,), 4)),
}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_per_example_norms_match_a_per_example_loop(case, engine):
    model, x, y = CASES[case]()
    expected = flat_norms(loop_per_example_gradients(model, tf.constant(x), tf.constant(y)))

    def per_example(y_true, y_pred):
        return sparse_ce(y_true, y_pred)

    total, _ = per_example_gradient_norms(model, per_example, x, y, engine=engine)
    np.testing.assert_allclose(total.numpy(), expected, rtol=1e-5)


def weighted_ce(targets, y_pred):
    labels, weights = targets
    return weights * sparse_ce(labels, y_pred)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_one_example_with_weight_100_moves_the_clipped_sum_by_at_most_clip(case, engine):
    """σ = 0: the released sum of a batch and of the same batch without example k differ by
    c_k g_k, which clipping bounds by C — for every k, each weighted 100 in turn."""
    model, x, y = CASES[case]()
    examples = len(y)

    @tf.function
    def clipped_sum(mask, weights):
        result = clipped_gradient_sum(model, weighted_ce, tf.constant(x), (tf.constant(y), weights), mask,
                                      tf.constant(CLIP), engine=engine)
        return result.clipped_sums

    worst = 0.0
    for k in range(examples):
        weights = np.ones(examples, "float32")
        weights[k] = 100.0
        without = np.ones(examples, "float32")
        without[k] = 0.0
        with_k = clipped_sum(tf.ones(examples), tf.constant(weights))
        without_k = clipped_sum(tf.constant(without), tf.constant(weights))
        moved = np.sqrt(sum(np.sum((a.numpy().astype(np.float64) - b.numpy()) ** 2) for a, b in zip(with_k, without_k)))
        worst = max(worst, moved / CLIP)
    assert worst <= 1 + 1e-5, f"one example moved the clipped sum by {worst:.4g}·C"
    assert worst > 0.99, "example gradients were expected to exceed the clip norm"


def test_mixed_batched_and_batch_free_arguments_take_the_exact_route():
    """A layer called with a batched tensor and a batch-free [K, f] one of the same leading size
    (K = P): the batch-free one must not be sliced per example."""
    class Bilinear(keras.layers.Layer):
        def build(self, input_shape):
            self.w = self.add_weight(shape=(WIDTH, 5), initializer="glorot_uniform")

        def call(self, h, table):
            return tf.matmul(tf.matmul(h, self.w), table, transpose_b=True)

    class Head(keras.layers.Layer):
        def __init__(self, table, **kwargs):
            super().__init__(**kwargs)
            self.table, self.bilinear = table, Bilinear()

        def call(self, h):
            return self.bilinear(h, keras.ops.convert_to_tensor(self.table))

    keras.utils.set_random_seed(0)
    inputs = keras.Input((WIDTH,))
    h = keras.layers.Dense(WIDTH, activation="tanh")(inputs)
    model = keras.Model(inputs, Head(np.random.default_rng(8).normal(size=(6, 5)).astype("float32"))(h))
    x, y = dense_data(6, (WIDTH,), 6)
    expected = flat_norms(loop_per_example_gradients(model, tf.constant(x), tf.constant(y)))
    total, per_layer = per_example_gradient_norms(model, sparse_ce, x, y, engine="ghost")
    assert len(per_layer) == 2  # the bilinear weight is trained
    np.testing.assert_allclose(total.numpy(), expected, rtol=1e-5)
