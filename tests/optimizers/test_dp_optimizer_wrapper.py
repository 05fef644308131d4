"""tf_dp.DPOptimizer(inner): any Keras optimizer, privatized — checked against stock Keras
optimizers run on the same privatized gradient, the accountant, and a per-example loop."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.harness import drawing_noise, flat_norms, loop_per_example_gradients, reference_steps, sparse_ce
from tf_dp.optimizers import DPOptimizer

INNERS = {"lion": lambda: keras.optimizers.Lion(3e-3), "rmsprop": lambda: keras.optimizers.RMSprop(3e-3)}


def _small_model(seed=0, units=3, features=4):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((features,))
    return tf_dp.DPModel(inputs, keras.layers.Dense(units)(inputs))


def _noise_only_model(units):
    """Zero input, zero kernel, MSE at target 0: every gradient is exactly zero."""
    inputs = keras.Input((1,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(units, kernel_initializer="zeros")(inputs))
    return model, np.zeros((8, 1), "float32"), np.zeros((8, units), "float32")


def test_dp_rmsprop_with_sigma_zero_and_no_clipping_is_keras_rmsprop_on_the_mean_gradient():
    x = np.random.randn(6, 4).astype("float32")
    y = np.random.randint(0, 3, 6).astype("int32")
    private = _small_model()
    inputs = keras.Input((4,))
    plain = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    plain.set_weights(private.get_weights())
    private.compile(optimizer=DPOptimizer(keras.optimizers.RMSprop(0.01), l2_norm_clip=1e9, noise_multiplier=0.0),
                    loss=sparse_ce)
    plain.compile(optimizer=keras.optimizers.RMSprop(0.01), loss=sparse_ce)
    for _ in range(3):
        private.train_on_batch(x, y, batch_size=len(y))
        plain.train_on_batch(x, y)
    for a, b in zip(private.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(INNERS))
def test_wrapped_step_is_the_keras_optimizer_on_the_privatized_gradient(name):
    """ĝ = N(0, σ²C²)/L is reproduced by a DPSGD(1.0) with the same key at the same DP step
    (θ = 0 − ĝ); the stock Keras optimizer applied to ĝ must give the DP model's step."""
    units, sigma, clip, seed = 64, 1.5, 0.8, 2**40 + 3
    model, x, y = _noise_only_model(units)
    model.compile(optimizer=DPOptimizer(INNERS[name](), l2_norm_clip=clip, noise_multiplier=sigma, seed=seed),
                  loss="mse")
    start = [w.copy() for w in model.get_weights()]
    model.train_on_batch(x, y, batch_size=8)
    probe = tf_dp.DPSGD(1.0, l2_norm_clip=clip, noise_multiplier=sigma, seed=seed)
    zeros = [keras.Variable(np.zeros_like(w)) for w in start]
    with drawing_noise(probe):
        probe.apply_private_gradients([tf.zeros_like(w) for w in start], zeros, 8.0, dp_step=0)
    privatized = [-v.numpy() for v in zeros]
    assert np.std(privatized[1]) == pytest.approx(sigma * clip / 8, rel=0.3)
    reference = [keras.Variable(w) for w in start]
    INNERS[name]().apply(privatized, reference)
    for got, want in zip(model.get_weights(), reference):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-6, atol=1e-7)
    assert not np.allclose(model.get_weights()[1], start[1])


