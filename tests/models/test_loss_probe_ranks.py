"""The per-example loss probe catches losses that depend on the ranks of the ℓ_i in the batch.

Hard-example mining (keep the hardest ⌈f·B⌉ losses of the batch, zero the others) gives row
j a value that depends on every other row's loss: adding one hard example pushes another out
of the kept set, so one example moves the released sum by more than C. On 3 rows ⌈0.7·3⌉ = 3
keeps every row, so a 3-row probe passed it; the probe now also runs on 8 and 16 rows and
moves one row's loss from the batch's smallest to its largest.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp.models.losses import per_example_loss

RNG = np.random.default_rng(0)


def hard_mining(fraction, rounding=tf.math.ceil):
    """Binary cross-entropy of the hardest rounding(fraction · B) examples of the batch, 0 for the rest."""

    def loss(y_true, y_pred):
        values = keras.losses.binary_crossentropy(y_true, y_pred)  # [B]
        kept = tf.cast(rounding(fraction * tf.cast(tf.shape(values)[0], tf.float32)), tf.int32)
        threshold = tf.math.top_k(values, kept).values[-1]
        return tf.where(values >= threshold, values, tf.zeros_like(values))

    return loss


# Fractions f whose ⌈f·3⌉ = 3 keeps every row of a 3-row batch.
RANK_LOSSES = {
    "hardest_70_percent": hard_mining(0.7),
    "hardest_75_percent": hard_mining(0.75),
    "hardest_90_percent": hard_mining(0.9),  # keeps all of 8 rows, drops one of 16
}


def _batch(rows):
    y = (RNG.uniform(size=(rows, 1)) > 0.5).astype("float32")
    p = RNG.uniform(0.05, 0.95, size=(rows, 1)).astype("float32")
    return y, p


def test_hard_mining_mixes_examples_and_is_refused():
    """The property, computed directly: with one hard example added to a batch of 9, another
    example's loss drops to 0 (⌈0.7·9⌉ = ⌈0.7·10⌉ = 7 are kept); the probe refuses the loss."""
    y, p = _batch(9)
    loss = hard_mining(0.7)
    base = loss(tf.constant(y), tf.constant(p)).numpy()
    hard_y, hard_p = np.array([[1.0]], "float32"), np.array([[0.01]], "float32")
    added = loss(tf.constant(np.concatenate([y, hard_y])), tf.constant(np.concatenate([p, hard_p]))).numpy()[:9]
    assert np.any(added != base)
    assert np.count_nonzero(added != base) == 1 and added[added != base][0] == 0.0
    with pytest.raises(ValueError, match="`loss` mixes examples"):
        per_example_loss(loss)(tf.constant(y), tf.constant(p))


@pytest.mark.parametrize("name", sorted(RANK_LOSSES))
def test_rank_dependent_losses_are_refused_with_a_clear_error(name):
    y, p = _batch(12)
    with pytest.raises(ValueError, match=r"`loss` mixes examples: changing row \d+ of .*Fix:"):
        per_example_loss(RANK_LOSSES[name])(tf.constant(y), tf.constant(p))


def test_hard_mining_is_refused_by_dp_fit_before_any_step():
    x = RNG.normal(size=(40, 6)).astype("float32")
    y = (RNG.uniform(size=(40, 1)) > 0.5).astype("float32")
    model = tf_dp.DPSequential([keras.Input((6,)), keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0), loss=hard_mining(0.7))
    with pytest.raises(ValueError, match="`loss` mixes examples"):
        model.fit(x, y, batch_size=10, epochs=1, verbose=0)
    assert int(model.privacy_ledger.steps.numpy()) == 0


def test_ranks_within_one_example_are_accepted():
    """A top-k over an example's own values (not over the batch) is row-independent: accepted,
    with the values a NumPy computation gives (a guard against refusing too much: passes on
    the old probe too)."""
    y, _ = _batch(6)
    y = np.tile(y, (1, 5))
    p = RNG.uniform(0.05, 0.95, size=(6, 5)).astype("float32")

    def worst_two_errors(y_true, y_pred):
        return tf.reduce_mean(tf.math.top_k(tf.square(y_true - y_pred), 2).values, axis=-1)

    values = per_example_loss(worst_two_errors)(tf.constant(y), tf.constant(p)).numpy()
    expected = np.sort((y - p) ** 2, axis=1)[:, -2:].mean(axis=1)
    np.testing.assert_allclose(values, expected, rtol=1e-6)
