"""Random-access sources: fit reads only the sampled examples, from any object
with __len__/__getitem__, numpy.memmap, h5py-like arrays, datasets and TFRecord shards;
the same seed gives the same batches and weights as arrays; bad records are named."""

import os
import tracemalloc
import warnings

import numpy as np
import pytest
import tensorflow as tf

from tests.harness import CountingSource, small_dp_classifier
from tf_dp.models.data import poisson_dataset
from tf_dp.sampling import PoissonSampler
from tf_dp.sampling.sources import RecordSource, SourceError, TFRecordSource, example_source

N, FEATURES, CLASSES = 240, 6, 3
HEAD = 67  # rows the row-independence guard and the model build read (GUARD_ROWS + DONOR_SEARCH)


def data(n=N):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, FEATURES)).astype("float32"), rng.integers(0, CLASSES, n).astype("int32")


class Synthetic:
    """N examples of 784 floats computed on demand: 3 GB if it were materialized."""

    def __init__(self, n):
        self.n, self.reads = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        self.reads += 1
        return np.full(784, index % 7, np.float32), np.int32(index % 10)


def model(sigma=0.5, features=FEATURES, engine="ghost"):
    return small_dp_classifier(features, CLASSES if features == FEATURES else 10, sigma, engine)


def same_weights(a, b):
    return all(np.array_equal(u, v) for u, v in zip(a.get_weights(), b.get_weights()))


def sampled_indices(n, batch, steps, seed):
    sampler = PoissonSampler(n, batch, None, seed)
    return [sampler.batch(t)[0][sampler.batch(t)[1] == 1] for t in range(steps)]


def test_fit_on_a_source_reads_only_sampled_examples_and_equals_arrays_bit_for_bit():
    x, y = data()
    arrays, sourced = model(), model()
    arrays.fit(x, y, batch_size=24, epochs=1, steps_per_epoch=4, sampling_seed=5, verbose=0)
    source = CountingSource(x, y)
    sourced.fit(source, batch_size=24, epochs=1, steps_per_epoch=4, sampling_seed=5, verbose=0)
    assert same_weights(arrays, sourced)  # same batches (f(seed, t)), same steps
    allowed = set(range(HEAD)) | {int(i) for s in sampled_indices(N, 24, 12, 5) for i in s}  # + prefetched steps
    assert set(source.reads) <= allowed
    first_four = {int(i) for s in sampled_indices(N, 24, 4, 5) for i in s}
    assert first_four <= set(source.reads)


