"""clipped_gradient_sum called eagerly after a layer is frozen or unfrozen (issue 31 item 10):
its traced graph is per trainable-variable set, so norms and sums follow the variables that are
trainable NOW. Reference: a per-example tf.GradientTape loop over model.trainable_variables."""

import keras
import numpy as np
import tensorflow as tf

from tests.harness import flat_norms, loop_per_example_gradients, sparse_ce
from tf_dp.clipping import clipped_gradient_sum

EXAMPLES = 8


def _model_and_data():
    rng = np.random.default_rng(31)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(6, activation="tanh", name="hidden"),
                              keras.layers.Dense(3, name="head")])
    x = rng.normal(size=(EXAMPLES, 5)).astype("float32")
    y = rng.integers(0, 3, EXAMPLES).astype("int32")
    return model, x, y


def _check_against_loop(model, x, y, engine):
    """Norms (clip huge: factor 1) and clipped sums (clip at the median norm) vs the loop."""
    per_example = loop_per_example_gradients(model, x, y)
    norms = flat_norms(per_example)
    mask = tf.ones([EXAMPLES])
    unclipped = clipped_gradient_sum(model, sparse_ce, tf.constant(x), tf.constant(y), mask, 1e9, engine=engine)
    np.testing.assert_allclose(np.sqrt(unclipped.squared_norms.numpy()), norms, rtol=1e-4)
    clip = float(np.median(norms))
    result = clipped_gradient_sum(model, sparse_ce, tf.constant(x), tf.constant(y), mask, clip, engine=engine)
    assert len(result.clipped_sums) == len(model.trainable_variables)
    factors = np.minimum(1.0, clip / norms)
    for k, (variable, total) in enumerate(zip(model.trainable_variables, result.clipped_sums)):
        expected = sum(factors[i] * per_example[i][k] for i in range(EXAMPLES))
        assert tuple(total.shape) == tuple(variable.shape)
        np.testing.assert_allclose(total.numpy(), expected, rtol=2e-4, atol=1e-6)


def test_freezing_and_unfreezing_a_layer_between_calls_follows_the_trainable_set():
    model, x, y = _model_and_data()
    hidden = model.get_layer("hidden")
    for engine in ("ghost", "vectorized"):
        hidden.trainable = True
        _check_against_loop(model, x, y, engine)  # first call: traces with 4 variables
        hidden.trainable = False
        _check_against_loop(model, x, y, engine)  # 2 variables: the head only
        hidden.trainable = True
        _check_against_loop(model, x, y, engine)  # 4 again: the unfrozen layer has its share
