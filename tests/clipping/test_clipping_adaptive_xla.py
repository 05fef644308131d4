"""AdaptiveClip's split σ⁻² = σ_Δ⁻² + (2σ_b)⁻² (docs/algorithms.md §12) must hold in the step that
actually runs, XLA included: with σ_b ≤ σ/2 no σ_Δ exists, and a step that still releases the
noisy count (C_{t+1}) releases it at noise multiplier 2σ_b < σ, the σ the ledger records."""

import warnings

import keras
import numpy as np
import pytest

import tf_dp
from tf_dp.clipping import AdaptiveClip


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_count_stddev_at_most_half_sigma_never_releases_a_bound(jit_compile):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(240, 6)).astype(np.float32), rng.integers(0, 3, 240).astype(np.int32)
    sigma, count_stddev = 3.0, 1.0  # 2σ_b = 2 < σ = 3: the count alone would be a σ = 2 mechanism
    inputs = keras.Input((6,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=AdaptiveClip(1.0, count_stddev=count_stddev),
                                        noise_multiplier=sigma),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=jit_compile)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.fit(x, y, batch_size=24, steps_per_epoch=3, epochs=1, verbose=0)
    except Exception as error:  # refused (host check, or the in-graph assertion without XLA)
        assert "count_stddev" in str(error)
        assert model.optimizer.l2_norm_clip == pytest.approx(1.0)
        return
    # It ran: then no noisy count may have been released, so C stays C_0 (the combined
    # multiplier of what was released is (σ_Δ⁻² + (2σ_b)⁻²)^(−1/2) ≥ σ only if the count is withheld).
    released = [phase.noise_multiplier for phase in model.privacy_ledger.phases()]
    assert released == [pytest.approx(sigma)]
    assert model.optimizer.l2_norm_clip == pytest.approx(1.0), "a noisy count was released at 2σ_b < σ"


def test_next_bound_withholds_the_count_when_two_count_stddevs_do_not_exceed_sigma():
    """Under XLA (where tf.debugging assertions are no-ops) next_bound(noise_multiplier=σ) keeps
    C_t when 2σ_b ≤ σ, and otherwise equals the hand formula C_t·exp(−η(b̃ − γ)) with the same
    Philox count noise (drawn here with noise_multiplier=None)."""
    import tensorflow as tf

    clip = AdaptiveClip(1.0, target_quantile=0.5, learning_rate=0.2, count_stddev=1.0)
    args = (tf.constant(1.0), tf.constant([0.5, 4.0, 0.1]), tf.constant([1.0, 1.0, 1.0]), 3.0,
            tf.constant(5, tf.int64), tf.constant(0, tf.int64))

    @tf.function(jit_compile=True)
    def bound(sigma):
        return clip.next_bound(*args, noise_multiplier=sigma)

    assert float(bound(tf.constant(3.0))) == 1.0  # 2σ_b = 2 ≤ 3: nothing released
    assert float(bound(tf.constant(2.0))) == 1.0  # 2σ_b = σ: no σ_Δ either
    assert float(bound(tf.constant(1.0))) != 1.0  # the comparison can fail: a count is released
    # Without XLA (TF's Philox kernel, the same draw as eagerly):
    bound = tf.function(lambda sigma: clip.next_bound(*args, noise_multiplier=sigma))
    assert float(bound(tf.constant(3.0))) == 1.0
    noise = float(clip.count_noise(args[4], args[5], 3.0))
    centred = (1 - 0.5) + (0 - 0.5) + (1 - 0.5)  # norms² 0.5, 4.0, 0.1 against C² = 1
    expected = np.exp(-0.2 * ((centred + noise) / 3.0 + 0.5 - 0.5))
    assert float(bound(tf.constant(1.0))) == pytest.approx(expected, rel=1e-6)


def test_a_sigma_raised_by_a_callback_past_two_count_stddevs_releases_no_more_bounds_under_xla():
    """σ raised mid-run above 2σ_b (the host check before the first step saw a valid σ): the XLA
    step skips the in-graph assertion, so it must withhold the count itself: C stays at the
    value of the last step with 2σ_b > σ."""
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(240, 6)).astype(np.float32), rng.integers(0, 3, 240).astype(np.int32)
    inputs = keras.Input((6,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=AdaptiveClip(1.0, count_stddev=1.0), noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True)
    bounds = []

    class RaiseSigma(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            bounds.append(model.optimizer.l2_norm_clip)
            if batch == 2:
                model.optimizer.noise_multiplier = 3.0  # 2σ_b = 2 < 3

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model.fit(x, y, batch_size=24, steps_per_epoch=5, epochs=1, verbose=0, callbacks=[RaiseSigma()])
        except (tf.errors.InvalidArgumentError, ValueError) as error:  # refused: fine
            assert "count_stddev" in str(error)
            return
    bounds.append(model.optimizer.l2_norm_clip)
    assert len(set(bounds[:3])) == 3  # the comparison can fail: C moved while 2σ_b > σ
    assert bounds[3:] == [bounds[2]] * (len(bounds) - 3), bounds
