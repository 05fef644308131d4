"""tf_dp.fix replaces BatchNormalization at any depth of nested functional/Sequential
models (a backbone inside inputs → backbone → head), copies every other weight, and names
the layer (and what to do) where it cannot reach: BatchNormalization inside a custom layer."""

import importlib.util

import keras
import numpy as np
import pytest

import tf_dp

HAS_HUB = importlib.util.find_spec("keras_hub") is not None
needs_hub = pytest.mark.skipif(not HAS_HUB, reason="keras-hub is not installed (pip install 'tf-dp[hub]')")


def conv_backbone():
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(8, 3, padding="same", name="conv_a")(inputs)
    h = keras.layers.ReLU()(keras.layers.BatchNormalization(name="bn_a")(h))
    inner = keras.Sequential([keras.layers.Conv2D(16, 3, padding="same", name="conv_b"),
                              keras.layers.BatchNormalization(name="bn_b"), keras.layers.ReLU()], name="stage")
    return keras.Model(inputs, inner(h), name="backbone")


def wrapped(backbone, shape):
    inputs = keras.Input(shape)
    pooled = keras.layers.GlobalAveragePooling2D()(backbone(inputs))
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(pooled))


def all_layers(model):
    return list(model._flatten_layers(include_self=False, recursive=True))


def one_dp_step(model, shape):
    dp = tf_dp.make_private(model)
    dp.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(4, *shape)).astype("float32"), np.array([0, 1, 2, 0])
    logs = dp.train_on_batch(x, y, batch_size=4, return_dict=True)
    assert np.isfinite(logs["loss"])


def test_batch_norm_in_nested_functional_and_sequential_models_is_replaced():
    model = wrapped(conv_backbone(), (8, 8, 3))
    assert len(tf_dp.validate(model)) == 2
    fixed = tf_dp.fix(model)
    assert tf_dp.validate(fixed) == []
    layers = all_layers(fixed)
    assert not any(isinstance(layer, keras.layers.BatchNormalization) for layer in layers)
    assert sum(isinstance(layer, keras.layers.GroupNormalization) for layer in layers) == 2
    # every other layer is a copy (not the same object) with the original's weights
    originals = {layer.name: layer for layer in all_layers(model) if layer.weights and not
                 isinstance(layer, (keras.Model, keras.layers.BatchNormalization))}
    copies = {layer.name: layer for layer in layers if layer.name in originals}
    assert set(copies) == set(originals) == {"conv_a", "conv_b", "head"}
    for name, original in originals.items():
        assert copies[name] is not original
        for a, b in zip(original.get_weights(), copies[name].get_weights()):
            np.testing.assert_array_equal(a, b)
    assert any(isinstance(layer, keras.layers.BatchNormalization) for layer in all_layers(model))  # untouched
    one_dp_step(fixed, (8, 8, 3))


class BlockWithBatchNorm(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.conv = keras.layers.Conv2D(4, 3, padding="same")
        self.norm = keras.layers.BatchNormalization(name="hidden_bn")

    def call(self, inputs, training=None):
        return self.norm(self.conv(inputs), training=training)


def test_batch_norm_inside_a_custom_layer_is_named_with_what_to_do():
    inputs = keras.Input((8, 8, 3))
    backbone = keras.Model(inputs, BlockWithBatchNorm(name="block")(inputs), name="backbone")
    model = wrapped(backbone, (8, 8, 3))
    with pytest.raises(ValueError) as error:
        tf_dp.fix(model)
    message = str(error.value)
    assert "backbone/block/hidden_bn" in message and "BlockWithBatchNorm" in message
    assert "GroupNormalization" in message and "fix does it" not in message
    problem = tf_dp.validate(model)
    assert len(problem) == 1 and "fix does it" not in problem[0] and "backbone/block" in problem[0]


def resnet_backbone():
    import keras_hub
    return keras_hub.models.ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3], stackwise_num_filters=[64, 16],
        stackwise_num_blocks=[1, 1], stackwise_num_strides=[1, 2], block_type="basic_block",
        image_shape=(16, 16, 3))


