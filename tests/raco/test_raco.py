"""RaCO-DP: histogram sensitivity and noise, constraint values, training under a
constraint on real data, joint accounting in the ledger, errors."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp.raco import (
    ConstraintSet, DemographicParity, EqualizedOdds, FalseNegativeRate, NoisyHistogram, RateConstrainedModel,
    RateConstraint, compute_epsilon,
)


def _probabilities(n, k, seed=0):
    return tf.nn.softmax(np.random.default_rng(seed).normal(size=(n, k)).astype("float32")).numpy()


def test_histogram_l1_sensitivity_is_at_most_one():
    layer = NoisyHistogram(num_partitions=4, noise_scale=1.0, temperature=2.0)
    p = _probabilities(30, 3)
    ids = np.random.default_rng(1).integers(0, 4, 30).astype("int32")
    full = layer.counts(p, ids).numpy()
    for removed in range(30):
        keep = np.arange(30) != removed
        without = layer.counts(p[keep], ids[keep]).numpy()
        change = np.abs(full - without).sum()
        assert change <= 1 + 1e-5 and change == pytest.approx(1.0, abs=1e-5)  # one row moves by one prob. vector


def test_histogram_laplace_noise_has_the_stated_scale():
    layer = NoisyHistogram(num_partitions=100, noise_scale=2.5)
    zeros_p = np.tile([[1.0, 0.0]], (1, 1)).astype("float32")
    noise = np.concatenate([
        (layer(zeros_p, np.array([0], "int32"), training=True, seed=tf.constant(7, tf.int64),
               step=tf.constant(s, tf.int64))
         .numpy() - layer.counts(zeros_p, np.array([0], "int32")).numpy()).ravel()
        for s in range(100)
    ])
    n = noise.size  # 20,000 draws: E|X| = b, sd(|X|) = b, so the mean of |X| has sd b/√n
    assert abs(np.abs(noise).mean() - 2.5) < 5 * 2.5 / np.sqrt(n)
    assert abs(noise.mean()) < 5 * np.sqrt(2) * 2.5 / np.sqrt(n)
    off = layer(zeros_p, np.array([0], "int32"), training=False).numpy()
    np.testing.assert_array_equal(off, layer.counts(zeros_p, np.array([0], "int32")).numpy())


def _direct_rate(p, mask):
    return p[mask].mean(axis=0)


@pytest.mark.parametrize("classes", [2, 4])
def test_constraint_values_from_clean_histogram_match_direct_computation(classes):
    n, groups = 400, 3
    rng = np.random.default_rng(2)
    p = _probabilities(n, classes, seed=3)
    z = rng.integers(0, groups, n).astype("int32")
    y = rng.integers(0, classes, n).astype("int32")

    def evaluate(constraint):
        cs = ConstraintSet([constraint], groups, classes)
        ids = cs.partitioning.ids(z, y).numpy()
        histogram = NoisyHistogram(cs.partitioning.size, 1.0).counts(p, ids)
        return cs, cs.values(histogram).numpy()

    cs, values = evaluate(DemographicParity(0.1))
    expected = [(_direct_rate(p, z == g) - _direct_rate(p, z != g))[k] for g in range(groups) for k in range(classes)]
    np.testing.assert_allclose(values, expected, atol=1e-5)

    cs, values = evaluate(EqualizedOdds(0.1))
    expected = [(_direct_rate(p, (z == g) & (y == label)) - _direct_rate(p, (z != g) & (y == label)))[k]
                for label in range(classes) for g in range(groups) for k in range(classes)]
    np.testing.assert_allclose(values, expected, atol=1e-5)

    cs, values = evaluate(FalseNegativeRate(0.2, positive_class=1))
    expected = [1 - _direct_rate(p, (z == g) & (y == 1))[1] for g in range(groups)]
    np.testing.assert_allclose(values, expected, atol=1e-5)

    cs, values = evaluate(RateConstraint([((0, 1), 0, 2.0), (2, 1, -1.0)], bound=0.3))
    expected = 2 * _direct_rate(p, (z == 0) | (z == 1))[0] - _direct_rate(p, z == 2)[1]
    np.testing.assert_allclose(values, [expected], atol=1e-5)


def _adult_subset(n=6000):
    from tf_dp.data import load_adult

    data = load_adult()
    rng = np.random.default_rng(0)
    rows = rng.permutation(len(data.y_train))[:n]
    return data.x_train[rows], data.y_train[rows], data.sensitive_train[rows]


def _train(x, y, z, max_gap, sigma=0.0, histogram_noise=1e-6, epochs=8, **compile_kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input(x.shape[1:])
    model = RateConstrainedModel(inputs, keras.layers.Dense(2, activation="softmax")(inputs))
    model.compile(optimizer=tf_dp.DPSGD(0.5, l2_norm_clip=100.0, noise_multiplier=sigma, seed=0),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                  constraints=[DemographicParity(max_gap)],
                  num_groups=2, histogram_noise=histogram_noise, dual_learning_rate=1.0, **compile_kwargs)
    history = model.fit(x, y, groups=z, batch_size=500, epochs=epochs, verbose=0, sampling_seed=0)
    p = model.predict(x, verbose=0)[:, 1]
    return model, history, abs(p[z == 0].mean() - p[z == 1].mean())


def test_training_meets_the_constraint_on_real_data_and_not_without_it():
    x, y, z = _adult_subset()
    _, _, free_gap = _train(x, y, z, max_gap=1.0)
    model, history, gap = _train(x, y, z, max_gap=0.05, epochs=25)
    assert free_gap > 0.12  # Adult's sex gap in predicted positive rate (~0.19)
    assert gap < 0.05 + 0.02  # primal-dual oscillates around γ; 0.02 slack at the last step
    assert model.multipliers.numpy().max() > 0 and "lambda_0" in history.history


def test_ledger_accounts_gaussian_and_laplace_jointly(tmp_path):
    x, y, z = _adult_subset(2000)
    model, _, _ = _train(x, y, z, max_gap=0.1, sigma=2.0, histogram_noise=2.0, epochs=1, accountant="pld", delta=1e-4)
    phase = model.privacy_ledger.phases()[0]
    assert phase.scheme == "raco_poisson" and phase.parameter == 2.0 and phase.steps == 4  # parameter: Laplace scale
    expected = compute_epsilon(2000, 500, phase.noise_multiplier, 2.0, steps=4, delta=1e-4, accountant="pld")
    assert model.get_epsilon() == pytest.approx(expected, rel=1e-6)
    gaussian_only = tf_dp.compute_epsilon(2000, 500, phase.noise_multiplier, steps=4, delta=1e-4, accountant="pld")
    assert model.get_epsilon() > gaussian_only
    model.save(tmp_path / "raco.keras")
    loaded = keras.models.load_model(tmp_path / "raco.keras")
    np.testing.assert_array_equal(loaded.multipliers.numpy(), model.multipliers.numpy())
    assert loaded.get_epsilon() == pytest.approx(model.get_epsilon())


def test_bad_inputs_are_refused():
    x, y, z = _adult_subset(600)
    inputs = keras.Input(x.shape[1:])
    model = RateConstrainedModel(inputs, keras.layers.Dense(2, activation="softmax")(inputs))
    compile_args = dict(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0), loss="sparse_categorical_crossentropy",
                        num_groups=2)
    with pytest.raises(ValueError, match="max_gap"):
        DemographicParity(-0.1)
    with pytest.raises(ValueError, match="noise_scale"):
        model.compile(**compile_args, constraints=[DemographicParity(0.1)], histogram_noise=0.0)
    model.compile(**compile_args, constraints=[DemographicParity(0.1)], histogram_noise=1.0)
    with pytest.raises(ValueError, match="num_groups"):
        model.fit(x, y, groups=np.where(z == 1, 2, z), batch_size=100, verbose=0)
    with pytest.raises(ValueError, match="absent"):
        model.fit(x, y, groups=np.zeros_like(z), batch_size=100, verbose=0)
    logits = RateConstrainedModel(inputs, keras.layers.Dense(2)(inputs))
    logits.compile(**compile_args, constraints=[DemographicParity(0.1)], histogram_noise=1.0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="probability outputs"):
        logits.fit(x, y, groups=z, batch_size=100, epochs=1, verbose=0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="partition ids must be < num_partitions"):
        NoisyHistogram(2, 1.0).counts(_probabilities(3, 2), np.array([0, 1, 5], "int32"))


def test_fixed_penalty_baseline_reduces_the_gap():
    x, y, z = _adult_subset(4000)

    def gap_with(penalty):
        keras.utils.set_random_seed(0)
        inputs = keras.Input(x.shape[1:])
        model = RateConstrainedModel(inputs, keras.layers.Dense(2, activation="softmax")(inputs))
        model.compile(optimizer=tf_dp.DPSGD(0.5, l2_norm_clip=100.0, noise_multiplier=0.0, seed=0),
                      loss="sparse_categorical_crossentropy", constraints=[DemographicParity(0.0)], num_groups=2,
                      histogram_noise=1e-6, dual_learning_rate=0.0, fixed_penalty=penalty)
        model.fit(x, y, groups=z, batch_size=500, epochs=6, verbose=0, sampling_seed=0)
        p = model.predict(x, verbose=0)[:, 1]
        return abs(p[z == 0].mean() - p[z == 1].mean())

    # A constant λ on every Γ_j would cancel (gaps of complementary groups sum to 0); the
    # hinge form must actually move the model.
    assert gap_with(3.0) < 0.5 * gap_with(0.0)
