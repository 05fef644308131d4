"""A pipeline that presents one example twice in one batch is refused: each copy is clipped
separately, so the example moves the noisy sum by k·C while the step is accounted at C (a
repeat/concatenate upstream of .batch()); a random-access source that repeats its records
counts one person k times in N. ``ds.batch(L).repeat()`` keeps each batch duplicate-free and
stays allowed. A map that copies values (``ds.batch(L).map(lambda b: concat([b, b]))``) cannot be
told from any other map: a batched dataset must present each example at most once per batch."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.harness import sparse_ce

N, FEATURES, CLASSES, L = 32, 4, 2, 16


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, FEATURES)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32")


def rows(offset=0.0):
    x, y = data()
    return tf.data.Dataset.from_tensor_slices((x + offset, y))


def model(jit_compile=False):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    net = tf_dp.DPModel(inputs, keras.layers.Dense(CLASSES)(keras.layers.Dense(8, activation="tanh")(inputs)))
    net.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=4.0, seed=3), loss=sparse_ce,
                jit_compile=jit_compile)
    return net


DUPLICATING = {
    "shuffle.repeat.batch": (lambda: rows().shuffle(N, seed=1).repeat().batch(24), r"repeat\(\)"),  # 24 ∤ N
    "repeat.shuffle.batch": (lambda: rows().repeat().shuffle(L, seed=1).batch(L), r"repeat\(\)"),
    "repeat.batch(L > N)": (lambda: rows().repeat().batch(2 * N), r"repeat\(\)"),
    "repeat(3).batch": (lambda: rows().repeat(3).batch(2 * N), r"repeat\(3\)"),
    "concatenate(self)": (lambda: (lambda ds: ds.concatenate(ds))(rows()).batch(2 * N), "concatenate"),
    "concatenate(copy)": (lambda: rows().concatenate(rows()).batch(2 * N), "concatenate"),
    "interleave(captured)": (lambda: tf.data.Dataset.range(2).interleave(lambda _: rows(), cycle_length=2).batch(L),
                             "interleave"),
    "flat_map(repeat)": (lambda: rows().flat_map(lambda a, b: tf.data.Dataset.from_tensors((a, b)).repeat(2)).batch(L),
                         "repeat"),
    "sample_from_datasets(same)": (lambda: tf.data.Dataset.sample_from_datasets([rows(), rows()], seed=1).batch(L),
                                   "sample_from_datasets"),
    "repeat.window.flat_map(batch)": (lambda: rows().repeat().window(2 * N).flat_map(
        lambda a, b: tf.data.Dataset.zip((a.batch(2 * N), b.batch(2 * N)))), r"repeat\(\)"),
    "repeat.bucket_by_sequence_length": (lambda: rows().repeat().bucket_by_sequence_length(
        lambda a, b: tf.constant(1), [5], [2 * N, 2 * N]), r"repeat\(\)"),
    "batch.repeat.unbatch.batch": (lambda: rows().batch(8).repeat(3).unbatch().batch(2 * N), r"repeat\(3\)"),
    "zip(skip)": (lambda: tf.data.Dataset.zip((rows().map(lambda a, b: a),
                                                rows().skip(1).map(lambda a, b: b))).batch(L),
                  "zip"),
    # A one-to-many map before unbatch, datasets built from tensors inside a flat_map, and a batch of repeated
    # batches (an attacker's review found these accepted):
    "map(stack twice).unbatch.batch": (lambda: rows().map(lambda a, b: (tf.stack([a, a]), tf.stack([b, b])))
                                       .unbatch().batch(L), "unbatch"),
    "flat_map(from_tensor_slices of a stacked pair)": (lambda: rows().flat_map(
        lambda a, b: tf.data.Dataset.from_tensor_slices((tf.stack([a, a]), tf.stack([b, b])))).batch(L),
        "flat_map"),
    "flat_map(from_tensors.concatenate)": (lambda: rows().flat_map(
        lambda a, b: tf.data.Dataset.from_tensors((a, b)).concatenate(tf.data.Dataset.from_tensors((a, b)))).batch(L),
        "flat_map"),
    "batch.repeat.rebatch": (lambda: rows().take(8).batch(8).repeat(2).rebatch(L), r"rebatch\(\).*repeat\(2\)"),
    "batch.repeat.batch": (lambda: rows().take(8).batch(8).repeat(2).batch(2).map(
        lambda a, b: (tf.reshape(a, [-1, FEATURES]), tf.reshape(b, [-1]))), r"map\(\).*whole batches.*repeat\(2\)"),
}


def first_feature_per_batch(dataset, batches=4):
    """Independent witness: the first x feature (distinct per example) of each batch."""
    out = []
    for x, y in dataset.take(batches).as_numpy_iterator():
        out.append(np.asarray(x)[:, 0])
    return out


@pytest.mark.parametrize("name", sorted(DUPLICATING))
@pytest.mark.parametrize("jit_compile", [False, True])
def test_each_duplicating_idiom_is_refused_naming_it_and_the_fix(name, jit_compile):
    build, idiom = DUPLICATING[name]
    dataset = build()
    if name != "zip(skip)":  # the idiom really puts one example twice into one batch (the zip: x_j with y_{j+1})
        assert any(len(np.unique(batch)) < len(batch) for batch in first_feature_per_batch(dataset))
    net = model(jit_compile)
    with pytest.raises(ValueError, match=rf"(?s){idiom}.*(\.batch\(L\)\.repeat\(\)|without repeat)"):
        net.fit(dataset, batch_size=L, epochs=1, steps_per_epoch=2, verbose=0)
    assert int(net.privacy_ledger.steps.numpy()) == 0


@pytest.mark.parametrize("jit_compile", [False, True])
def test_repeat_after_batch_is_sound_and_trains_as_fixed_batches(jit_compile):
    dataset = rows().shuffle(N, seed=1).batch(L, drop_remainder=True).repeat()
    for batch in first_feature_per_batch(dataset, batches=6):  # independent: no batch holds an example twice
        assert len(np.unique(batch)) == len(batch)
    net = model(jit_compile)
    with pytest.warns(UserWarning, match="BATCHED"):
        net.fit(dataset, epochs=1, steps_per_epoch=3, verbose=0)
    phase = net.privacy_ledger.phases()[0]
    assert (phase.scheme, phase.steps, phase.expected_batch_size) == ("batches", 3, L)


def test_concatenating_different_data_is_refused_as_off_the_allow_list():
    """Changed by issue 31 (one door): concatenate is off the allow-list whatever it joins (the graph
    cannot prove two datasets hold different people); concatenating the arrays is the fix."""
    net = model()
    with pytest.raises(ValueError, match=r"(?s)concatenate\(\).*\.batch\(L\)\.repeat\(\)"):
        net.fit(rows().concatenate(rows(offset=10.0)).batch(L), epochs=1, steps_per_epoch=2, verbose=0)
    assert int(net.privacy_ledger.steps.numpy()) == 0


def test_an_unbatched_concatenation_is_refused_as_a_source_and_concatenated_arrays_count_each_once():
    net = model()
    twice = (lambda ds: ds.concatenate(ds))(rows())
    for dataset in (twice, rows().concatenate(rows(offset=10.0))):  # the second: refused since issue 31
        with pytest.raises(ValueError, match=r"(?s)concatenate\(\).*as arrays"):
            net.fit(dataset, batch_size=8, epochs=1, steps_per_epoch=1, verbose=0)
    assert int(net.privacy_ledger.steps.numpy()) == 0
    x, y = data()
    both = tf.data.Dataset.from_tensor_slices((np.concatenate([x, x + 10.0]), np.concatenate([y, y])))
    net.fit(both, batch_size=8, epochs=1, steps_per_epoch=1, verbose=0, sampling_seed=0)
    assert net.privacy_ledger.phases()[0].num_examples == 2 * N


grain = pytest.importorskip("grain", reason="grain is not installed")


class People:
    """N distinct people, record i = (x_i, y_i)."""

    def __init__(self):
        self.x, self.y = data()

    def __len__(self):
        return N

    def __getitem__(self, index):
        return self.x[index], self.y[index]


@pytest.mark.parametrize("build, idiom", [
    (lambda d: d.repeat(2), "repeat"),
    (lambda d: grain.MapDataset.concatenate([d, d]), "Concatenate"),
    (lambda d: grain.MapDataset.mix([d, d]), "Mixed"),
    (lambda d: d.repeat(3).shuffle(seed=1)[:N], "repeat"),  # len N, yet duplicates
])
def test_a_repeated_grain_source_is_refused(build, idiom):
    people = People()
    source = build(grain.MapDataset.source(people))
    seen = [float(source[i][0][0]) for i in range(len(source))]
    assert len(set(seen)) < len(seen)  # independent: some person is served twice
    net = model()
    with pytest.raises(ValueError, match=rf"(?s)repeats its records.*{idiom}"):
        net.fit(source, batch_size=8, epochs=1, steps_per_epoch=1, verbose=0)
    assert int(net.privacy_ledger.steps.numpy()) == 0


def test_a_reshuffled_or_sliced_grain_source_counts_each_person_once():
    source = grain.MapDataset.source(People()).shuffle(seed=1)[: N - 4]
    net = model()
    net.fit(source, batch_size=8, epochs=1, steps_per_epoch=1, verbose=0, sampling_seed=0)
    assert net.privacy_ledger.phases()[0].num_examples == N - 4