def efficientnet_backbone():
    import keras_hub
    return keras_hub.models.EfficientNetBackbone(
        stackwise_kernel_sizes=[3, 3], stackwise_num_repeats=[1, 1], stackwise_input_filters=[8, 8],
        stackwise_output_filters=[8, 16], stackwise_expansion_ratios=[1, 2],
        stackwise_squeeze_and_excite_ratios=[0.0, 0.25],
        stackwise_strides=[1, 2], stackwise_block_types=["v1", "v1"], stackwise_width_coefficients=[1.0, 1.0],
        stackwise_depth_coefficients=[1.0, 1.0], input_shape=(16, 16, 3), num_features=32,
        stackwise_force_input_filters=[0, 0], stackwise_nores_option=[False, False])


@needs_hub
@pytest.mark.parametrize("make", [resnet_backbone, efficientnet_backbone], ids=["resnet", "efficientnet"])
def test_keras_hub_backbone_inside_a_wrapper_is_fixed_and_trains(make):
    model = wrapped(make(), (16, 16, 3))
    fixed = tf_dp.fix(model)
    assert tf_dp.validate(fixed) == []
    assert any(isinstance(layer, keras.layers.GroupNormalization) for layer in all_layers(fixed))
    one_dp_step(fixed, (16, 16, 3))


@needs_hub
def test_keras_hub_mobilenet_batch_norm_in_its_own_layer_classes_is_a_clear_error():
    import keras_hub
    backbone = keras_hub.models.MobileNetBackbone(
        stackwise_expansion=[[1], [4]], stackwise_num_blocks=[1, 1], stackwise_num_filters=[[8], [16]],
        stackwise_kernel_size=[[3], [3]], stackwise_num_strides=[[2], [2]], stackwise_se_ratio=[[0.25], [0.25]],
        stackwise_activation=[["relu"], ["hard_swish"]], stackwise_padding=[[1], [1]], output_num_filters=32,
        depthwise_filters=8, depthwise_stride=2, depthwise_residual=False, last_layer_filter=32,
        image_shape=(16, 16, 3))
    with pytest.raises(ValueError) as error:
        tf_dp.fix(wrapped(backbone, (16, 16, 3)))
    message = str(error.value)
    assert "mobile_net_backbone/block_0_0/block_0_0_bn1" in message and "DepthwiseConvBlock" in message
    assert "fix does it" not in message


def test_inserted_group_norms_use_the_group_norm_ghost_rule_exactly():
    """The stand-ins fix inserts (channels last, axis 3 on keras-hub's BatchNorm too) take
    GroupNormalization's ghost rule, not the per-example replay; norms match a loop."""
    import tensorflow as tf

    from tf_dp.clipping import clipped_gradient_sum, ghost_rule_for
    from tf_dp.clipping.normalization import GroupNormalizationRule

    fixed = tf_dp.fix(wrapped(conv_backbone(), (8, 8, 3)))
    norms = [layer for layer in all_layers(fixed) if isinstance(layer, keras.layers.GroupNormalization)]
    assert norms and all(isinstance(ghost_rule_for(layer), GroupNormalizationRule) for layer in norms)
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(5, 8, 8, 3)).astype("float32"), np.array([0, 1, 2, 0, 1])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    want = []
    for i in range(5):
        with tf.GradientTape() as tape:
            value = loss(y[i:i + 1], fixed(x[i:i + 1], training=True))
        want.append(np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2)
                                for g in tape.gradient(value, fixed.trainable_variables))))
    per_example = lambda t, p: keras.losses.sparse_categorical_crossentropy(t, p, from_logits=True)  # noqa: E731
    result = clipped_gradient_sum(fixed, per_example, tf.constant(x), tf.constant(y), tf.ones([5]), 1e9)
    got = np.sqrt(result.squared_norms.numpy())
    assert np.linalg.norm(got - np.array(want)) / np.linalg.norm(want) <= 1e-4
