"""The DepthwiseConv2D rule (tf_dp/clipping/depthwise_conv.py): strides, both paddings and a
depth multiplier against the per-example loop; a dilated layer takes the per-example replay."""

import keras
import numpy as np
import pytest

from tests.clipping.rules.models import assert_ghost_matches_loop, uses_rule

BATCH, CLASSES = 4, 3


@pytest.mark.parametrize("strides, padding, dilation", [(1, "same", 1), (2, "valid", 1), (1, "valid", 2)])
def test_depthwise_conv2d_rule_matches_loop(strides, padding, dilation):
    inputs = keras.Input((7, 7, 3))
    hidden = keras.layers.DepthwiseConv2D(3, strides=strides, padding=padding, depth_multiplier=2,
                                          dilation_rate=dilation, activation="tanh")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(CLASSES)(keras.layers.Flatten()(hidden)))
    assert uses_rule(model, keras.layers.DepthwiseConv2D) == (dilation == 1)  # dilated: per-example replay
    assert_ghost_matches_loop(model, np.random.randn(BATCH, 7, 7, 3).astype("float32"))
