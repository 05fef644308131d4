"""The op-level rule (tf_dp/clipping/op_rules.py): layers without a registered rule whose
variables enter only linear ops with a per-example rule get ghost norms and clipped sums from
those ops, found in the traced graph; any other layer is replayed per example, with a warning.

References: the per-example loop of tests/harness.py (norms and the clipped sum at C = the
median norm). Every layer is a custom layer written in its own style, or a Keras layer without
a registered rule (SeparableConv2D); "ghost" means no layer of the model took the per-example
replay (no SlowPathWarning), which fails on a tf_dp without the rule."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from tests.clipping.rules.models import BATCH, assert_ghost_matches_loop, assert_xla_matches_graph_mode
from tests.harness import sparse_ce
from tf_dp.clipping.engine import SlowPathWarning
from tf_dp.clipping.op_rules import OpLevelReplayWarning


class Antirectifier(keras.layers.Layer):
    """keras.io's Antirectifier: x − mean, l2-normalize, [relu(x), relu(−x)], then a kernel matmul."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1] * 2, input_shape[-1]), initializer="he_normal",
                                      name="kernel")

    def call(self, inputs):
        inputs -= ops.mean(inputs, axis=-1, keepdims=True)
        inputs = ops.normalize(inputs, axis=-1)
        concatenated = ops.concatenate([ops.relu(inputs), ops.relu(-inputs)], axis=-1)
        return ops.matmul(concatenated, self.kernel)


class EinsumScaleBias(keras.layers.Layer):
    """tf.einsum over a sequence, an element-wise scale and a bias, all variables."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 5), name="kernel")
        self.scale = self.add_weight(shape=(5,), initializer="random_normal", name="scale")
        self.bias = self.add_weight(shape=(5,), initializer="random_normal", name="bias")

    def call(self, x):
        return tf.einsum("btd,dk->btk", x, self.kernel) * self.scale + self.bias


class HeadsEinsum(keras.layers.Layer):
    """An einsum that is no Dense form (kernel axes h, d, k; d contracted): explicit per example."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(2, input_shape[-1], 3), name="kernel")

    def call(self, x):
        return ops.reshape(ops.einsum("bd,hdk->bhk", x, self.kernel), (-1, 6))


class ReadTwice(keras.layers.Layer):
    """One kernel used twice, the second time transposed: per-example gradient = sum of both uses."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], input_shape[-1]), name="kernel")
        self.bias = self.add_weight(shape=(input_shape[-1],), initializer="random_normal", name="bias")

    def call(self, x):
        hidden = tf.tanh(tf.nn.bias_add(tf.matmul(x, self.kernel), self.bias))
        return tf.matmul(hidden, self.kernel, transpose_b=True) + ops.matmul(hidden, self.kernel)


class CustomConv(keras.layers.Layer):
    """ops.conv and ops.depthwise_conv with their own kernels, a bias added by hand."""

    def build(self, input_shape):
        self.depthwise = self.add_weight(shape=(3, 3, input_shape[-1], 2), name="depthwise")
        self.kernel = self.add_weight(shape=(2, 2, input_shape[-1] * 2, 4), name="kernel")
        self.bias = self.add_weight(shape=(4,), initializer="random_normal", name="bias")

    def call(self, x):
        hidden = ops.tanh(ops.depthwise_conv(x, self.depthwise, strides=1, padding="same"))
        return ops.conv(hidden, self.kernel, strides=2, padding="valid") + self.bias


class UnderTanh(keras.layers.Layer):
    """matmul(x, tanh(W)): W enters a non-linearity, not a linear op: must be replayed."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 4), name="kernel")

    def call(self, x):
        return ops.matmul(x, ops.tanh(self.kernel))


class Squared(keras.layers.Layer):
    """matmul(x, W ** 2): must be replayed."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 4), name="kernel")

    def call(self, x):
        return ops.matmul(x, self.kernel ** 2)


class ExamplesOnAxisOne(keras.layers.Layer):
    """Moves the examples to axis 1 before the matmul (and back): the activation's axis 0 is not
    the example axis, though at P = T it has the batch's size. Must be replayed."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], input_shape[-1]), name="kernel")

    def call(self, x):
        swapped = ops.transpose(x, (1, 0, 2))
        return ops.transpose(ops.matmul(swapped, self.kernel), (1, 0, 2))


class ExamplesFolded(keras.layers.Layer):
    """Folds the positions into the example axis ([P, T, d] → [P·T, d]) for the matmul: axis 0 of
    the activation is no longer the examples. Must be replayed."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], input_shape[-1]), name="kernel")

    def call(self, x):
        return ops.reshape(ops.matmul(ops.reshape(x, (-1, x.shape[-1])), self.kernel), (-1,) + tuple(x.shape[1:]))


def model_around(layer, shape):
    keras.utils.set_random_seed(3)
    inputs = keras.Input(shape)
    hidden = keras.layers.Dense(shape[-1], activation="tanh")(inputs)
    hidden = keras.layers.Flatten()(layer(hidden))
    return keras.Model(inputs, keras.layers.Dense(3)(hidden)), np.random.default_rng(4).normal(
        size=(BATCH,) + shape).astype("float32")


GHOST = {
    "antirectifier": lambda: model_around(Antirectifier(), (8,)),
    "einsum_scale_bias": lambda: model_around(EinsumScaleBias(), (4, 6)),
    "heads_einsum": lambda: model_around(HeadsEinsum(), (5,)),
    "read_twice": lambda: model_around(ReadTwice(), (6,)),
    "custom_conv": lambda: model_around(CustomConv(), (7, 7, 3)),
    "separable_conv_same": lambda: model_around(keras.layers.SeparableConv2D(4, 3, padding="same"), (6, 6, 3)),
    "separable_conv_strided": lambda: model_around(keras.layers.SeparableConv2D(4, 3, strides=2), (7, 7, 2)),
}
REPLAYED = {
    "under_tanh": lambda: model_around(UnderTanh(), (6,)),
    "squared": lambda: model_around(Squared(), (6,)),
    "examples_on_axis_one": lambda: model_around(ExamplesOnAxisOne(), (BATCH, 5)),  # P = T
    "examples_folded": lambda: model_around(ExamplesFolded(), (3, 5)),
}


def warnings_of(model, x) -> list:
    """The warnings raised while the ghost norms and clipped sum are checked against the loop."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_ghost_matches_loop(model, x)
    return caught


