"""Whether a dataset's elements are examples or batches is decided from facts
(the model's input rank, the dataset's batch transformations), never guessed from a shape.

Guessing "unbatched" for batches turns every batch into one "example": N = number of
batches and a Poisson ε far too small for the individuals in them.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.harness import sparse_ce
from tf_dp.accounting import compute_epsilon
from tf_dp.models.data import is_batched_dataset

N, FEATURES, CLASSES, BATCH = 200, 6, 3, 20


class Net(tf_dp.DPModel):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(CLASSES)

    def call(self, inputs):
        return self.out(self.hidden(inputs))


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, FEATURES)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32")


def rows():
    return tf.data.Dataset.from_tensor_slices(data())


def functional():
    inputs = keras.Input((FEATURES,))
    return tf_dp.DPModel(inputs, keras.layers.Dense(CLASSES)(inputs))


def compiled(model):
    model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0), loss=sparse_ce)
    return model


def test_subclassed_model_with_drop_remainder_batches_is_never_accounted_as_poisson_over_batches():
    model = compiled(Net())
    with pytest.warns(UserWarning, match="BATCHED"):
        model.fit(rows().batch(BATCH, drop_remainder=True), batch_size=2, epochs=1, verbose=0)
    phase = model.privacy_ledger.phases()[0]
    assert phase.scheme == "batches" and phase.steps == N // BATCH
    assert model.get_epsilon() > 3 * compute_epsilon(N, BATCH, 1.0, steps=N // BATCH)


def test_unbuilt_subclassed_model_with_a_dataset_of_unknown_unit_is_refused_with_the_fix():
    model = compiled(Net())
    with pytest.raises(ValueError, match=r"single examples or batches.*model\.build"):
        model.fit(rows(), batch_size=BATCH, epochs=1, verbose=0)
    assert int(model.privacy_ledger.steps.numpy()) == 0


def test_subclassed_model_built_first_trains_an_unbatched_dataset_with_poisson_sampling():
    model = compiled(Net())
    model(np.zeros((1, FEATURES), "float32"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.fit(rows(), batch_size=BATCH, epochs=1, verbose=0, sampling_seed=0)
    phase = model.privacy_ledger.phases()[0]
    assert (phase.scheme, phase.num_examples) == ("poisson", N)


def test_decision_follows_the_model_input_rank_when_known():
    batches = rows().batch(BATCH, drop_remainder=True)
    built = Net()
    built.build((None, FEATURES))
    for model in (functional(), built):
        assert is_batched_dataset(batches, model) is True
        assert is_batched_dataset(rows(), model) is False
    prebatched = tf.data.Dataset.from_tensor_slices(data()[0].reshape(-1, BATCH, FEATURES))  # no batch op
    assert is_batched_dataset(prebatched, functional()) is True
    with pytest.raises(ValueError, match="rank 3"):
        is_batched_dataset(tf.data.Dataset.from_tensor_slices(np.zeros((4, 2, BATCH, FEATURES))), functional())


def test_unbuilt_model_reads_the_dataset_graph_and_refuses_when_it_says_nothing():
    from tf_dp.models.data import dataset_ends_in_batch

    ends_in_batch = [
        rows().batch(BATCH, drop_remainder=True),
        rows().batch(BATCH).shuffle(4).map(lambda x, y: (x * 2, y)).prefetch(2).repeat(),
        rows().padded_batch(BATCH),
        tf.data.Dataset.zip((rows().map(lambda x, y: x).batch(BATCH), rows().map(lambda x, y: y).batch(BATCH))),
    ]
    for dataset in ends_in_batch:
        assert dataset_ends_in_batch(dataset)
        assert is_batched_dataset(dataset, Net()) is True
    unknown = [
        rows(),  # single examples, or slices of pre-batched arrays: the model's shape would tell
        tf.data.Dataset.from_tensor_slices(data()[0].reshape(-1, BATCH, FEATURES)),
        rows().batch(BATCH).unbatch(),
        tf.data.Dataset.zip((rows().map(lambda x, y: x).batch(BATCH), rows().map(lambda x, y: y))),
    ]
    for dataset in unknown:
        assert not dataset_ends_in_batch(dataset)
        with pytest.raises(ValueError, match="single examples or batches"):
            is_batched_dataset(dataset, Net())


def test_an_unreadable_graph_is_no_fact_and_other_errors_propagate(monkeypatch):
    """tf.data failing to serialize the graph (an op error, e.g. over protobuf's 2 GB) or bytes
    that do not parse: no fact, so not "batched"; any other error is a bug and propagates."""
    from tf_dp.models.data import dataset_ends_in_batch
    from tf_dp.sampling.dataset_graph import read_graph

    def serialized_as(outcome):
        def serialize(*args, **kwargs):
            if isinstance(outcome, Exception):
                raise outcome
            return tf.constant(outcome)
        return serialize

    for unreadable in (tf.errors.InvalidArgumentError(None, None, "GraphDef over 2 GB"), b"\xff\xff not a GraphDef"):
        dataset = rows().batch(BATCH)
        monkeypatch.setattr(dataset, "_as_serialized_graph", serialized_as(unreadable))
        assert read_graph(dataset) is None
        assert not dataset_ends_in_batch(dataset)
    dataset = rows().batch(BATCH)
    monkeypatch.setattr(dataset, "_as_serialized_graph", serialized_as(RuntimeError("a bug in the reader")))
    with pytest.raises(RuntimeError, match="a bug in the reader"):
        dataset_ends_in_batch(dataset)
