"""A sampled record that fails to read or parse is a zero-weight example, never an exception
mid-training (issue 31 item 6). Before, a wrong-shape RecordSource record or corrupt
SerializedSource bytes stopped training with ``SourceError: ... example 150 ...`` at the first
step that sampled it: an oracle of when the contributor was sampled, and one contributor could
stop everyone's training.

Independent check, at σ = 0: the release equals that of the neighbouring dataset in which the
bad record is replaced by one that contributes exactly nothing (x = 0 in a bias-free linear
model with a squared loss: its gradient 2(w·x − y)x is 0), with the same sampled batches; the
count reported after training equals the number of trained steps whose batch sampled the bad
index, counted from the sampler itself."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp.sampling import PoissonSampler
from tf_dp.sampling.sources import SerializedSource

N, FEATURES, L, STEPS, SEED = 240, 6, 24, 30, 11
BAD = 150  # beyond the rows fit reads before training (67): only sampling reaches it


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, FEATURES)).astype("float32"), rng.normal(size=(N, 1)).astype("float32")


def linear_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(1, use_bias=False)(inputs))
    model.compile(optimizer=tf_dp.DPSGD(0.5, l2_norm_clip=0.5, noise_multiplier=0.0), loss="mse")
    return model


def times_sampled(index) -> int:
    """How many of the STEPS trained batches hold ``index``, from the sampler itself."""
    sampler = PoissonSampler(N, L, None, SEED)
    return sum(int(np.sum((sampler.batch(t)[0] == index) & (sampler.batch(t)[1] > 0))) for t in range(STEPS))


def fit(model, source):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(source, batch_size=L, epochs=1, steps_per_epoch=STEPS, sampling_seed=SEED, verbose=0)
    return history, [str(w.message) for w in caught if "could not be read" in str(w.message)]


class Records:
    """Record i = (x[i], y[i]); record BAD is ``bad()`` instead."""

    def __init__(self, x, y, bad):
        self.x, self.y, self.bad = x, y, bad

    def __len__(self):
        return N

    def __getitem__(self, index):
        return self.bad() if index == BAD else (self.x[index], self.y[index])


def neighbour(x, y):
    """The same data with record BAD contributing exactly nothing (x = 0)."""
    x = x.copy()
    x[BAD] = 0.0
    return x, y


def assert_trains_as_the_neighbour(bad_source, x, y):
    assert times_sampled(BAD) >= 2  # the bad record is sampled during training (else the test is void)
    trained, reference, with_record = linear_model(), linear_model(), linear_model()
    history, warned = fit(trained, bad_source)
    x_zero, y_zero = neighbour(x, y)
    fit(reference, Records(x_zero, y_zero, bad=lambda: (x_zero[BAD], y_zero[BAD])))
    fit(with_record, Records(x, y, bad=lambda: (x[BAD], y[BAD])))
    assert int(trained.privacy_ledger.steps.numpy()) == STEPS  # trained to completion
    for a, b in zip(trained.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(a, b)  # the release of the neighbouring dataset, exactly
    assert not all(np.array_equal(a, b) for a, b in zip(trained.get_weights(), with_record.get_weights()))
    assert trained.unreadable_examples == times_sampled(BAD) == history.unreadable_examples
    assert reference.unreadable_examples == 0
    assert len(warned) == 1 and f"{times_sampled(BAD)} sampled record" in warned[0] and f"example {BAD}" in warned[0]
    assert "step" not in warned[0].replace("steps", "")  # the total only: no step is named


@pytest.mark.parametrize("bad", ["shape", "raises"])
def test_a_bad_record_source_record_trains_as_a_zero_weight_example(bad):
    x, y = data()
    make_bad = {"shape": lambda: (x[BAD][:4], y[BAD]), "raises": lambda: 1 / 0}[bad]
    assert_trains_as_the_neighbour(Records(x, y, make_bad), x, y)


def parse(serialized):
    """[n] strings of 7 float32 (6 features, then the target) → (x [n, 6], y [n, 1])."""
    values = tf.reshape(tf.io.decode_raw(serialized, tf.float32), [-1, FEATURES + 1])
    return values[:, :FEATURES], values[:, FEATURES:]


class Serialized:
    def __init__(self, x, y, corrupt):
        self.rows = [np.concatenate([x[i], y[i]]).astype(np.float32).tobytes() for i in range(N)]
        if corrupt is not None:
            self.rows[BAD] = corrupt

    def __len__(self):
        return N

    def __getitem__(self, index):
        return self.rows[index]


@pytest.mark.parametrize("corrupt", [b"\x00\x01\x02", "not bytes"], ids=["truncated_bytes", "not_bytes"])
def test_corrupt_serialized_bytes_train_as_a_zero_weight_example(corrupt):
    x, y = data()
    bad = SerializedSource(Serialized(x, y, corrupt), parse)
    assert times_sampled(BAD) >= 2
    trained, reference, with_record = linear_model(), linear_model(), linear_model()
    history, warned = fit(trained, bad)
    fit(reference, SerializedSource(Serialized(*neighbour(x, y), None), parse))
    fit(with_record, SerializedSource(Serialized(x, y, None), parse))
    assert int(trained.privacy_ledger.steps.numpy()) == STEPS
    for a, b in zip(trained.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert not all(np.array_equal(a, b) for a, b in zip(trained.get_weights(), with_record.get_weights()))
    assert trained.unreadable_examples == times_sampled(BAD) == history.unreadable_examples
    assert reference.unreadable_examples == 0 and with_record.unreadable_examples == 0
    assert len(warned) == 1 and f"example {BAD}" in warned[0]


def test_private_logs_report_no_count():
    x, y = data()
    model = linear_model()
    model.compile(optimizer=tf_dp.DPSGD(0.5, l2_norm_clip=0.5, noise_multiplier=0.0), loss="mse", private_logs=True)
    _, warned = fit(model, Records(x, y, lambda: 1 / 0))
    assert int(model.privacy_ledger.steps.numpy()) == STEPS and model.unreadable_examples is None and not warned


def test_a_user_with_one_unreadable_example_contributes_nothing_and_is_counted_once_per_record():
    """User-level sampling (indices [chunks, P, m]): the user's unit gets mask 0."""
    from tf_dp.sampling.loader import zero_weight_unreadable
    from tf_dp.sampling.sources import UnreadableLog

    log = UnreadableLog()
    mask = tf.constant([[1.0, 1.0, 1.0, 0.0]])
    unreadable = np.zeros((1, 4, 3), bool)
    unreadable[0, 1, 2] = True  # user 1's third example
    masked = zero_weight_unreadable(mask, tf.constant(unreadable), tf.constant(7, tf.int64),
                                    tf.constant(0, tf.int64), log)
    np.testing.assert_array_equal(masked.numpy(), [[1.0, 0.0, 1.0, 0.0]])
    assert log.total() == 1 and log.total(below_step=7) == 0  # step 7 read ahead, not trained: left out


