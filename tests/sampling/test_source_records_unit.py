"""A random-access source whose records are BATCHES (``grain.MapDataset.source(s).batch(32)``,
or a hand-made one) is refused: read as examples it would be accounted with N = number of
batches. Whether records are examples is read from the model's input shape; an unbuilt model
(shape unknown) is refused with the fix, as tf.data is."""

import keras
import numpy as np
import pytest

import tf_dp
from tests.harness import sparse_ce

PEOPLE, FEATURES, CLASSES, PER_RECORD = 256, 5, 2, 32


def people():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(PEOPLE, FEATURES)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32")


class Examples:
    """Record i = person i."""

    def __init__(self):
        self.x, self.y = people()

    def __len__(self):
        return PEOPLE

    def __getitem__(self, index):
        return self.x[index], self.y[index]


class Batches(Examples):
    """Record i = people [32 i, 32 i + 32): a batched source made by hand."""

    def __len__(self):
        return PEOPLE // PER_RECORD

    def __getitem__(self, index):
        rows = slice(PER_RECORD * index, PER_RECORD * (index + 1))
        return self.x[rows], self.y[rows]


class Net(tf_dp.DPModel):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(CLASSES)

    def call(self, inputs):
        return self.out(self.hidden(inputs))


def compiled(net, jit_compile=False):
    net.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=3), loss=sparse_ce,
                jit_compile=jit_compile)
    return net


def functional():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    return tf_dp.DPModel(inputs, keras.layers.Dense(CLASSES)(inputs))


def built_subclassed():
    net = Net()
    net.build((None, FEATURES))
    return net


def grain_batches():
    grain = pytest.importorskip("grain", reason="grain is not installed")
    return grain.MapDataset.source(Examples()).batch(PER_RECORD)


@pytest.mark.parametrize("make_source", [Batches, grain_batches], ids=["hand-made", "grain"])
@pytest.mark.parametrize("make_model", [functional, built_subclassed], ids=["functional", "built-subclassed"])
@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_source_of_batches_is_refused_not_accounted_with_n_batches(make_source, make_model, jit_compile):
    source = make_source()
    x0, _ = source[0]
    assert len(source) == PEOPLE // PER_RECORD and len(np.unique(np.asarray(x0)[:, 0])) == PER_RECORD  # 32 people
    net = compiled(make_model(), jit_compile)
    with pytest.raises(ValueError, match=r"(?s)BATCHES.*N = number of batches"):
        net.fit(source, batch_size=2, epochs=1, steps_per_epoch=1, verbose=0)
    assert int(net.privacy_ledger.steps.numpy()) == 0


@pytest.mark.parametrize("make_source", [Batches, grain_batches, Examples], ids=["hand-made", "grain", "examples"])
def test_an_unbuilt_model_cannot_tell_records_from_batches_and_is_refused_with_the_fix(make_source):
    net = compiled(Net())
    with pytest.raises(ValueError, match=r"(?s)single examples or batches.*not built.*model\.build"):
        net.fit(make_source(), batch_size=2, epochs=1, steps_per_epoch=1, verbose=0)
    assert int(net.privacy_ledger.steps.numpy()) == 0


@pytest.mark.parametrize("make_model", [functional, built_subclassed], ids=["functional", "built-subclassed"])
def test_a_source_of_examples_trains_with_n_people(make_model):
    net = compiled(make_model())
    net.fit(Examples(), batch_size=16, epochs=1, steps_per_epoch=2, verbose=0, sampling_seed=0)
    phase = net.privacy_ledger.phases()[0]
    assert (phase.scheme, phase.num_examples, phase.steps) == ("poisson", PEOPLE, 2)


def test_a_grain_source_of_examples_trains_with_n_people():
    grain = pytest.importorskip("grain", reason="grain is not installed")
    net = compiled(functional())
    net.fit(grain.MapDataset.source(Examples()).map(lambda r: (r[0] * 2, r[1])), batch_size=16, epochs=1,
            steps_per_epoch=1, verbose=0, sampling_seed=0)
    assert net.privacy_ledger.phases()[0].num_examples == PEOPLE
