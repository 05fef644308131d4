"""Validation_split for random-access sources: the last fraction of the indices
is carved off before sampling — N for the sampler and the accountant is the training part,
a validation index is never sampled — and validates as Keras' split of arrays does."""

import numpy as np
import pytest

from tests.harness import CountingSource, small_dp_classifier
from tf_dp.sampling.sources import SerializedSource

N, FEATURES, CLASSES, SPLIT = 200, 5, 3, 0.25
CUT = N - int(round(N * SPLIT))


def data():
    rng = np.random.default_rng(2)
    return rng.normal(size=(N, FEATURES)).astype("float32"), rng.integers(0, CLASSES, N).astype("int32")


def model():
    return small_dp_classifier(FEATURES, CLASSES, sigma=0.9)


def test_a_source_splits_off_its_tail_before_sampling_like_arrays_cut_by_hand():
    x, y = data()
    by_hand, split = model(), model()
    reference = by_hand.fit(x[:CUT], y[:CUT], validation_data=(x[CUT:], y[CUT:]), batch_size=30, epochs=1,
                            steps_per_epoch=2, sampling_seed=4, verbose=0)
    source = CountingSource(x, y)
    history = split.fit(source, validation_split=SPLIT, batch_size=30, epochs=1, steps_per_epoch=2, sampling_seed=4,
                        verbose=0)
    for a, b in zip(by_hand.get_weights(), split.get_weights()):
        np.testing.assert_array_equal(a, b)  # same N = CUT, same batches, same steps
    phase = split.privacy_ledger.current_phase()
    assert phase.num_examples == CUT and phase.sampling_rate == pytest.approx(30 / CUT)
    assert split.get_epsilon() == by_hand.get_epsilon()
    np.testing.assert_allclose(history.history["val_loss"], reference.history["val_loss"], rtol=1e-5)
    # the tail is read only by validation, whole, once
    tail_reads = [i for i in source.reads if i >= CUT]
    assert sorted(tail_reads) == list(range(CUT, N))


def test_sample_weights_of_the_tail_go_with_the_validation_rows():
    x, y = data()
    weights = np.linspace(0.5, 2.0, N).astype("float32")
    split = model()
    history = split.fit(CountingSource(x, y), sample_weight=weights, validation_split=SPLIT, batch_size=30, epochs=1,
                        steps_per_epoch=2, sampling_seed=1, verbose=0)
    # validated after the last step: the final weights on the tail rows with the tail's own weights
    expected = split.evaluate(x[CUT:], y[CUT:], sample_weight=weights[CUT:], verbose=0)
    np.testing.assert_allclose(history.history["val_loss"], [expected], rtol=1e-5)


def test_a_serialized_source_splits_too():
    import tensorflow as tf

    x, y = data()
    records = [tf.io.serialize_tensor(tf.constant(np.append(x[i], np.float32(y[i])))).numpy() for i in range(N)]

    def parse(serialized):
        rows = tf.map_fn(lambda s: tf.io.parse_tensor(s, tf.float32), serialized, fn_output_signature=tf.float32)
        rows = tf.ensure_shape(rows, [None, FEATURES + 1])
        return rows[:, :FEATURES], tf.cast(rows[:, FEATURES], tf.int32)

    by_hand, split = model(), model()
    by_hand.fit(x[:CUT], y[:CUT], batch_size=30, epochs=1, steps_per_epoch=2, sampling_seed=6, verbose=0)
    split.fit(SerializedSource(records, parse), validation_split=SPLIT, batch_size=30, epochs=1, steps_per_epoch=2,
              sampling_seed=6, verbose=0)
    for a, b in zip(by_hand.get_weights(), split.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert split.privacy_ledger.current_phase().num_examples == CUT
