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
