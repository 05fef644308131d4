"""RaCO-DP with a non-finite example: it contributes nothing, and training goes on.

A row with a NaN/Inf feature has NaN probabilities. It used to fail the histogram's
probability check at the first step that sampled it — the crash time told when that row was
sampled, and one bad row stopped training. Now it is treated as DP-SGD treats an example
whose gradient is not finite: clip factor 0 and, in the histogram, weight 0.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.harness import reference_steps
from tf_dp.raco import DemographicParity, NoisyHistogram, RateConstrainedModel

ROWS, FEATURES = 12, 4
RNG = np.random.default_rng(0)
X = RNG.normal(size=(ROWS, FEATURES)).astype("float32")
Y = RNG.integers(0, 2, ROWS).astype("int32")
GROUPS = (np.arange(ROWS) % 2).astype("int32")


def _with_bad_row(value):
    bad = np.full((1, FEATURES), 0.5, "float32")
    bad[0, 1] = value
    return np.concatenate([X, bad]), np.concatenate([Y, [1]]).astype("int32"), np.concatenate([GROUPS, [0]])


def _model(engine="ghost"):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    model = RateConstrainedModel(inputs, keras.layers.Dense(2, activation="softmax")(inputs))
    model.compile(optimizer=tf_dp.DPSGD(0.5, l2_norm_clip=1.0, noise_multiplier=0.0, seed=12345),
                  loss="sparse_categorical_crossentropy", constraints=[DemographicParity(0.01)], num_groups=2,
                  histogram_noise=0.5, dual_learning_rate=1.0, clipping_engine=engine)
    return model


def _poisson_batch(x, y, groups, expected_batch_size):
    """One Poisson batch as fit's pipeline hands it to the train step (one chunk, no padding)."""
    return {"x": tf.constant(x[None]), "y": tf.constant(y[None]), "groups": tf.constant(groups[None]),
            "mask": tf.ones([1, len(y)]), "expected_batch_size": tf.constant([expected_batch_size], tf.int64)}


def _one_step(x, y, groups, engine):
    model = _model(engine)
    with reference_steps(model):
        model.train_step(_poisson_batch(x, y, groups, ROWS))
    return [v.numpy() for v in model.trainable_variables], model.multipliers.numpy(), model


@pytest.mark.parametrize("engine", ["ghost", "vectorized"])
@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
def test_a_non_finite_row_changes_neither_the_update_nor_the_multipliers(engine, value):
    """σ = 0, same noise seed and step: the step on the batch with the bad row equals the
    step on the same batch without it (the neighbouring dataset), weights and λ alike."""
    without_weights, without_multipliers, _ = _one_step(X, Y, GROUPS, engine)
    with_weights, with_multipliers, model = _one_step(*_with_bad_row(value), engine)
    assert np.any(without_multipliers > 0)  # the histogram moved λ, so it was compared too
    for got, expected in zip(with_weights, without_weights):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(with_multipliers, without_multipliers, rtol=1e-6, atol=1e-7)
    assert float(model.nonfinite_examples.numpy()) == 1.0


def test_fit_with_a_nan_row_completes_with_finite_weights():
    x, y, groups = _with_bad_row(np.nan)
    model = _model()
    history = model.fit(x, y, groups=groups, batch_size=len(y), epochs=3, verbose=0, sampling_seed=0)
    assert len(history.history["nonfinite_examples"]) == 3 and history.history["nonfinite_examples"][-1] >= 1
    assert all(np.all(np.isfinite(v.numpy())) for v in model.trainable_variables)
    assert np.all(np.isfinite(model.multipliers.numpy()))


def test_histogram_gives_a_non_finite_row_weight_zero_and_still_checks_the_others():
    probabilities = tf.nn.softmax(RNG.normal(size=(5, 3)).astype("float32")).numpy()
    ids = np.array([0, 1, 1, 0, 1], "int32")
    layer = NoisyHistogram(2, 1.0)
    bad = probabilities.copy()
    bad[2] = [np.nan, 0.5, 0.5]
    keep = np.arange(5) != 2
    np.testing.assert_array_equal(layer.counts(bad, ids).numpy(), layer.counts(probabilities[keep], ids[keep]).numpy())
    logits = probabilities.copy()
    logits[0] = [-1.0, 2.0, 0.0]  # finite but not a probability vector: still refused
    with pytest.raises(tf.errors.InvalidArgumentError, match="probability outputs"):
        layer.counts(logits, ids)
