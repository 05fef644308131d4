"""BandMF noise (docs/algorithms.md §10) against independent computations: DP-SGD's own Gaussian
draw, the explicit inverse of the banded Toeplitz C (numpy), and the covariance σ²C²·C⁻¹C⁻ᵀ."""

import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dp.noise import BandMF
from tf_dp.noise.bandmf import normalized_coefficients, sqrt_coefficients
from tf_dp.noise.privatizer import GaussianNoise, resolve_privatizer

SHAPES = [(3, 5), (7,), (2, 2, 2)]
KEY = tf.constant(987654321, tf.int64)


def _variables(shapes=SHAPES):
    return [tf.Variable(tf.zeros(shape)) for shape in shapes]


def _sums(step, shapes=SHAPES):
    rng = np.random.default_rng(step)
    return [tf.constant(rng.normal(size=shape).astype(np.float32)) for shape in shapes]


def _toeplitz(coefficients, steps):
    """The T×T lower-triangular b-banded Toeplitz C, C[t, t−j] = c_j (numpy, float64)."""
    matrix = np.zeros((steps, steps))
    for j, c in enumerate(coefficients):
        matrix += c * np.eye(steps, k=-j)
    return matrix


def _gaussian_draws(steps, stddev, shapes=SHAPES, key=KEY, first=0):
    """z_t of DP-SGD at steps first..first+T−1, flattened: [T, n] (GaussianNoise on zero sums)."""
    zeros = [tf.zeros(shape) for shape in shapes]
    rows = [GaussianNoise().privatize(zeros, stddev, key, tf.constant(first + t, tf.int64)) for t in range(steps)]
    return np.stack([np.concatenate([np.ravel(v.numpy()) for v in row]) for row in rows]).astype(np.float64)


def _released(privatizer, steps, stddev, shapes=SHAPES, sums=None, first=0, key=KEY):
    rows = []
    for t in range(steps):
        x = sums(t) if sums else [tf.zeros(shape) for shape in shapes]
        out = privatizer.privatize(x, stddev, key, tf.constant(first + t, tf.int64))
        rows.append(np.concatenate([np.ravel(v.numpy()) for v in out]))
    return np.stack(rows).astype(np.float64)


def test_sqrt_coefficients_are_binomial_over_four_to_the_j_normalised():
    np.testing.assert_allclose(sqrt_coefficients(4), [1, 1 / 2, 3 / 8, 5 / 16])
    c = normalized_coefficients(4)
    np.testing.assert_allclose(c, np.array([1, 1 / 2, 3 / 8, 5 / 16]) / np.sqrt(1 + 1 / 4 + 9 / 64 + 25 / 256))
    assert np.sum(c**2) == pytest.approx(1.0, abs=1e-15)
    column_norms = np.linalg.norm(_toeplitz(c, 12), axis=0)
    assert column_norms.max() == pytest.approx(1.0, abs=1e-12)  # the largest column norm is 1


def test_explicit_coefficients_are_checked_and_normalised():
    np.testing.assert_allclose(BandMF(3, [2.0, 1.0, 0.0]).coefficients, np.array([2, 1, 0]) / np.sqrt(5))
    with pytest.raises(ValueError, match="num_bands = 3"):
        BandMF(3, [1.0, 0.5])
    with pytest.raises(ValueError, match="c_0"):
        BandMF(2, [0.0, 1.0])
    with pytest.raises(ValueError, match="finite"):
        BandMF(2, [1.0, float("nan")])
    with pytest.raises(ValueError, match="'sqrt'"):
        BandMF(2, "optimal")
    with pytest.raises(ValueError, match="num_bands"):
        BandMF(0)
    with pytest.warns(UserWarning, match="grow geometrically"):
        BandMF(3, [1.0, 3.0, 1.0])


def test_one_band_is_dp_sgd_bit_for_bit():
    for privatizer in (BandMF(1), BandMF(1, [3.0])):
        privatizer.build(_variables())
        for step in range(4):
            x = _sums(step)
            expected = GaussianNoise().privatize(x, tf.constant(0.7), KEY, tf.constant(step, tf.int64))
            actual = privatizer.privatize(x, tf.constant(0.7), KEY, tf.constant(step, tf.int64))
            for a, e in zip(actual, expected):
                assert np.array_equal(a.numpy(), e.numpy())


