"""A SerializedSource's ``parse`` runs on a batch of records; one that computes across the
batch (standardizing by its mean and spread) lets one person's record move every row, which
the row-independence guard (it sees only parsed rows) cannot notice. fit checks on a probe
that parse(records) equals the stack of parse([record]) and refuses, naming the function."""

import numpy as np
import pytest
import tensorflow as tf

from tests.harness import small_dp_classifier
from tf_dp.sampling.sources import SerializedSource

N, FEATURES, CLASSES = 64, 5, 3


def records(x, y):
    return [tf.io.serialize_tensor(tf.constant(np.append(x[i], np.float32(y[i])))).numpy() for i in range(len(y))]


def data():
    rng = np.random.default_rng(4)
    return rng.normal(size=(N, FEATURES)).astype("float32"), rng.integers(0, CLASSES, N).astype("int32")


def rows_of(serialized):
    rows = tf.map_fn(lambda s: tf.io.parse_tensor(s, tf.float32), serialized, fn_output_signature=tf.float32)
    return tf.ensure_shape(rows, [None, FEATURES + 1])


def per_example_parse(serialized):
    rows = rows_of(serialized)
    return (rows[:, :FEATURES] - 0.5) / 2.0, tf.cast(rows[:, FEATURES], tf.int32)


def standardize_over_the_batch(serialized):
    rows = rows_of(serialized)
    x = rows[:, :FEATURES]
    mean, variance = tf.nn.moments(x, axes=[0], keepdims=True)
    return (x - mean) / tf.sqrt(variance + 1e-6), tf.cast(rows[:, FEATURES], tf.int32)


def test_the_batch_standardizing_parse_really_lets_one_record_move_other_rows():
    """Independent witness (neighbouring datasets): change record 0 only; rows 1.. move."""
    x, y = data()
    changed = x.copy()
    changed[0] += 50.0
    before = standardize_over_the_batch(tf.constant(records(x, y)[:16]))[0].numpy()
    after = standardize_over_the_batch(tf.constant(records(changed, y)[:16]))[0].numpy()
    assert np.abs(after[1:] - before[1:]).max() > 0.1
    plain_before = per_example_parse(tf.constant(records(x, y)[:16]))[0].numpy()
    plain_after = per_example_parse(tf.constant(records(changed, y)[:16]))[0].numpy()
    np.testing.assert_array_equal(plain_after[1:], plain_before[1:])


def test_fit_refuses_a_parse_that_computes_across_the_batch_naming_it():
    x, y = data()
    model = small_dp_classifier(FEATURES, CLASSES, sigma=1.0)
    with pytest.raises(ValueError, match=r"(?s)`standardize_over_the_batch`.*does not treat each record on its own"):
        model.fit(SerializedSource(records(x, y), standardize_over_the_batch), batch_size=16, epochs=1,
                  steps_per_epoch=2, sampling_seed=0, verbose=0)
    assert int(model.privacy_ledger.steps.numpy()) == 0


def test_a_per_example_parse_trains_like_the_arrays_it_parses_to():
    x, y = data()
    by_hand, parsed = (small_dp_classifier(FEATURES, CLASSES, sigma=1.0) for _ in range(2))
    by_hand.fit((x - 0.5) / 2.0, y, batch_size=16, epochs=1, steps_per_epoch=2, sampling_seed=0, verbose=0)
    parsed.fit(SerializedSource(records(x, y), per_example_parse), batch_size=16, epochs=1, steps_per_epoch=2,
               sampling_seed=0, verbose=0)
    for a, b in zip(by_hand.get_weights(), parsed.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert parsed.privacy_ledger.current_phase().num_examples == N
