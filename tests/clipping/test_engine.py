"""The clipping engine (tf_dp/clipping/engine.py) across rules: the engine choice, rule
registration, each clipped contribution bounded by C, non-finite examples, ghost rules mixed
with the per-example fallback, and two-point observations clipped as one vector. Each rule's
own tests are in tests/clipping/rules/test_<rule>.py."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.clipping.rules.models import (BATCH, assert_norms_close, check_clipped_sum_matches_loop,
                                         check_nan_example_adds_zero, check_norms_agree_ghost_vectorized_loop,
                                         clipped_sum, conv_model, dense_model, mixed_model)
from tests.harness import flat_norms, loop_per_example_gradients, sparse_ce
from tf_dp.clipping import GhostRule, clipped_gradient_sum, ghost_rule_for, register_ghost_rule


@pytest.mark.parametrize("build", [mixed_model], ids=lambda f: f.__name__)
def test_norms_agree_ghost_vectorized_loop(build):
    check_norms_agree_ghost_vectorized_loop(build)


@pytest.mark.parametrize("build", [mixed_model], ids=lambda f: f.__name__)
def test_clipped_sum_matches_loop(build):
    check_clipped_sum_matches_loop(build)


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


@pytest.mark.parametrize("build", [mixed_model], ids=lambda f: f.__name__)
def test_nan_example_adds_zero_in_every_rule(build):
    check_nan_example_adds_zero(build)
