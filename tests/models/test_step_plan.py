"""The step plan (tf_dp.models.plan): the per-call options of the traced DP step in one frozen
object held by the model; a changed plan retraces the step, an equal one does not.

References: fresh models that only ever saw one set of options (continuing the first
model's ledger, so the batch and step index agree), and a hand computation of the σ = 0
update from the class-weighted loss."""

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.harness import reference_steps
from tf_dp.accounting import PrivacyLedger
from tf_dp.clipping.engine import ONE_VIEW, AugmentationViews
from tf_dp.models.plan import StepPlan, class_weight_table

N, FEATURES, CLASSES, L, LEARNING_RATE = 32, 4, 3, 8, 0.5
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, FEATURES)).astype("float32"), rng.integers(0, CLASSES, N).astype("int32")


def model(weights=None):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    m = tf_dp.DPModel(inputs, keras.layers.Dense(CLASSES)(keras.layers.Dense(6, activation="tanh")(inputs)))
    m.compile(optimizer=tf_dp.DPSGD(LEARNING_RATE, l2_norm_clip=1e6, noise_multiplier=0.0), loss=LOSS)  # σ = 0
    if weights is not None:
        m.set_weights(weights)
    return m


def shift(x, seed):
    """A seeded per-example augmentation: each view its own noise."""
    return x + tf.random.stateless_normal(tf.shape(x), seed, stddev=0.5)


def fit(m, options, batch_size=L):
    x, y = data()
    m.fit(x, y, batch_size=batch_size, epochs=1, steps_per_epoch=1, sampling_seed=5, verbose=0, **options)


def second_fit_against_a_fresh_model(first: dict, second: dict):
    """(weights after fit(first) then fit(second) on one model, the same from a fresh model
    that only runs fit(second), from the weights and ledger the first fit left)."""
    both = model()
    fit(both, first)
    after_first = both.get_weights()
    fit(both, second)
    reference = model()
    fit(reference, first)
    fresh = model(reference.get_weights())
    fresh.continue_ledger_of(reference)  # the same step index, so the same batch and augmentation seeds
    fit(fresh, second)
    for a, b in zip(after_first, reference.get_weights()):
        np.testing.assert_array_equal(a, b)
    return both.get_weights(), fresh.get_weights(), after_first