@pytest.mark.parametrize("bands", [2, 4, 5])
def test_released_noise_is_the_inverse_of_c_applied_to_dp_sgd_draws(bands):
    """w = C⁻¹z with z DP-SGD's draws at the same (key, step, variable); C⁻¹ by numpy."""
    steps, stddev = 9, 1.3
    privatizer = BandMF(bands)
    privatizer.build(_variables())
    released = _released(privatizer, steps, tf.constant(stddev), sums=_sums, first=100)
    sums = np.stack([np.concatenate([np.ravel(v.numpy()) for v in _sums(t)]) for t in range(steps)])
    z = _gaussian_draws(steps, tf.constant(stddev), first=100)
    expected_noise = np.linalg.inv(_toeplitz(privatizer.coefficients, steps)) @ z
    np.testing.assert_allclose(released - sums, expected_noise, rtol=1e-5, atol=1e-5)
    # the test can fail: white noise (DP-SGD) is far from it
    assert np.max(np.abs(z / privatizer.coefficients[0] - expected_noise)) > 0.1


def test_a_changing_std_scales_unit_noise_s_c_inverse_zeta():
    """σ_tC_t changing per step (a σ schedule, adaptive clipping): released noise = S·C⁻¹ζ with
    ζ DP-SGD's unit draws and S = diag(s_t) (docs/algorithms.md §10.1), by numpy."""
    steps, bands = 8, 4
    stds = np.array([1.0, 0.5, 2.0, 2.0, 0.1, 1.5, 0.7, 3.0])
    privatizer = BandMF(bands)
    privatizer.build(_variables())
    zeros = [tf.zeros(shape) for shape in SHAPES]
    released = np.stack([np.concatenate([np.ravel(v.numpy()) for v in privatizer.privatize(
        zeros, tf.constant(stds[t], tf.float32), KEY, tf.constant(t, tf.int64))]) for t in range(steps)])
    unit = _gaussian_draws(steps, tf.constant(1.0))
    expected = np.diag(stds) @ np.linalg.inv(_toeplitz(privatizer.coefficients, steps)) @ unit
    np.testing.assert_allclose(released, expected, rtol=1e-5, atol=1e-5)
    absolute = np.linalg.inv(_toeplitz(privatizer.coefficients, steps)) @ (np.diag(stds) @ unit)
    assert np.max(np.abs(absolute - expected)) > 0.1  # C⁻¹z of absolute draws differs: the test can fail


def test_empirical_covariance_over_steps_is_sigma_squared_c_inverse_c_inverse_transpose():
    """Zero sums, T = 6, n = 24 000 coordinates: Σ̂ = W Wᵀ/n vs Σ = σ²C²·C⁻¹C⁻ᵀ.

    Tolerance: Σ̂_st is a mean of n i.i.d. products w_s w_t (coordinates are independent) with
    variance Σ_ss Σ_tt + Σ_st² (Isserlis), so its standard error is √((Σ_ss Σ_tt + Σ_st²)/n);
    every entry must be within 5 standard errors (all 21 entries pass by chance with p > 0.9999).
    """
    steps, bands, stddev = 6, 4, 0.9
    shapes = [(20000,), (40, 100)]
    privatizer = BandMF(bands)
    privatizer.build(_variables(shapes))
    noise = _released(privatizer, steps, tf.constant(stddev), shapes=shapes, key=tf.constant(4242, tf.int64))
    n = noise.shape[1]
    inverse = np.linalg.inv(_toeplitz(privatizer.coefficients, steps))
    expected = stddev**2 * inverse @ inverse.T
    empirical = noise @ noise.T / n
    standard_error = np.sqrt((np.outer(np.diag(expected), np.diag(expected)) + expected**2) / n)
    assert np.all(np.abs(empirical - expected) < 5 * standard_error), (empirical, expected)
    white = stddev**2 * np.eye(steps)  # DP-SGD's covariance: rejected by the same test
    assert np.any(np.abs(empirical - white) > 20 * standard_error)


