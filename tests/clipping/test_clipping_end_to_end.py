"""Clipping policies and the adaptive bound through a DP optimizer and train_on_batch
(docs/algorithms.md §12, §13), against per-example loops and dp_accounting."""

import inspect
import math

import dp_accounting
import keras
import numpy as np
import pytest

import tf_dp
from tests.harness import flat_norms, loop_per_example_gradients, sparse_ce
from tf_dp.clipping import AdaptiveClip, PerLayer

pytestmark = pytest.mark.skipif("clipping" not in inspect.signature(tf_dp.DPSGD.__init__).parameters,
                                reason="needs the DPOptimizer(inner) wrapper with clipping= (branch h/optimizer)")
BATCH = 8


def two_layer_model():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(5, activation="tanh", name="first")(inputs)
    return tf_dp.DPModel(inputs, keras.layers.Dense(3, name="head")(hidden))


def test_adaptive_bound_moves_by_the_quantile_rule():
    """σ = 0 and σ_b = 0: C_1 = C_0·exp(−η(b − γ)), b the loop's fraction of norms ≤ C_0."""
    model = two_layer_model()
    x, y = np.random.randn(BATCH, 4).astype("float32"), np.random.randint(0, 3, BATCH).astype("int32")
    norms = flat_norms(loop_per_example_gradients(model, x, y))
    initial = float(np.median(norms)) * 0.8
    adaptive = AdaptiveClip(initial, target_quantile=0.5, learning_rate=0.3, count_stddev=0.0)
    model.compile(optimizer=tf_dp.DPSGD(0.0, l2_norm_clip=adaptive, noise_multiplier=0.0), loss=sparse_ce)
    model.train_on_batch(x, y, batch_size=BATCH)
    below = np.mean(norms <= initial)
    assert model.optimizer.l2_norm_clip == pytest.approx(initial * math.exp(-0.3 * (below - 0.5)), rel=1e-5)


def test_epsilon_with_an_adaptive_bound_is_the_ledgers_sigma():
    x, y = np.random.randn(64, 4).astype("float32"), np.random.randint(0, 3, 64).astype("int32")
    sigma, steps = 1.2, 3
    epsilons = []
    for clip in (1.0, AdaptiveClip(1.0)):
        model = two_layer_model()
        model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=clip, noise_multiplier=sigma), loss=sparse_ce,
                      delta=1e-5)
        for _ in range(steps):
            model.train_on_batch(x, y, batch_size=64)
        epsilons.append(model.get_epsilon())
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(sigma), steps)
    assert epsilons[1] == pytest.approx(epsilons[0], rel=1e-12)
    assert epsilons[1] == pytest.approx(accountant.get_epsilon(1e-5), rel=0.05)


def test_gradient_noise_std_is_sigma_delta_times_c_over_l():
    """Zero gradients: the update is the noise, std σ_Δ·C/L with σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2)."""
    units, sigma, count_stddev = 4000, 1.3, 0.9
    inputs = keras.Input((1,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(units, kernel_initializer="zeros")(inputs))
    adaptive = AdaptiveClip(0.5, count_stddev=count_stddev)
    model.compile(optimizer=tf_dp.DPSGD(1.0, l2_norm_clip=adaptive, noise_multiplier=sigma), loss="mse")
    before = model.get_weights()[1]
    model.train_on_batch(np.zeros((BATCH, 1), "float32"), np.zeros((BATCH, units), "float32"), batch_size=BATCH)
    sigma_delta = (sigma ** -2 - (2 * count_stddev) ** -2) ** -0.5
    measured = (model.get_weights()[1] - before).std()
    assert abs(measured / (sigma_delta * 0.5 / BATCH) - 1) < 5 / np.sqrt(2 * units)


def test_per_layer_policy_through_the_optimizer_matches_a_loop():
    """σ = 0, SGD with rate 1: θ_1 − θ_0 = −(1/L) Σ_i Σ_k min(1, C_k/‖g_i^k‖) g_i^k."""
    model = two_layer_model()
    x, y = np.random.randn(BATCH, 4).astype("float32"), np.random.randint(0, 3, BATCH).astype("int32")
    per_example = loop_per_example_gradients(model, x, y)
    bounds = {"first": 0.05, "head": 0.2}
    groups = [[0, 1], [2, 3]]  # first/kernel, first/bias, head/kernel, head/bias
    expected = [np.zeros_like(g, np.float64) for g in per_example[0]]
    for grads in per_example:
        for indices, bound in zip(groups, bounds.values()):
            norm = math.sqrt(sum(float(np.sum(grads[j].astype(np.float64) ** 2)) for j in indices))
            for j in indices:
                expected[j] += min(1.0, bound / norm) * grads[j]
    before = [v.numpy() for v in model.trainable_variables]
    model.compile(optimizer=tf_dp.DPSGD(1.0, l2_norm_clip=math.sqrt(0.05 ** 2 + 0.2 ** 2), noise_multiplier=0.0,
                                        clipping=PerLayer(bounds)), loss=sparse_ce)
    model.train_on_batch(x, y, batch_size=BATCH)
    for v, b, e in zip(model.trainable_variables, before, expected):
        np.testing.assert_allclose(b - v.numpy(), e / BATCH, rtol=2e-4, atol=1e-7)


def test_fit_logs_the_adaptive_bound_of_each_epoch_and_no_bound_when_fixed():
    """C_t is public: History's ``l2_norm_clip`` is the optimizer's bound read at each epoch's end."""

    class ReadBound(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.bounds = []

        def on_epoch_end(self, epoch, logs=None):
            self.bounds.append(self.model.optimizer.l2_norm_clip)

    x, y = np.random.randn(64, 4).astype("float32"), np.random.randint(0, 3, 64).astype("int32")
    for clip in (AdaptiveClip(0.01, learning_rate=0.5), 1.0):
        model, read = two_layer_model(), ReadBound()
        model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=clip, noise_multiplier=1.0), loss=sparse_ce)
        history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[read])
        if isinstance(clip, AdaptiveClip):
            assert history.history["l2_norm_clip"] == pytest.approx(read.bounds, rel=1e-6)
            assert read.bounds[-1] != pytest.approx(0.01)  # the bound moved
        else:
            assert "l2_norm_clip" not in history.history
