"""Poisson sampling: the batch distribution the accountant assumes."""

import numpy as np
import pytest

from tf_dp.sampling import PoissonSampler, choose_physical_batch_size, chunk, sample_poisson_batch


def test_batch_size_mean_and_variance_match_binomial():
    n, q, draws = 2000, 0.05, 4000
    rng = np.random.default_rng(0)
    sizes = np.array([len(sample_poisson_batch(rng, n, q)) for _ in range(draws)])
    mean, var = n * q, n * q * (1 - q)  # L and L(1−q)
    # Standard error of the sample mean: sqrt(var/draws); of the sample variance:
    # var·sqrt(2/(draws−1)) (normal approximation). Both checked at 5 standard errors.
    assert abs(sizes.mean() - mean) < 5 * np.sqrt(var / draws)
    assert abs(sizes.var(ddof=1) - var) < 5 * var * np.sqrt(2 / (draws - 1))


def test_every_example_is_sampled_independently_at_rate_q():
    n, q, draws = 50, 0.2, 5000
    rng = np.random.default_rng(1)
    counts = np.zeros(n)
    pair = 0  # examples 0 and 1 drawn together
    for _ in range(draws):
        batch = sample_poisson_batch(rng, n, q)
        counts[batch] += 1
        pair += (0 in batch) and (1 in batch)
    assert counts.min() > 0
    tolerance = 5 * np.sqrt(q * (1 - q) / draws)  # per-example frequency, 5 standard errors
    assert np.all(np.abs(counts / draws - q) < tolerance)
    assert abs(pair / draws - q * q) < 5 * np.sqrt(q * q * (1 - q * q) / draws)  # independence


def test_chunks_keep_every_drawn_example_and_mask_padding():
    indices = np.arange(0, 23) * 3
    padded, mask = chunk(indices, 8)
    assert padded.shape == mask.shape == (3, 8)
    np.testing.assert_array_equal(padded.reshape(-1)[mask.reshape(-1) == 1], indices)
    assert mask.sum() == 23
    empty, empty_mask = chunk(np.array([], np.int64), 8)
    assert empty.shape == (1, 8) and empty_mask.sum() == 0


def test_sampler_overflow_uses_more_chunks_not_drops():
    sampler = PoissonSampler(1000, 100, physical_batch_size=64, seed=0)
    for _, (indices, mask) in zip(range(20), sampler):
        assert indices.shape[1] == 64 and indices.shape[0] >= 2
        assert len(np.unique(indices[mask == 1])) == mask.sum()


def test_physical_batch_size_covers_typical_batches():
    physical = choose_physical_batch_size(60000, 256 / 60000)
    assert 256 <= physical <= 256 + 6 * 16 and physical % 8 == 0


def test_sampler_rejects_batch_larger_than_dataset():
    with pytest.raises(ValueError, match="batch_size"):
        PoissonSampler(10, 11)


def test_fit_stream_samples_at_the_rate_the_ledger_records():
    """The stream DPModel.fit trains on draws Poisson batches of mean L = q·N and carries
    L as the denominator: if either drifted from what the ledger records, this fails."""
    from tf_dp.models.data import poisson_dataset

    n, batch, steps = 500, 25, 400
    x = np.arange(n, dtype=np.float32)[:, None]
    y = np.arange(n, dtype=np.int32)
    sizes, seen = [], set()
    for element in poisson_dataset(x, y, n, batch, None, seed=0).take(steps):
        mask = element["mask"].numpy().reshape(-1)
        rows = element["x"].numpy().reshape(-1)[mask == 1]
        np.testing.assert_array_equal(rows, element["y"].numpy().reshape(-1)[mask == 1])  # x, y aligned
        assert np.all(element["expected_batch_size"].numpy() == batch)
        sizes.append(mask.sum())
        seen.update(rows.astype(int))
    q = batch / n
    assert abs(np.mean(sizes) - batch) < 5 * np.sqrt(batch * (1 - q) / steps)  # 5 standard errors
    assert len(seen) > 0.99 * n


def test_batch_of_step_t_depends_only_on_seed_and_t():
    sampler = PoissonSampler(500, 25, seed=3)
    first = [sampler.batch(t) for t in range(4)]
    again = PoissonSampler(500, 25, seed=3)
    resumed = [b for _, b in zip(range(2), again.stream(first_step=2))]  # a restarted pipeline at step 2
    for (i1, m1), (i2, m2) in zip(first[2:], resumed):
        assert np.array_equal(i1, i2) and np.array_equal(m1, m2)
    drawn = [set(i[m > 0].tolist()) for i, m in first]
    assert all(drawn[a] != drawn[b] for a in range(4) for b in range(a))  # fresh randomness per step
    assert not np.array_equal(PoissonSampler(500, 25, seed=4).batch(0)[0], first[0][0])