def slow_path_warnings(caught: list) -> list:
    return [w for w in caught if issubclass(w.category, SlowPathWarning)]


@pytest.mark.parametrize("name", sorted(GHOST))
def test_layers_of_linear_ops_get_ghost_norms_that_match_the_loop(name):
    model, x = GHOST[name]()
    assert not slow_path_warnings(warnings_of(model, x))


@pytest.mark.parametrize("name", sorted(REPLAYED))
def test_other_layers_are_replayed_exactly_with_a_warning(name):
    model, x = REPLAYED[name]()
    caught = warnings_of(model, x)
    assert slow_path_warnings(caught)
    assert any(issubclass(w.category, OpLevelReplayWarning) for w in caught)


def test_op_level_rule_under_xla_matches_graph_mode():
    assert_xla_matches_graph_mode(GHOST["read_twice"], atol=1e-5)


class LinearWithBias(keras.layers.Layer):
    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 6), name="kernel")
        self.bias = self.add_weight(shape=(6,), initializer="random_normal", name="bias")

    def call(self, x):
        return ops.matmul(x, self.kernel) + self.bias


class BatchFreeSecondCall(keras.Model):
    """The same op-level layer called on the batch and on a batch-free tensor: the second call
    sends the layer to the per-example replay, which must replay the first call exactly too."""

    def __init__(self):
        super().__init__()
        self.hidden, self.shared, self.head = keras.layers.Dense(6), LinearWithBias(), keras.layers.Dense(3)

    def call(self, x):
        return self.head(self.shared(self.hidden(x)) + self.shared(ops.ones((1, 6))))


def test_a_layer_replayed_for_another_call_is_replayed_exactly_in_all_calls():
    keras.utils.set_random_seed(5)
    model = BatchFreeSecondCall()
    model(np.zeros((2, 6), "float32"))
    caught = warnings_of(model, np.random.default_rng(6).normal(size=(BATCH, 6)).astype("float32"))
    assert slow_path_warnings(caught)


@pytest.mark.parametrize("name", ["separable_conv_same", "read_twice", "custom_conv"])
def test_evaluation_points_at_other_weights_match_the_replay(name, monkeypatch):
    """DiSK/FIBER's observation 0.7·∇ℓ(θ + δ) + 0.3·∇ℓ(θ): the weights of the first point come
    from a StatelessScope, not from variable reads; the op-level rule gives the norms and
    clipped sums of the per-example replay of the same model (the rule switched off)."""
    from tf_dp.clipping import EvaluationPoint, clipped_gradient_sum, registry

    model, x = GHOST[name]()
    y = np.random.default_rng(0).integers(0, 3, BATCH)
    rng = np.random.default_rng(1)
    weights = [tf.constant(v + 0.1 * rng.normal(size=v.shape).astype("float32")) for v in model.trainable_variables]
    points = (EvaluationPoint(0.7, weights), EvaluationPoint(0.3))

    def clipped():
        model.__dict__.pop("_tf_dp_traced_steps", None)  # a new trace, with the rules in force now
        return clipped_gradient_sum(model, sparse_ce, tf.constant(x), tf.constant(y), tf.ones(BATCH), 0.5,
                                    points=points)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ghost = clipped()
    assert not slow_path_warnings(caught)
    monkeypatch.setattr(registry, "_OP_LEVEL", [])
    replayed = clipped()
    np.testing.assert_allclose(np.sqrt(ghost.squared_norms), np.sqrt(replayed.squared_norms), rtol=1e-5)
    for got, want in zip(ghost.clipped_sums, replayed.clipped_sums):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-6)


class KeepsItsKernel(keras.layers.Layer):
    """Keeps the value of its kernel for a later layer: a use after the call, outside the rule's view."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], input_shape[-1]), name="kernel")

    def call(self, x):
        self.kept = ops.convert_to_tensor(self.kernel)
        return ops.matmul(x, self.kept)


class UsesTheKeptKernel(keras.Model):
    def __init__(self):
        super().__init__()
        self.keeper, self.head = KeepsItsKernel(), keras.layers.Dense(3)

    def call(self, x):
        hidden = self.keeper(x)
        return self.head(ops.matmul(hidden, self.keeper.kept))


def test_a_variable_value_used_after_the_call_is_exact():
    """The later use is outside the call the rule sees: the layer must not get the op-level
    rule's norms without it (the tap sends it through the whole model), norms and clipped sum exact."""
    keras.utils.set_random_seed(7)
    model = UsesTheKeptKernel()
    model(np.zeros((2, 6), "float32"))
    warnings_of(model, np.random.default_rng(8).normal(size=(BATCH, 6)).astype("float32"))
