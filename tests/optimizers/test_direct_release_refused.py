"""A DP optimizer draws noise only inside a model's train function (issue 31, the phase rule).

Before, ``optimizer.apply_private_gradients(zeros, variables, L, dp_step=0)`` called by hand after
training redrew step 0's noise with the same key: the difference of two such releases cancels the
noise (correlation 1.000000 with the released step). Now the call raises on the host before
anything is drawn, eagerly and when traced in a tf.function of one's own; a test's reference
computation opens the window explicitly (tests.harness.drawing_noise), and even then a step the
key has already drawn is refused.

Independent check: the released noise of step 0 is recovered from the weights (zero inputs, so
the clipped sum is 0 and θ₁ − θ₀ = −lr·z₀/L), and a direct redraw, where the test lets one
happen, is compared with it."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.harness import drawing_noise

L, SIGMA, CLIP = 8, 1.0, 1.0


def _trained_on_zeros(steps=2):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(16, use_bias=False)(inputs))
    model.compile(optimizer=tf_dp.DPSGD(1.0, l2_norm_clip=CLIP, noise_multiplier=SIGMA, seed=2**40 + 7), loss="mse")
    x, y = np.zeros((L, 64), "float32"), np.zeros((L, 16), "float32")
    start = model.get_weights()[0].copy()
    model.train_on_batch(x, y, batch_size=L)
    released = start - model.get_weights()[0]  # z₀ / L: zero inputs give a zero clipped sum
    for _ in range(steps - 1):
        model.train_on_batch(x, y, batch_size=L)
    return model, released


def _direct(model, dp_step):
    zeros = [tf.zeros_like(v) for v in model.trainable_variables]
    model.optimizer.apply_private_gradients(zeros, model.trainable_variables, float(L), dp_step=dp_step)


def test_the_released_noise_is_real():
    _, released = _trained_on_zeros()
    assert np.std(released) == pytest.approx(SIGMA * CLIP / L, rel=0.1)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf_function"])
def test_a_direct_call_after_training_is_refused_and_releases_nothing(traced):
    model, _ = _trained_on_zeros()
    before = [w.copy() for w in model.get_weights()]
    call = tf.function(lambda: _direct(model, tf.constant(0, tf.int64))) if traced else (lambda: _direct(model, 0))
    with pytest.raises(RuntimeError, match="outside a DP step"):
        call()
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_a_step_the_key_has_drawn_is_refused_even_inside_a_window():
    model, released = _trained_on_zeros()
    with drawing_noise(model.optimizer), pytest.raises(RuntimeError, match="already drawn"):
        _direct(model, 0)


def test_what_the_window_guards_against_a_redraw_cancels_the_released_noise():
    """The harm, shown with a fresh optimizer of the same seed (no watermark to refuse it):
    its step 0 is the released step 0's noise exactly."""
    model, released = _trained_on_zeros(steps=1)
    twin = tf_dp.DPSGD(1.0, l2_norm_clip=CLIP, noise_multiplier=SIGMA, seed=2**40 + 7)
    variable = keras.Variable(np.zeros((64, 16), "float32"))
    with drawing_noise(twin):
        twin.apply_private_gradients([tf.zeros((64, 16))], [variable], float(L), dp_step=0)
    assert np.corrcoef(-variable.numpy().ravel(), released.ravel())[0, 1] > 0.999999
