"""A grain MapDataset as a random-access source of fit: only the sampled indices
are read (through grain's own map), and the same sampling seed gives the same batches — so
the same weights — as fit on the arrays the map computes."""

import numpy as np
import pytest

grain = pytest.importorskip("grain", reason="grain is not installed (pip install tf-dp[datasets])")

from tests.harness import small_dp_classifier  # noqa: E402
from tf_dp.sampling import PoissonSampler  # noqa: E402

N, FEATURES, CLASSES, HEAD = 240, 6, 3, 67  # HEAD: rows the row-independence guard and the build read


class Counting:
    """The innermost grain source: records which indices grain asked for."""

    def __init__(self, n):
        self.n, self.reads = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        self.reads.append(int(index))
        return {"id": int(index)}


def features_of(record):  # grain's map: example i computed from its index, as a decoder would
    i = record["id"]
    rng = np.random.default_rng(i)
    return rng.normal(size=FEATURES).astype(np.float32), np.int32(i % CLASSES)


def model():
    return small_dp_classifier(FEATURES, CLASSES, sigma=0.7)


def test_grain_map_dataset_reads_only_sampled_indices_and_equals_arrays():
    counting = Counting(N)
    dataset = grain.MapDataset.source(counting).map(features_of)
    x = np.stack([features_of({"id": i})[0] for i in range(N)])  # independent: the map run by hand
    y = np.array([features_of({"id": i})[1] for i in range(N)])
    arrays, grained = model(), model()
    arrays.fit(x, y, batch_size=24, epochs=1, steps_per_epoch=3, sampling_seed=6, verbose=0)
    grained.fit(dataset, batch_size=24, epochs=1, steps_per_epoch=3, sampling_seed=6, verbose=0)
    for a, b in zip(arrays.get_weights(), grained.get_weights()):
        np.testing.assert_array_equal(a, b)
    sampler = PoissonSampler(N, 24, None, 6)
    batches = [set(sampler.batch(t)[0][sampler.batch(t)[1] == 1].tolist()) for t in range(12)]  # + prefetch
    assert set(counting.reads) <= set(range(HEAD)) | set().union(*batches)
    assert set().union(*batches[:3]) <= set(counting.reads)  # the three steps' examples were read


def test_a_grain_map_that_fails_is_named_with_its_index():
    def bad(record):
        if record["id"] == 100:
            raise ValueError("corrupt image")
        return features_of(record)

    dataset = grain.MapDataset.source(Counting(N)).map(bad)
    # Sampled during training: a zero-weight example, named after training (issue 31 item 6), not an exception
    with pytest.warns(UserWarning, match=r"example 100: .*corrupt image.*float32\[6\]"):
        trained = model()
        trained.fit(dataset, batch_size=N // 2, epochs=1, steps_per_epoch=4, sampling_seed=0, verbose=0)
    assert trained.unreadable_examples >= 1 and int(trained.privacy_ledger.steps.numpy()) == 4