def test_the_ring_under_xla_matches_the_inverse_of_c():
    """Inside one jit_compile'd step (XLA's Philox differs from TF's: z is drawn in the same
    compiled function), the buffer rotation gives C⁻¹z."""
    steps, bands = 7, 3
    shapes = [(4, 6), (5,)]
    privatizer = BandMF(bands)
    privatizer.build(_variables(shapes))
    zeros = [tf.zeros(s) for s in shapes]

    @tf.function(jit_compile=True)
    def step(t):
        released = privatizer.privatize(zeros, tf.constant(1.0), KEY, t)
        fresh = GaussianNoise().privatize(zeros, tf.constant(1.0), KEY, t)
        return [tf.reshape(v, [-1]) for v in released], [tf.reshape(v, [-1]) for v in fresh]

    released, fresh = [], []
    for t in range(steps):
        r, f = step(tf.constant(t, tf.int64))
        released.append(np.concatenate([v.numpy() for v in r]))
        fresh.append(np.concatenate([v.numpy() for v in f]))
    expected = np.linalg.inv(_toeplitz(privatizer.coefficients, steps)) @ np.array(fresh, dtype=np.float64)
    np.testing.assert_allclose(np.array(released), expected, rtol=1e-5, atol=1e-5)


def test_a_step_repeated_at_the_same_counter_draws_the_same_noise_and_continues_the_factorization():
    """A step a budget blocks draws but releases nothing; the next release reuses its counter
    (docs/algorithms.md A.4). Its noise must be the uninterrupted run's (C⁻¹z, not a function
    of the blocked draw)."""
    shapes = [(50,)]
    uninterrupted = BandMF(3)
    uninterrupted.build(_variables(shapes))
    expected = _released(uninterrupted, 6, tf.constant(1.0), shapes=shapes)
    repeated = BandMF(3)
    repeated.build(_variables(shapes))
    zeros, rows = [tf.zeros(s) for s in shapes], {}
    for t in [0, 1, 2, 2, 3, 3, 3, 4, 5]:
        rows.setdefault(t, []).append(repeated.privatize(zeros, tf.constant(1.0), KEY, tf.constant(t, tf.int64))[0])
    for t, outputs in rows.items():
        for out in outputs:
            np.testing.assert_allclose(out.numpy(), expected[t], rtol=1e-6, atol=1e-6)


def test_a_counter_that_jumps_restarts_the_buffer():
    """A ledger rolled back (load_weights of an older file) or moved on without reset: the step
    must not mix the other run's w's in (fresh block: w̄_t = ζ_t/c_0, then C⁻¹ of the block)."""
    shapes = [(40,)]
    privatizer = BandMF(3)
    privatizer.build(_variables(shapes))
    _released(privatizer, 6, tf.constant(1.0), shapes=shapes)  # steps 0..5
    for first in (2, 9):  # back to 2, then on to 9
        block = _released(privatizer, 4, tf.constant(1.0), shapes=shapes, first=first)
        z = _gaussian_draws(4, tf.constant(1.0), shapes=shapes, first=first)
        expected = np.linalg.inv(_toeplitz(privatizer.coefficients, 4)) @ z
        np.testing.assert_allclose(block, expected, rtol=1e-5, atol=1e-5)