def test_serialized_read_names_each_bad_record_and_keeps_every_good_row():
    """Two bad records among 20 read with 4 padding slots: the good rows equal the records
    decoded by numpy, the bad and padding rows are zeros, and only the bad are unreadable."""
    x, y = data()
    records = Serialized(x, y, None)
    records.rows[3], records.rows[11] = b"\x00", "text"
    source = SerializedSource(records, parse)
    indices = np.concatenate([np.arange(20), np.zeros(4, np.int64)])
    mask = np.concatenate([np.ones(20), np.zeros(4)]).astype("float32")
    read_x, read_y, _, unreadable = source.read_tolerant(indices, mask)
    assert np.flatnonzero(unreadable).tolist() == [3, 11]
    for slot in range(24):
        expected = x[slot] if slot < 20 and slot not in (3, 11) else np.zeros(FEATURES, np.float32)
        np.testing.assert_array_equal(read_x[slot], expected)
    np.testing.assert_array_equal(read_y[:3], y[:3])
    assert set(source.unreadable_log().named()) == {3, 11}


def _dataset_of_bytes(x, y, corrupt_bad: bool):
    """An unbatched tf.data pipeline (random access, read through ``DatasetSource``): record i
    is stored as bytes and decoded by a per-example map; record BAD's bytes are truncated
    when ``corrupt_bad``, so its map raises (reshape of 3 floats into [6])."""
    rows = [x[i].astype(np.float32).tobytes() for i in range(N)]
    if corrupt_bad:
        rows[BAD] = rows[BAD][:12]
    decode = lambda raw, target: (tf.reshape(tf.io.decode_raw(raw, tf.float32), [FEATURES]), target)  # noqa: E731
    return tf.data.Dataset.from_tensor_slices((np.asarray(rows, object), y)).map(decode)


def test_a_record_whose_dataset_map_raises_trains_as_a_zero_weight_example():
    """DatasetSource (an unbatched pipeline read by tf.data.experimental.at): before, the first
    step that sampled record BAD stopped training with an InvalidArgumentError."""
    from tf_dp.sampling.sources import DatasetSource, example_source

    x, y = data()
    assert isinstance(example_source(_dataset_of_bytes(x, y, True)), DatasetSource)  # the path under test
    assert times_sampled(BAD) >= 2
    trained, reference, with_record = linear_model(), linear_model(), linear_model()
    history, warned = fit(trained, _dataset_of_bytes(x, y, True))
    fit(reference, _dataset_of_bytes(*neighbour(x, y), False))
    fit(with_record, _dataset_of_bytes(x, y, False))
    assert int(trained.privacy_ledger.steps.numpy()) == STEPS
    for a, b in zip(trained.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(a, b)  # the neighbouring dataset's release, exactly
    assert not all(np.array_equal(a, b) for a, b in zip(trained.get_weights(), with_record.get_weights()))
    assert trained.unreadable_examples == times_sampled(BAD) == history.unreadable_examples
    assert reference.unreadable_examples == 0 and with_record.unreadable_examples == 0
    assert len(warned) == 1 and f"example {BAD}" in warned[0]