def test_reads_and_memory_grow_with_the_batch_not_with_n():
    tracemalloc.start()
    try:
        source = Synthetic(1_000_000)  # 3 GB of float32 rows if materialized
        m = model(features=784)
        m.fit(source, batch_size=32, epochs=1, steps_per_epoch=3, sampling_seed=0, verbose=0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # head (67) + probe (1) + 3 steps and what the pipeline prefetched, each ~32 examples
    assert source.reads < 1000
    assert peak < 64 * 2**20  # numpy allocations traced: far below one copy of the data (3 GB)


def test_padding_rows_are_zeros_and_never_read():
    x, y = data(40)
    source = RecordSource(CountingSource(x + 10.0, y))
    source.source.reads.clear()
    stream = poisson_dataset(None, None, 40, 6, physical_batch_size=16, seed=0, source=source)
    for element in stream.take(3).as_numpy_iterator():
        pad = element["mask"] == 0
        assert pad.any() and np.all(element["x"][pad] == 0) and np.all(element["y"][pad] == 0)
        assert np.all(element["x"][~pad] >= 5)  # real rows (shifted by 10) are examples
    real = [int(i) for s in sampled_indices(40, 6, 20, 0) for i in s]  # + prefetched steps
    assert set(source.source.reads) <= set(real)  # the padding index 0 is never read unless sampled


def test_memmap_and_h5py_like_columns_stay_on_disk_and_train_like_arrays(tmp_path):
    x, y = data(4000)
    path = tmp_path / "x.f32"
    mapped = np.memmap(path, np.float32, "w+", shape=x.shape)
    mapped[:] = x
    mapped.flush()
    mapped = np.memmap(path, np.float32, "r", shape=x.shape)

    class RowCounting:  # h5py.Dataset-like: shape, dtype, __getitem__, __len__; never np.asarray'd
        def __init__(self, array):
            self.array, self.shape, self.dtype, self.rows = array, array.shape, array.dtype, 0

        def __len__(self):
            return len(self.array)

        def __getitem__(self, rows):
            rows = np.asarray(rows)
            assert rows.ndim == 1 and np.all(np.diff(rows) > 0)  # h5py needs increasing indices
            self.rows += len(rows)
            return self.array[rows]

        def __array__(self, *args, **kwargs):
            raise AssertionError("the whole column was converted")

    lazy_y = RowCounting(y)
    assert isinstance(example_source(mapped, lazy_y).x, np.memmap)
    reference, on_disk = model(), model()
    reference.fit(x, y, batch_size=24, epochs=1, steps_per_epoch=3, sampling_seed=2, verbose=0)
    on_disk.fit(mapped, lazy_y, batch_size=24, epochs=1, steps_per_epoch=3, sampling_seed=2, verbose=0)
    assert same_weights(reference, on_disk)
    assert lazy_y.rows < 1000  # the guard's head (67) and the sampled rows of the steps read (and prefetched)


def test_h5py_dataset_is_a_source(tmp_path):
    h5py = pytest.importorskip("h5py")
    x, y = data()
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["x"], f["y"] = x, y
    reference, stored = model(), model()
    reference.fit(x, y, batch_size=24, epochs=1, steps_per_epoch=2, sampling_seed=4, verbose=0)
    with h5py.File(tmp_path / "d.h5", "r") as f:
        stored.fit(f["x"], f["y"], batch_size=24, epochs=1, steps_per_epoch=2, sampling_seed=4, verbose=0)
    assert same_weights(reference, stored)


def test_records_with_a_transform_and_getitems():
    x, y = data()

    class Records:  # records are dicts; __getitems__ reads a batch (as TFDS/grain sources do)
        batched = 0

        def __len__(self):
            return N

        def __getitem__(self, i):
            return {"features": x[i].tobytes(), "label": int(y[i])}

        def __getitems__(self, indices):
            Records.batched += 1
            return [self[i] for i in indices]

    decode = lambda r: (np.frombuffer(r["features"], np.float32), r["label"])  # noqa: E731
    reference, decoded = model(), model()
    reference.fit(x, y, batch_size=24, epochs=1, steps_per_epoch=2, sampling_seed=8, verbose=0)
    decoded.fit(Records(), transform=decode, batch_size=24, epochs=1, steps_per_epoch=2, sampling_seed=8, verbose=0)
    assert Records.batched > 0
    for a, b in zip(reference.get_weights(), decoded.get_weights()):  # int64 labels cast to the spec's
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bad", ["raises", "shape", "dtype", "not_a_pair"])
def test_a_bad_record_is_named_with_its_index_and_the_expected_spec(bad):
    x, y = data()

    class Bad(CountingSource):
        def __getitem__(self, index):
            if index != 17:
                return super().__getitem__(index)
            return {"raises": lambda: 1 / 0, "shape": lambda: (x[index][:4], y[index]),
                    "dtype": lambda: (x[index].astype("complex64"), y[index]),
                    "not_a_pair": lambda: x[index]}[bad]()

    with pytest.raises(SourceError, match=r"example 17") as error:
        model().fit(Bad(x, y), batch_size=N // 2, epochs=1, steps_per_epoch=2, sampling_seed=0, verbose=0)
    if bad != "raises":
        assert "float32[6]" in str(error.value)  # the expected spec is named
    else:
        assert "ZeroDivisionError" in str(error.value)


def test_unbatched_datasets_use_random_access_and_warn_with_the_size_when_they_cannot():
    x, y = data()
    reference = model()
    reference.fit(x, y, batch_size=24, epochs=1, steps_per_epoch=2, sampling_seed=6, verbose=0)
    for dataset, warns in [(tf.data.Dataset.from_tensor_slices((x, y)), False),
                           (tf.data.Dataset.from_tensor_slices((x, y)).map(lambda a, b: (a, b)), False),
                           (tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True), True)]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m = model()
            m.fit(dataset, batch_size=24, epochs=1, steps_per_epoch=2, sampling_seed=6, verbose=0)
        messages = [str(w.message) for w in caught if "materialized" in str(w.message)]
        assert bool(messages) == warns
        if warns:
            assert f"{N:,} examples" in messages[0] and "MiB" in messages[0]
        for a, b in zip(reference.get_weights(), m.get_weights()):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_tfrecord_shards_get_a_byte_offset_index_then_random_access(tmp_path):
    x, y = data(50)
    files = [str(tmp_path / f"part-{k}.tfrecord") for k in range(2)]
    for k, path in enumerate(files):
        with tf.io.TFRecordWriter(path) as writer:
            for i in range(25 * k, 25 * (k + 1)):
                example = tf.train.Example(features=tf.train.Features(feature={
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=x[i])),
                    "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[y[i]]))}))
                writer.write(example.SerializeToString())
    source = TFRecordSource(files)
    assert len(source) == 50 and source.offset.nbytes + source.shard.nbytes + source.length.nbytes <= 50 * 16

    def parse(record):
        features = tf.train.Example.FromString(record).features.feature
        return np.array(features["x"].float_list.value, np.float32), np.int32(features["y"].int64_list.value[0])

    for i in (0, 24, 25, 49, 31):
        got = parse(source[i])
        np.testing.assert_array_equal(got[0], x[i])
        assert got[1] == y[i]
    reference, indexed = model(), model()
    reference.fit(x, y, batch_size=10, epochs=1, steps_per_epoch=2, sampling_seed=1, verbose=0)
    indexed.fit(source, transform=parse, batch_size=10, epochs=1, steps_per_epoch=2, sampling_seed=1, verbose=0)
    assert same_weights(reference, indexed)
    compressed = str(tmp_path / "c.tfrecord")
    with tf.io.TFRecordWriter(compressed, options="GZIP") as writer:
        writer.write(b"x" * 100)
    with pytest.raises(ValueError, match="fixed batches"):
        TFRecordSource([compressed])


def test_batch_of_step_t_and_restart_hold_for_sources():
    x, y = data()
    source = RecordSource(CountingSource(x, y))
    first = [e["y"] for e in
             poisson_dataset(None, None, N, 24, None, seed=3, source=source).take(4).as_numpy_iterator()]
    resumed = poisson_dataset(None, None, N, 24, None, seed=3, source=source, first_step=lambda: 2)
    for a, b in zip(first[2:], resumed.take(2).as_numpy_iterator()):
        np.testing.assert_array_equal(a, b["y"])


def test_sources_need_a_y_or_a_record_pair():
    with pytest.raises(ValueError, match="both `x` and `y`"):
        model().fit(np.zeros((10, FEATURES), "float32"), batch_size=2)
    with pytest.raises(ValueError, match="`transform` needs"):
        model().fit({"a": np.zeros((10, FEATURES), "float32")}, np.zeros(10, "int32"), transform=lambda r: r,
                    batch_size=2)


def test_file_paths_with_labels_and_a_loading_transform(tmp_path):
    x, y = data(60)
    paths = []
    for i, row in enumerate(x):
        paths.append(str(tmp_path / f"{i}.npy"))
        np.save(paths[-1], row)
    reference, from_files = model(), model()
    reference.fit(x, y, batch_size=12, epochs=1, steps_per_epoch=2, sampling_seed=3, verbose=0)
    from_files.fit(paths, y, transform=lambda record: (np.load(record[0]), record[1]), batch_size=12, epochs=1,
                   steps_per_epoch=2, sampling_seed=3, verbose=0)
    assert same_weights(reference, from_files)


def test_each_worker_reads_only_its_replicas_slice_of_the_global_batch():
    """2 worker processes on localhost (as tests/distributed/test_multi_worker.py): one global Poisson
    batch per step; each worker reads from the shared source only the chunks of its own
    replica — disjoint, together the whole batch — and training equals one device."""
    import json
    import pathlib
    import subprocess
    import sys

    from tests.distributed.test_multi_worker import _free_ports

    worker = pathlib.Path(__file__).with_name("sources_multi_worker_worker.py")
    cluster = {"worker": [f"localhost:{port}" for port in _free_ports(2)]}
    processes = [subprocess.Popen([sys.executable, str(worker)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env={**os.environ, "TF_CONFIG": json.dumps(
                                      {"cluster": cluster, "task": {"type": "worker", "index": index}})})
                 for index in range(2)]
    results = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=600)
            assert process.returncode == 0, stderr[-3000:]
            results.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for process in processes:
            process.kill()
    results.sort(key=lambda r: r["worker"])
    sampler = PoissonSampler(96, 16, None, 9, chunk_multiple=2)

    from collections import Counter

    def slot(worker, steps, counts=False):
        out = Counter()
        for t in steps:
            indices, mask = sampler.batch(t)
            width = len(mask) // 2
            part = slice(worker * width, (worker + 1) * width)
            out.update(int(i) for i in indices[part][mask[part] == 1])
        return out if counts else set(out)

    for w, result in enumerate(results):
        loaded = Counter(result["loaded"])
        done = 0  # the steps whose slice this worker read completely
        while slot(w, range(done + 1), counts=True) <= loaded:
            done += 1
        assert done >= 3  # the 3 steps trained (and what the pipeline prefetched) ...
        rest = loaded - slot(w, range(done), counts=True)
        assert rest <= slot(w, range(done, done + 16), counts=True)  # ... and nothing but this worker's chunks
        assert result["max_difference"] < 1e-5 and result["steps"] == 3
    first = [set(r["loaded"]) & slot(r["worker"], range(3)) for r in results]
    assert not (first[0] & first[1]) and first[0] | first[1] == slot(0, range(3)) | slot(1, range(3))