def test_reset_starts_a_fresh_segment_and_warns_once_on_a_resumed_model():
    shapes = [(30,)]
    privatizer = BandMF(4)
    privatizer.build(_variables(shapes))
    with pytest.warns(UserWarning, match="fresh buffer"):
        privatizer.reset(dp_step=3)  # a resumed model: steps taken, nothing drawn by this privatizer
    _released(privatizer, 3, tf.constant(1.0), shapes=shapes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        privatizer.reset(dp_step=5)  # once
        BandMF(4).reset()  # step 0: a new run, no warning
        drawn = BandMF(4)
        drawn.build(_variables(shapes))
        _released(drawn, 2, tf.constant(1.0), shapes=shapes)
        drawn.reset(dp_step=2)  # a new fit after drawing: a new segment, no resume
    after = _released(privatizer, 1, tf.constant(1.0), shapes=shapes, first=3)
    z = _gaussian_draws(1, tf.constant(1.0), shapes=shapes, first=3)
    np.testing.assert_allclose(after, z / privatizer.coefficients[0], rtol=1e-6)  # no memory of steps 0..2


def test_several_replicas_are_refused():
    privatizer = BandMF(2)
    privatizer.build(_variables())
    with pytest.raises(ValueError, match="single replica"):
        privatizer.privatize(_sums(0), tf.constant(1.0), KEY, tf.constant(0, tf.int64), replica=0, replicas=2)


def test_sampling_requirements_config_and_registry():
    privatizer = BandMF(4, [1.0, 0.5, 0.25, 0.125])
    assert privatizer.required_sampling == "cyclic_poisson"
    assert privatizer.sampling_arguments() == {"num_bands": 4}
    restored = resolve_privatizer(keras.saving.serialize_keras_object(privatizer))
    assert isinstance(restored, BandMF) and restored.num_bands == 4
    np.testing.assert_array_equal(restored.coefficients, privatizer.coefficients)
    assert BandMF(3).get_config() == {"num_bands": 3, "coefficients": "sqrt"}
    privatizer.build(_variables([(10, 10)]))
    assert privatizer.buffer_bytes() == 4 * 100 * 4  # b slots of |θ| float32
    assert BandMF(1).buffer_bytes() == 0
    assert "buffer" not in repr(privatizer)


class _Holder(keras.layers.Layer):
    """A Keras layer keeping a built BandMF as an attribute, as the DP optimizer will."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(64)
        self.privatizer = BandMF(4)

    def build(self, shape):
        self.dense.build(shape)
        self.privatizer.build(self.dense.trainable_variables)

    def call(self, x):
        return self.dense(x)


def _buffer_fingerprints(privatizer):
    """16-byte runs of the buffer's float32 values (any of them in a file would be a leak)."""
    values = np.concatenate([v.numpy().ravel() for v in privatizer._buffer.variables]).astype(np.float32)
    values = values[values != 0]
    return [values[i:i + 4].tobytes() for i in range(0, min(len(values) - 4, 400), 37)]


def _files_under(path):
    if os.path.isfile(path):
        return [path]
    return [os.path.join(root, name) for root, _, names in os.walk(path) for name in names]


def test_the_buffer_is_in_no_artifact(tmp_path):
    inputs = keras.Input((8,))
    holder = _Holder(name="holder")
    model = keras.Model(inputs, holder(inputs))
    zeros = [tf.zeros_like(v) for v in holder.dense.trainable_variables]
    for t in range(5):
        holder.privatizer.privatize(zeros, tf.constant(1.0), KEY, tf.constant(t, tf.int64))
    fingerprints = _buffer_fingerprints(holder.privatizer)
    assert len(fingerprints) > 5
    model.save(tmp_path / "m.keras")
    model.save_weights(tmp_path / "m.weights.h5")
    tf.train.Checkpoint(model=model, holder=holder).write(str(tmp_path / "ckpt"))
    tf.saved_model.save(model, str(tmp_path / "saved"))
    paths = [p for p in _files_under(str(tmp_path))]
    assert len(paths) >= 4
    for path in paths:
        if path.endswith(".keras"):
            import zipfile
            with zipfile.ZipFile(path) as archive:
                blobs = [archive.read(name) for name in archive.namelist()]
        else:
            blobs = [open(path, "rb").read()]
        for blob in blobs:
            assert not any(f in blob for f in fingerprints), path
    # the search can fail: the buffer's bytes are found when written on purpose
    np.save(tmp_path / "leak.npy", holder.privatizer._buffer.variables[0].numpy())
    assert any(f in open(tmp_path / "leak.npy", "rb").read() for f in fingerprints)


# -- integration into fit (runs once the DP optimizers take noise=, docs/algorithms.md §10.4) --------------------

def _integrated():
    import inspect

    import tf_dp
    return "noise" in inspect.signature(tf_dp.DPSGD.__init__).parameters


integration = pytest.mark.skipif(not _integrated(), reason="the DP optimizers take noise= once h/optimizer is merged")


def _bandmf_classifier(bands=4, sigma=1.0, seed=None):
    import tf_dp

    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(3)(keras.layers.Dense(16, activation="tanh")(inputs)))
    model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=sigma, seed=seed,
                                        noise=BandMF(bands)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data(n=240):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 6)).astype(np.float32), rng.integers(0, 3, size=n).astype(np.int32)