def test_the_plan_is_frozen_and_hashable():
    plan = StepPlan(views=AugmentationViews(3, view_axis=True), class_weights=class_weight_table({1: 2.0}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.views = ONE_VIEW
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.class_weights = (1.0,)
    assert plan.class_weights == (1.0, 2.0)
    assert hash(plan) == hash(plan.replace())
    assert plan.replace(class_weights=None) != plan
    with pytest.raises(TypeError, match="class_weights"):
        StepPlan(class_weights=np.ones(3, np.float32))


def test_sample_weights_are_compared_by_nesting_not_values():
    assert StepPlan(sample_weights=np.ones(4)) == StepPlan(sample_weights=np.zeros(4))
    assert StepPlan(sample_weights=np.ones(4)) != StepPlan(sample_weights=(np.ones(4), np.ones(4)))
    assert StepPlan(sample_weights=np.ones(4)) != StepPlan()


@pytest.mark.parametrize("first, second", [
    ({"class_weight": {0: 1.0, 1: 1.0, 2: 1.0}}, {"class_weight": {0: 3.0, 1: 0.25}}),
    ({}, {"class_weight": {0: 3.0, 1: 0.25}}),
    ({"class_weight": {0: 3.0, 1: 0.25}}, {}),
    ({"augment": shift}, {"augment": shift, "augmentation_multiplicity": 3}),
    ({"augment": shift, "augmentation_multiplicity": 3}, {"augment": shift, "augmentation_multiplicity": 2}),
], ids=["class_weights", "none_then_class_weights", "class_weights_then_none", "views_1_then_3", "views_3_then_2"])
def test_a_second_fit_with_other_options_equals_a_fresh_model_with_them(first, second):
    both, fresh, before = second_fit_against_a_fresh_model(first, second)
    assert max(np.abs(a - b).max() for a, b in zip(both, before)) > 1e-4  # the second fit took a step
    for a, b in zip(both, fresh):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def hand_update(weights, class_weight: dict):
    """θ − η/L · ∇ Σ_i w_{y_i} ℓ_i over the whole data (q = 1: every example is sampled,
    σ = 0, no clipping), with a plain Keras model and tape."""
    x, y = data()
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    plain = keras.Model(inputs, keras.layers.Dense(CLASSES)(keras.layers.Dense(6, activation="tanh")(inputs)))
    plain.set_weights(weights)
    w = np.array([class_weight.get(int(label), 1.0) for label in y], np.float32)
    with tf.GradientTape() as tape:
        per_example = keras.losses.sparse_categorical_crossentropy(y, plain(x), from_logits=True)
        total = tf.reduce_sum(w * per_example)
    grads = tape.gradient(total, plain.trainable_variables)
    return [v.numpy() - LEARNING_RATE * g.numpy() / N for v, g in zip(plain.trainable_variables, grads)]


def test_the_second_fits_step_uses_the_new_class_weights():
    m = model()
    fit(m, {"class_weight": {0: 1.0, 1: 1.0, 2: 1.0}}, batch_size=N)
    before = m.get_weights()
    new = {0: 3.0, 1: 0.25}
    fit(m, {"class_weight": new}, batch_size=N)
    want = hand_update(before, new)
    for got, expected in zip(m.get_weights(), want):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    stale = hand_update(before, {})  # a step still traced with the first table would give this
    assert max(np.abs(a - b).max() for a, b in zip(want, stale)) > 1e-3


def test_only_a_different_plan_drops_the_traced_step_and_fit_restores_the_plan():
    m = model()
    x, y = data()
    m.train_on_batch(x[:L], y[:L], batch_size=L)
    traced = m.train_function
    m.step_plan = m.step_plan.replace()  # an equal plan: the trace is kept
    assert m.train_function is traced
    m.step_plan = m.step_plan.replace(class_weights=(1.0, 2.0))
    assert m.train_function is None
    plan = m.step_plan
    fit(m, {"augment": shift, "augmentation_multiplicity": 2})
    assert m.step_plan is plan  # fit's plan is for that fit only
    with pytest.raises(ZeroDivisionError):
        with m.use_plan(StepPlan(ledger=m.privacy_ledger, views=AugmentationViews(2))):
            1 / 0
    assert m.step_plan is plan
    with pytest.raises(TypeError, match="StepPlan"):
        m.step_plan = {"views": 2}


def test_continue_ledger_of_retraces_through_the_plan_and_a_replaced_ledger_is_followed_or_refused():
    x, y = data()
    source, target = model(), model()
    source.train_on_batch(x[:L], y[:L], batch_size=L)
    target.make_train_function()
    assert target.train_function is not None
    target.continue_ledger_of(source)
    assert target.step_plan.ledger is source.privacy_ledger and target.train_function is None
    target.train_on_batch(x[:L], y[:L], batch_size=L)
    assert int(source.privacy_ledger.steps.numpy()) == 2  # the retraced step counts into the shared ledger
    replaced = target.privacy_ledger = PrivacyLedger()  # by hand: the plan does not follow ...
    # ... so a step of one's own loop is refused (a second line behind the closed phase, which
    # refuses such a loop first: tests/models/test_phase_closed.py)
    with reference_steps(target), pytest.raises(RuntimeError, match="continue_ledger_of"):
        target.train_step((tf.constant(x[:L]), tf.constant(y[:L])))
    target.train_on_batch(x[:L], y[:L], batch_size=L)  # the call's plan takes the model's ledger: retraced
    assert int(replaced.steps.numpy()) == 1 and int(source.privacy_ledger.steps.numpy()) == 2
