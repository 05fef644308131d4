"""Cyclic Poisson sampling (docs/algorithms.md §10): the participation pattern the amplified-BandMF
account assumes — each example only in steps ≡ its group (mod b), at rate q_b = b·L/N there."""

import numpy as np
import pytest

from tf_dp.sampling import CyclicPoissonSampler


def _drawn(sampler, step):
    indices, mask = sampler.batch(step)
    return indices.reshape(-1)[mask.reshape(-1) == 1]


def _participation(sampler, steps):
    """[N, T] 0/1 matrix of who joined which step."""
    joined = np.zeros((sampler.num_examples, steps), dtype=np.int64)
    for t in range(steps):
        drawn = _drawn(sampler, t)
        assert len(np.unique(drawn)) == len(drawn)  # at most once per step
        joined[drawn, t] = 1
    return joined


def test_every_example_joins_only_steps_of_one_residue_mod_b():
    n, batch, bands, steps = 600, 12, 4, 240
    joined = _participation(CyclicPoissonSampler(n, batch, bands, seed=5), steps)
    residues = [set(np.flatnonzero(row) % bands) for row in joined]
    assert all(len(r) <= 1 for r in residues)
    assert sum(len(r) for r in residues) > 0.99 * n  # (almost) everyone joined: the check is not vacuous
    # any two participations of one example are ≥ b steps apart (the band's columns never overlap)
    gaps = [np.diff(np.flatnonzero(row)) for row in joined]
    assert min(g.min() for g in gaps if len(g)) >= bands
    # the test can fail: plain Poisson sampling at L/N breaks it
    plain = (np.random.default_rng(0).random((n, steps)) < batch / n).astype(int)
    assert any(len(set(np.flatnonzero(row) % bands)) > 1 for row in plain)


def test_groups_are_uniform_and_sampled_at_rate_b_l_over_n():
    n, batch, bands, steps = 2000, 25, 5, 1000
    sampler = CyclicPoissonSampler(n, batch, bands, seed=11)
    assert sampler.sampling_rate == sampler.sampling_rate_per_group == pytest.approx(bands * batch / n)
    joined = _participation(sampler, steps)
    groups = np.array([np.flatnonzero(row)[0] % bands for row in joined])  # all joined at least once here
    sizes = np.bincount(groups, minlength=bands)
    # group sizes ~ Multinomial(N, 1/b): each within 5 standard deviations of N/b
    assert np.all(np.abs(sizes - n / bands) < 5 * np.sqrt(n * (1 / bands) * (1 - 1 / bands)))
    # per example: joins among its group's T/b steps ~ Binomial(T/b, q_b); pooled rate vs q_b
    q_b, own_steps = bands * batch / n, steps // bands
    pooled = joined.sum() / (n * own_steps)
    assert abs(pooled - q_b) < 5 * np.sqrt(q_b * (1 - q_b) / (n * own_steps))
    # realized batch sizes: mean L (expected batch size), Binomial(|group|, q_b) per step
    batch_sizes = joined.sum(axis=0)
    assert abs(batch_sizes.mean() - batch) < 5 * np.sqrt(batch * (1 - q_b) / steps) + 5 * np.std(sizes) * q_b
    for t in range(bands):
        assert abs(batch_sizes[t::bands].mean() - sizes[t] * q_b) < 5 * np.sqrt(sizes[t] * q_b / own_steps)


def test_batches_are_a_function_of_seed_and_step_and_padding_is_masked():
    a, b = CyclicPoissonSampler(500, 10, 4, seed=3), CyclicPoissonSampler(500, 10, 4, seed=3)
    stream = a.stream(first_step=7)
    for t in range(7, 12):
        indices, mask = next(stream)
        np.testing.assert_array_equal(indices, b.batch(t)[0])
        np.testing.assert_array_equal(mask, b.batch(t)[1])
        assert indices.shape[1] == a.physical_batch_size and set(np.unique(mask)) <= {0.0, 1.0}
    assert a.next_step == 12
    other = CyclicPoissonSampler(500, 10, 4, seed=4)
    assert any(not np.array_equal(_drawn(other, t), _drawn(a, t)) for t in range(4))
    big = CyclicPoissonSampler(400, 40, 2, physical_batch_size=8, seed=0, chunk_multiple=2)
    indices, mask = big.batch(0)
    assert indices.shape[0] % 2 == 0 and indices.shape[1] == 8 and mask.sum() == len(_drawn(big, 0))


def test_secure_mode_draws_the_groups_from_the_os_once():
    with pytest.raises(ValueError, match="no `seed`"):
        CyclicPoissonSampler(100, 5, 2, seed=1, secure=True)
    sampler = CyclicPoissonSampler(1000, 10, 4, secure=True)
    assert sampler.seed is None
    joined = _participation(sampler, 80)
    assert all(len(set(np.flatnonzero(row) % 4)) <= 1 for row in joined)  # one assignment for the sampler
    another = CyclicPoissonSampler(1000, 10, 4, secure=True)
    assert any(not np.array_equal(m1, m2) for m1, m2 in zip(sampler._members, another._members))


def test_a_rate_above_one_is_refused_naming_batch_size_and_num_bands():
    with pytest.raises(ValueError, match=r"num_bands=4 and batch_size=30.*batch_size ≤ 25"):
        CyclicPoissonSampler(100, 30, 4)
    CyclicPoissonSampler(100, 25, 4)  # q_b = 1 exactly is allowed
    with pytest.raises(ValueError, match="num_bands"):
        CyclicPoissonSampler(100, 5, 0)


def test_one_band_is_poisson_sampling_over_everyone():
    sampler = CyclicPoissonSampler(300, 30, 1, seed=2)
    assert sampler.sampling_rate == pytest.approx(0.1)
    joined = _participation(sampler, 400)
    assert abs(joined.mean() - 0.1) < 5 * np.sqrt(0.1 * 0.9 / joined.size)


def test_the_scheme_fit_picks_for_bandmf():
    from tf_dp.noise import BandMF
    from tf_dp.sampling.schemes import scheme_for_fit

    scheme = scheme_for_fit(BandMF(4), 1000, 20)
    assert scheme.name == "cyclic_poisson"
    assert scheme.sampling_rate == pytest.approx(0.08) and scheme.ledger_parameter == 4.0 and scheme.new_segment
    sampler = scheme.sampler(None, 7, False)
    assert isinstance(sampler, CyclicPoissonSampler) and sampler.num_bands == 4
    np.testing.assert_array_equal(sampler.batch(3)[0], CyclicPoissonSampler(1000, 20, 4, seed=7).batch(3)[0])
    with pytest.raises(ValueError, match="num_bands=4 and batch_size=300"):
        scheme_for_fit(BandMF(4), 1000, 300)
