"""The privatizing step: clip bound, noise scale and denominator agree with the math."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.harness import drawing_noise, flat_norms, loop_per_example_gradients, reference_steps, sparse_ce
from tf_dp.optimizers import corrected_adam_direction


def small_model(units=3, features=4):
    inputs = keras.Input((features,))
    return tf_dp.DPModel(inputs, keras.layers.Dense(units)(inputs))


def weights(model):
    return [v.numpy().copy() for v in model.trainable_variables]


def test_sigma_zero_step_equals_hand_computed_clipped_update():
    model = small_model()
    x = np.random.randn(5, 4).astype("float32")
    x[2] *= 1e4  # gradient norm ≈ 1000× C, must be clipped to C
    y = np.array([0, 1, 2, 0, 1], "int32")
    clip, lr = 0.5, 0.1
    per_example = loop_per_example_gradients(model, x, y)
    norms = flat_norms(per_example)
    assert norms[2] > 1000 * clip
    before = weights(model)
    model.compile(optimizer=tf_dp.DPSGD(lr, l2_norm_clip=clip, noise_multiplier=0.0), loss=sparse_ce)
    model.train_on_batch(x, y, batch_size=len(y))
    for v, (after, start) in enumerate(zip(weights(model), before)):
        clipped_sum = sum(min(1.0, clip / norms[i]) * per_example[i][v] for i in range(5))
        np.testing.assert_allclose(after, start - lr * clipped_sum / 5, rtol=1e-5, atol=1e-6)


def _noise_only_model(units):
    """A model whose every gradient is exactly zero, so an update is pure noise."""
    inputs = keras.Input((1,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(units, kernel_initializer="zeros")(inputs))
    x = np.zeros((8, 1), "float32")  # zero input: kernel gradient 0
    return model, x


@pytest.mark.parametrize("jit_compile", [False, True])
def test_noise_std_on_average_is_sigma_clip_over_batch(jit_compile):
    units, sigma, clip, lr = 20000, 1.3, 0.7, 1.0
    model, x = _noise_only_model(units)
    # Loss with zero gradient everywhere: MSE at the target equal to the prediction (0).
    model.compile(optimizer=tf_dp.DPSGD(lr, l2_norm_clip=clip, noise_multiplier=sigma, seed=3), loss="mse",
                  jit_compile=jit_compile)
    y = np.zeros((8, units), "float32")
    before = weights(model)[1]
    model.train_on_batch(x, y, batch_size=len(y))
    step = (weights(model)[1] - before) / lr
    expected = sigma * clip / 8  # σ·C/L with L = 8, the explicit batch size
    # The sample std of n = 20000 normals has relative std 1/sqrt(2n) = 0.5 %; 5 sd = 2.5 %.
    assert abs(step.std() / expected - 1) < 5 / np.sqrt(2 * units)
    assert abs(step.mean()) < 5 * expected / np.sqrt(units)
    # Gaussian shape (TF's Philox kernel, or XLA's under jit_compile): the share beyond 2 sd is
    # p = 0.0455 with binomial sd sqrt(p(1 - p)/n) = 0.0015; 5 sd.
    tail = np.mean(np.abs(step) > 2 * expected)
    assert abs(tail - 0.0455) < 5 * np.sqrt(0.0455 * 0.9545 / units)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_two_steps_draw_different_noise_and_seed_reproduces(jit_compile):
    def updates(seed):
        model, x = _noise_only_model(50)
        model.compile(optimizer=tf_dp.DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=1.0, seed=seed), loss="mse",
                      jit_compile=jit_compile)
        y = np.zeros((8, 50), "float32")
        out = []
        for _ in range(2):
            before = weights(model)[1]
            model.train_on_batch(x, y, batch_size=len(y))
            out.append(weights(model)[1] - before)
        return out

    first, second = updates(7)
    assert not np.allclose(first, second)
    np.testing.assert_array_equal(updates(7)[0], first)
    assert not np.allclose(updates(8)[0], first)


def test_unseeded_optimizers_draw_fresh_noise():
    a = tf_dp.DPSGD(0.1, noise_multiplier=1.0)
    b = tf_dp.DPSGD(0.1, noise_multiplier=1.0)
    assert a.seed is None and not np.array_equal(a._noise_key().numpy(), b._noise_key().numpy())


def test_poisson_step_divides_by_expected_not_realized_batch_size():
    """A Poisson batch that happens to hold 3 real rows is still averaged by L = 10."""
    model = small_model()
    lr, clip = 0.1, 1e6
    model.compile(optimizer=tf_dp.DPSGD(lr, l2_norm_clip=clip, noise_multiplier=0.0), loss=sparse_ce)
    x = np.random.randn(5, 4).astype("float32")
    y = np.array([0, 1, 2, 0, 1], "int32")
    mask = np.array([1, 1, 1, 0, 0], "float32")
    per_example = loop_per_example_gradients(model, x, y)
    before = weights(model)
    batch = {"x": x[None], "y": y[None], "mask": mask[None], "expected_batch_size": np.array([10.0], "float32")}
    with reference_steps(model):
        model.train_step(tf.nest.map_structure(tf.constant, batch))
    for v, (after, start) in enumerate(zip(weights(model), before)):
        np.testing.assert_allclose(after, start - lr * sum(per_example[i][v] for i in range(3)) / 10,
                                   rtol=1e-5, atol=1e-7)


def test_dp_optimizer_on_plain_keras_model_raises():
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0), loss=sparse_ce)
    with pytest.raises(TypeError, match="refuses raw gradients"):
        model.train_on_batch(np.zeros((2, 4), "float32"), np.zeros(2, "int32"))


def test_plain_optimizer_on_dp_model_raises():
    with pytest.raises(TypeError, match="differentially private optimizer"):
        small_model().compile(optimizer=keras.optimizers.SGD(0.1), loss=sparse_ce)


@pytest.mark.parametrize("kwargs, match", [
    ({"l2_norm_clip": 0.0}, "l2_norm_clip"),
    ({"l2_norm_clip": -1.0}, "l2_norm_clip"),
    ({"noise_multiplier": -0.1}, "noise_multiplier"),
    ({"seed": 1.5}, "seed"),
])
def test_bad_dp_arguments_are_named(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        tf_dp.DPSGD(0.1, **{"noise_multiplier": 1.0, **kwargs})


@pytest.mark.parametrize("cls, extra", [
    (tf_dp.DPSGD, {"momentum": 0.9, "nesterov": True}),
    (tf_dp.DPAdam, {"noise_bias_correction": True, "variance_floor": 1e-6}),
    (tf_dp.DPAdamW, {"weight_decay": 0.01, "noise_bias_correction": True}),
])
def test_config_round_trip(cls, extra):
    optimizer = cls(learning_rate=0.01, l2_norm_clip=0.8, noise_multiplier=1.2, seed=11, **extra)
    config = optimizer.get_config()
    clone = cls.from_config(config)
    assert clone.get_config() == config
    assert config["l2_norm_clip"] == pytest.approx(0.8) and config["noise_multiplier"] == pytest.approx(1.2)
    assert isinstance(clone, keras.optimizers.Optimizer)


def test_adam_without_correction_matches_keras_adam():
    """DP-Adam with σ = 0 and no clipping is Keras Adam on the mean gradient."""
    x = np.random.randn(6, 4).astype("float32")
    y = np.random.randint(0, 3, 6).astype("int32")
    dp_model = small_model()
    inputs = keras.Input((4,))
    plain = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    plain.set_weights(dp_model.get_weights())
    dp_model.compile(optimizer=tf_dp.DPAdam(0.01, l2_norm_clip=1e9, noise_multiplier=0.0), loss=sparse_ce)
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss=sparse_ce)
    for _ in range(3):
        dp_model.train_on_batch(x, y, batch_size=len(y))
        plain.train_on_batch(x, y)
    for a, b in zip(dp_model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_noise_bias_correction_subtracts_sigma_w_squared():
    m = tf.constant([0.02, -0.01])
    v = tf.constant([1e-3, 1e-6])
    step, noise_var, floor = 5, 4e-4, 1e-7
    got = corrected_adam_direction(m, v, step, 0.9, 0.999, 1e-8, noise_var, floor).numpy()
    m_hat = m.numpy() / (1 - 0.9**step)
    v_bar = np.maximum(v.numpy() / (1 - 0.999**step) - noise_var, floor)
    np.testing.assert_allclose(got, m_hat / (np.sqrt(v_bar) + 1e-8), rtol=1e-5)
    assert v_bar[1] == floor  # the floor binds when the noise dominates


def test_dpadamw_bias_correction_uses_this_steps_sigma_w():
    """One DP-AdamBC step reproduced by hand, σ_w = σC/L read from the real step."""
    model, x = _noise_only_model(4)
    sigma, clip, lr = 2.0, 0.5, 0.01
    model.compile(
        optimizer=tf_dp.DPAdamW(lr, l2_norm_clip=clip, noise_multiplier=sigma, seed=5, weight_decay=0.0,
                                noise_bias_correction=True, variance_floor=1e-9),
        loss="mse",
    )
    before = weights(model)[1]
    model.train_on_batch(x, np.zeros((8, 4), "float32"), batch_size=8)
    g = tf_dp.DPSGD(1.0, l2_norm_clip=clip, noise_multiplier=sigma, seed=5)
    replica = [keras.Variable(np.zeros((1, 4), "float32")), keras.Variable(np.zeros(4, "float32"))]
    with drawing_noise(g):
        g.apply_private_gradients([tf.zeros((1, 4)), tf.zeros(4)], replica, 8.0, dp_step=0)  # the model's step 0
    ghat = -replica[1].numpy()  # θ = 0 − 1·ĝ
    sigma_w2 = (sigma * clip / 8) ** 2
    m_hat, v_hat = ghat, ghat**2
    expected = before - lr * m_hat / (np.sqrt(np.maximum(v_hat - sigma_w2, 1e-9)) + 1e-7)
    np.testing.assert_allclose(weights(model)[1], expected, rtol=1e-4, atol=1e-7)


def test_accumulated_chunks_equal_one_pass_on_the_same_batch():
    """A logical batch processed as 3 physical chunks of 4 equals one chunk of 12 (σ = 0):
    clipped sums accumulate, noise and the update happen once, the ledger counts one step."""
    x = np.random.randn(12, 4).astype("float32")
    x[5] *= 50.0
    y = np.random.randint(0, 3, 12).astype("int32")
    mask = np.ones(12, "float32")
    mask[-2:] = 0.0  # padding inside the last chunk
    results = []
    for chunks in (1, 3):
        keras.utils.set_random_seed(0)
        model = small_model()
        model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=0.3, noise_multiplier=0.0), loss=sparse_ce)
        model._prebuild(x, y)
        batch = {"x": x.reshape(chunks, -1, 4), "y": y.reshape(chunks, -1), "mask": mask.reshape(chunks, -1),
                 "expected_batch_size": np.full(chunks, 10.0, "float32")}
        with reference_steps(model):
            tf.function(model.train_step)(tf.nest.map_structure(tf.constant, batch))
        results.append((weights(model), int(model.privacy_ledger.steps.numpy()),
                        int(model.optimizer.iterations.numpy())))
    (single, steps_1, iters_1), (accumulated, steps_3, iters_3) = results
    for a, b in zip(single, accumulated):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert steps_1 == steps_3 == 1 and iters_1 == iters_3 == 1