@integration
def test_fit_samples_cyclic_poisson_and_the_ledger_records_segments_with_b():
    from dp_accounting import dp_event

    from tf_dp.accounting import epsilon_of_event
    from tf_dp.accounting.bandmf import bandmf_event

    x, y = _data()
    model = _bandmf_classifier(bands=4, sigma=1.3)
    for _ in range(2):  # two fits of 5 steps: two segments of ⌈5/4⌉ = 2 rounds (one segment of 10: 3 rounds)
        model.fit(x, y, batch_size=12, steps_per_epoch=5, epochs=1, verbose=0)
    phases = model.privacy_ledger.phases()
    assert [p.scheme for p in phases] == ["cyclic_poisson", "cyclic_poisson"] and [p.steps for p in phases] == [5, 5]
    assert all(p.parameter == 4 and p.sampling_rate == pytest.approx(4 * 12 / 240) for p in phases)
    sigma = phases[0].noise_multiplier  # 1.3 as the float32 the step read
    assert sigma == pytest.approx(1.3, rel=1e-6)
    segment = bandmf_event(4 * 12 / 240, sigma, 5, 4)
    expected = epsilon_of_event(dp_event.ComposedDpEvent([segment, segment]), 1e-5)
    assert model.get_epsilon(1e-5) == pytest.approx(expected, rel=1e-9)
    merged = epsilon_of_event(bandmf_event(4 * 12 / 240, sigma, 10, 4), 1e-5)
    assert merged < expected * (1 - 1e-3)  # the comparison can fail


@integration
def test_explicit_batches_are_refused_before_training():
    x, y = _data()
    model = _bandmf_classifier()
    with pytest.raises(ValueError, match="(?i)cyclic|bandmf"):
        model.train_on_batch(x[:12], y[:12])
    with pytest.raises(ValueError, match="(?i)cyclic|bandmf"):
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(12), epochs=1, verbose=0)
    assert int(model.privacy_ledger.steps.numpy()) == 0


@integration
def test_after_fit_no_artifact_holds_the_buffer_and_a_reload_starts_a_fresh_one(tmp_path):
    x, y = _data()
    model = _bandmf_classifier(bands=4, sigma=1.0)
    model.fit(x, y, batch_size=12, epochs=1, verbose=0)
    privatizer = model.optimizer.privatizer
    fingerprints = _buffer_fingerprints(privatizer)
    before = [v.numpy().copy() for v in privatizer._buffer.variables]
    model.save(tmp_path / "m.keras")
    model.save_weights(tmp_path / "m.weights.h5")
    model.export(str(tmp_path / "saved"))
    import zipfile
    for path in _files_under(str(tmp_path)):
        blobs = ([zipfile.ZipFile(path).read(n) for n in zipfile.ZipFile(path).namelist()] if path.endswith(".keras")
                 else [open(path, "rb").read()])
        assert not any(f in blob for blob in blobs for f in fingerprints), path
    loaded = keras.models.load_model(tmp_path / "m.keras")
    with pytest.warns(UserWarning, match="fresh buffer"):
        loaded.fit(x, y, batch_size=12, steps_per_epoch=1, epochs=1, verbose=0)
    after = np.concatenate([v.numpy().ravel() for v in loaded.optimizer.privatizer._buffer.variables])
    old = np.concatenate([b.ravel() for b in before])
    # a continued buffer would make the new w̄ = (ζ − Σ c_j w̄_old)/c_0 strongly anti-correlated with the old
    # slots; a fresh one is independent: |corr| < 5/√n
    written = after != 0
    for shift in range(4):
        rolled = np.concatenate([np.roll(b, shift, axis=0).ravel() for b in before])
        corr = np.corrcoef(after[written], rolled[written])[0, 1]
        assert abs(corr) < 5 / np.sqrt(written.sum()), (shift, corr)
    assert np.any(old != 0)