def _separable(n=512, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    return x, (x[:, 0] + 0.5 * x[:, 1] > 0).astype("int32")


@pytest.mark.parametrize("name", sorted(INNERS))
def test_dp_lion_and_dp_rmsprop_train_privately_through_fit(name):
    x, y = _separable()
    model = _small_model(units=2)
    inner = {"lion": keras.optimizers.Lion(0.03), "rmsprop": keras.optimizers.RMSprop(0.03)}[name]
    model.compile(optimizer=DPOptimizer(inner, l2_norm_clip=1.0, noise_multiplier=0.8), loss=sparse_ce,
                  metrics=["accuracy"], delta=1e-5)
    before = model.evaluate(x, y, verbose=0, return_dict=True)["accuracy"]
    model.fit(x, y, batch_size=64, epochs=4, verbose=0)
    steps = int(model.privacy_ledger.steps.numpy())
    assert steps == 4 * 512 // 64 == int(model.optimizer.iterations.numpy())
    assert model.get_epsilon() == pytest.approx(tf_dp.compute_epsilon(
        512, 64, model.optimizer.noise_multiplier, steps=steps, delta=1e-5),
                                                rel=1e-9)
    after = model.evaluate(x, y, verbose=0, return_dict=True)["accuracy"]
    assert after > 0.85 and after > before + 0.1, (before, after)


def test_wrapper_saves_loads_and_resumes_with_the_inner_in_its_config(tmp_path):
    x, y = _separable(128)
    model = _small_model(units=2)
    model.compile(optimizer=DPOptimizer(keras.optimizers.Lion(1e-3), l2_norm_clip=0.7, noise_multiplier=1.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    config = model.optimizer.get_config()
    assert config["inner_optimizer"]["class_name"] == "Lion" and config["seed"] is None
    assert config["l2_norm_clip"] == pytest.approx(0.7) and config["noise_multiplier"] == pytest.approx(1.1)
    clone = DPOptimizer.from_config(config)
    assert clone.get_config() == config and isinstance(clone.inner_optimizer, keras.optimizers.Lion)
    model.save(tmp_path / "lion.keras")
    loaded = keras.models.load_model(tmp_path / "lion.keras")
    assert type(loaded.optimizer) is DPOptimizer and isinstance(loaded.optimizer.inner_optimizer, keras.optimizers.Lion)
    assert int(loaded.optimizer.iterations.numpy()) == 4 == int(loaded.privacy_ledger.steps.numpy())
    assert len(loaded.optimizer.variables) == len(model.optimizer.variables) == 5 + 2
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    loaded.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert int(loaded.optimizer.iterations.numpy()) == 8


def test_raw_gradients_and_bad_inner_optimizers_are_refused():
    optimizer = DPOptimizer(keras.optimizers.Lion(), noise_multiplier=1.0)
    variable = keras.Variable(np.zeros(2, "float32"))
    with pytest.raises(TypeError, match="refuses raw gradients"):
        optimizer.apply([tf.ones(2)], [variable])
    with pytest.raises(TypeError, match="refuses raw gradients"):
        optimizer.apply_gradients([(tf.ones(2), variable)])
    with pytest.raises(TypeError, match="noise twice"):
        DPOptimizer(tf_dp.DPSGD(0.1, noise_multiplier=1.0))
    with pytest.raises(TypeError, match="keras.optimizers.Optimizer"):
        DPOptimizer("lion")
    built = keras.optimizers.SGD()
    built.build([variable])
    with pytest.raises(ValueError, match="already built"):
        DPOptimizer(built)
    with pytest.raises(ValueError, match="inner optimizer"):
        DPOptimizer(keras.optimizers.SGD(), use_ema=True)
    assert isinstance(tf_dp.DiSK(noise_multiplier=1.0), tf_dp.optimizers.DPOptimizer)


def test_keras_base_options_are_the_inner_optimizers():
    optimizer = tf_dp.DPSGD(0.1, noise_multiplier=1.0, use_ema=True, ema_momentum=0.9, weight_decay=0.01)
    assert optimizer.use_ema and optimizer.ema_momentum == 0.9 and optimizer.weight_decay == 0.01
    optimizer.learning_rate = 0.05
    assert float(optimizer.inner_optimizer.learning_rate) == pytest.approx(0.05)
    optimizer.build([keras.Variable(np.zeros(3, "float32"))])
    assert len(optimizer._model_variables_moving_average) == 1  # Keras' EMA lives in the inner optimizer
    assert not any(v.path.endswith("_average") for v in optimizer._variables)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        tf_dp.FIBER(noise_multiplier=1.0, gradient_accumulation_steps=2)


class _MaxNormBound:
    """A stand-in adaptive bound: C_{t+1} = the largest real example's norm; σ_Δ = 2σ."""

    initial = 0.5

    def next_bound(self, bound, squared_norms, mask, expected_batch_size, key, dp_step, noise_multiplier=None):
        return tf.sqrt(tf.reduce_max(tf.where(mask > 0, squared_norms, 0.0)))

    def gradient_noise_multiplier(self, sigma, expected_batch_size=None):
        return 2.0 * sigma


def test_an_adaptive_bound_gets_every_examples_squared_norm_and_sets_the_noise():
    """The step hands the bound the per-example squared norms of all chunks (checked against
    a per-example loop) and the mask; the gradient noise is σ_Δ·C_t/L, σ_Δ its multiplier."""
    model = _small_model()
    x = np.random.randn(12, 4).astype("float32")
    y = np.random.randint(0, 3, 12).astype("int32")
    mask = np.ones(12, "float32")
    mask[-3:] = 0.0
    norms = flat_norms(loop_per_example_gradients(model, x, y))
    x[-1] *= 100.0  # a padding row with the largest norm: the mask must exclude it
    norms[-1] *= 1e6
    model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=_MaxNormBound(), noise_multiplier=0.0), loss=sparse_ce)
    assert model.optimizer.l2_norm_clip == pytest.approx(0.5)
    model._prebuild(x, y)
    batch = {"x": x.reshape(3, 4, 4), "y": y.reshape(3, 4), "mask": mask.reshape(3, 4),
             "expected_batch_size": np.full(3, 9.0, "float32")}
    with reference_steps(model):
        tf.function(model.train_step)(tf.nest.map_structure(tf.constant, batch))
    assert model.optimizer.l2_norm_clip == pytest.approx(norms[:9].max(), rel=1e-4)
    units, sigma = 4000, 1.3
    noisy, x0, y0 = _noise_only_model(units)
    noisy.compile(optimizer=tf_dp.DPSGD(1.0, l2_norm_clip=_MaxNormBound(), noise_multiplier=sigma), loss="mse")
    before = noisy.get_weights()[1]
    noisy.train_on_batch(x0, y0, batch_size=8)
    step = noisy.get_weights()[1] - before
    # σ_Δ·C_0/L = 2·1.3·0.5/8; the sample std of 4000 normals has relative sd 1.1 %: 5 sd.
    assert abs(step.std() / (2 * sigma * 0.5 / 8) - 1) < 5 / np.sqrt(2 * units)


class _CountingNoise(tf_dp.noise.privatizer.GaussianNoise):
    """Gaussian noise that counts its builds and resets."""

    def __init__(self):
        self.builds, self.resets = 0, 0

    def build(self, variables):
        self.builds += 1

    def reset(self, dp_step=0):
        self.resets += 1


def test_the_privatizer_is_built_once_and_reset_when_the_key_or_the_ledger_does_not_continue():
    x, y = _separable(64)
    noise = _CountingNoise()
    model = _small_model(units=2)
    model.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0, noise=noise), loss=sparse_ce)
    assert model.optimizer.privatizer is noise
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert (noise.builds, noise.resets) == (1, 0)  # one key, one ledger, continued
    model.optimizer.seed = None  # a new key
    assert noise.resets == 1
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert noise.resets == 2  # the new key starts on a ledger it has not drawn on
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert noise.resets == 2  # continued
    trained = _small_model(seed=2, units=2)
    trained.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0), loss=sparse_ce)
    trained.fit(x, y, batch_size=16, epochs=1, verbose=0)
    fresh = _CountingNoise()
    trained.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0, noise=fresh), loss=sparse_ce)
    trained.fit(x, y, batch_size=16, epochs=1, verbose=0)  # resumes a ledger this key never drew on
    assert fresh.resets == 1
