"""rounding.row_norms certifies ‖x‖ from above for float32 rows, against the exact norm in
float64 (numpy), including rows whose squares underflow float32 (the relative bound γ_n alone
would return 0 there) and rows of mixed magnitudes."""

import numpy as np
import pytest
import tensorflow as tf

from tf_dp.clipping.rounding import row_norms


def exact_norms(rows: np.ndarray) -> np.ndarray:
    return np.sqrt(np.sum(rows.astype(np.float64) ** 2, axis=-1))


@pytest.mark.parametrize("scale", [1e-30, 1e-20, 1e-3, 1.0, 1e15])
def test_row_norms_bound_the_exact_norm_from_above(scale):
    rng = np.random.default_rng(0)
    rows = (rng.standard_normal((64, 97)) * scale).astype(np.float32)
    rows[:8, 1:] *= np.float32(1e-25)  # one large entry beside tiny ones
    bound = row_norms(tf.constant(rows)).numpy()
    exact = exact_norms(rows)
    assert np.all(bound >= exact), (scale, np.min(bound - exact))
    assert np.all(bound <= exact * (1 + 1e-4) + (2 * 97) ** 0.5 * 2.0 ** -62)  # tight: a bound, not a guess
