"""User-level Poisson sampling (docs/algorithms.md §11).

The privacy unit is a user: every example with one user id. Each step every user joins the
batch independently with probability q_u = L_u / N_u (L_u the expected number of users per
step, N_u the number of users); each sampled user contributes m = ``examples_per_user`` of
their examples, which the train step averages before clipping once per user (the
augmentation-view mechanism of §8, one view per example of the user).

Which m examples: each user's examples are put in a secret random order π_u once (from the
seed); at step t user u contributes π_u[(t·m + j) mod n_u] for j = 0..m−1, so successive
participations cycle through all n_u examples. A user with fewer than m examples repeats
some of them within one step (each copy is one view of the same unit: the user still yields
one vector clipped to C). The selection reads only the user's own examples, with orders π_u
that are independent uniform permutations whether or not another user is present, so the
sensitivity (one user, one clipped vector) holds whatever it picks.

Batch t is a function of (seed, t) alone, as for PoissonSampler: indices [chunks, P, m]
(example indices of the sampled users; padding slots hold PAD_INDEX and are masked) and the
per-user mask [chunks, P]. With m = 1 the indices are [chunks, P], the layout of example-level
batches (one example per sampled user; no view axis).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from typing import Optional

import numpy as np
import tensorflow as tf

from tf_dp import _checks, streams
from tf_dp.accounting import events
from tf_dp.sampling.poisson import (PAD_INDEX, StepSampler, stream_seed, _uniforms, choose_physical_batch_size,
                                    sample_poisson_batch)
from tf_dp.sampling.schemes import SamplingScheme, register_sampling
from tf_dp.sampling.sources import ArraySource, DatasetSource, ExampleSource, graph_extras

ORDER_STREAM = streams.USER_ORDER.code  # orders each user's examples: beyond every step (tf_dp.streams)


def user_index_of(user_ids, num_examples: Optional[int] = None) -> np.ndarray:
    """Maps arbitrary user ids (ints, strings, any hashables) to 0..N_u−1, one per example.

    Args:
      user_ids: one id per training example, in the order of the examples.
      num_examples: N, the number of training examples (checked against len(user_ids)).

    Returns:
      int64 array [N] of user indices; N_u = max + 1 (every index has ≥ 1 example).
    """
    ids = _as_id_array(user_ids)
    if ids.ndim != 1:
        raise ValueError(f"`user_ids` must hold one id per example (a 1-D sequence), got shape {list(ids.shape)}.")
    if num_examples is not None and len(ids) != num_examples:
        raise ValueError(f"`user_ids` has {len(ids)} entries but there are {num_examples} training examples: pass "
                         "one user id per example, in the order of the examples.")
    if len(ids) == 0:
        raise ValueError("`user_ids` is empty: there are no examples to train on.")
    if ids.dtype != object:
        if ids.dtype.kind == "f" and np.isnan(ids).any():
            raise ValueError("`user_ids` contains NaN: every example needs a user id.")
        _, index = np.unique(ids, return_inverse=True)
        return index.reshape(-1).astype(np.int64)
    table: dict = {}
    index = np.empty(len(ids), np.int64)
    for row, uid in enumerate(ids):
        if uid is None or (isinstance(uid, float) and math.isnan(uid)):
            raise ValueError(f"`user_ids` has no id for example {row} ({uid!r}): every example needs a user id.")
        try:
            index[row] = table.setdefault(uid, len(table))
        except TypeError as error:
            raise TypeError(f"`user_ids` must hold hashable ids (ints, strings); example {row} has {uid!r}.") from error
    return index


def _as_id_array(user_ids) -> np.ndarray:
    if user_ids is None:
        raise ValueError("`user_ids` is required for user-level sampling: one user id per example.")
    if isinstance(user_ids, np.ndarray):
        return user_ids
    values = list(user_ids)
    if all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values):
        return np.asarray(values, np.int64)
    if all(isinstance(v, str) for v in values) or all(isinstance(v, bytes) for v in values):
        return np.asarray(values)
    array = np.empty(len(values), object)
    array[:] = values
    return array


# ------------------------------------------------------------ user ids travel with their rows
ID_BLOCK = 4096  # examples read per block when the ids are read from a source's records


def user_ids_for_fit(x, source: ExampleSource, user_ids):
    """fit's ``user_ids`` as (the source the model trains on, one id per example in its order).

    For a tf.data pipeline or a source the id must be a feature of each element: ``user_ids="uid"``
    names a key of x's dict (a record field), read from every example and removed from x before
    the model sees it. An ARRAY of ids lines up with x only when x is arrays (row i of both is
    example i); beside a dataset (read in its own, possibly shuffled, order) or a source it is
    refused: it would label the wrong rows, one person's examples falling under many ids.

    Args:
      x: fit's ``x`` as given.
      source: the ExampleSource fit built from it.
      user_ids: None, a key (str) of x's features, or one id per example (arrays only).

    Returns:
      (source, ids): ids is None without ``user_ids``.
    """
    if user_ids is None:
        return source, None
    if isinstance(user_ids, str):
        return _ids_from_feature(source, user_ids)
    if isinstance(x, tf.data.Dataset) or not isinstance(source, ArraySource):
        what = "tf.data.Dataset" if isinstance(x, tf.data.Dataset) else "source"
        raise ValueError(
            f"`user_ids` given as separate ids beside a {what}: ids line up with the examples only beside arrays. A "
            "dataset is read in its own (possibly shuffled) order and a source in its records', so separate ids "
            "would label the wrong rows (one person's examples under many ids, each clipped to C on its own). Put "
            "the id in every element and name it: from_tensor_slices(({'features': x, 'uid': ids}, y)) (or a "
            "record field 'uid'), then fit(..., user_ids='uid'); the model never sees that key.")
    return source, user_ids


def _ids_from_feature(source: ExampleSource, key: str):
    x_spec = source.spec[0]
    if not isinstance(x_spec, dict) or key not in x_spec:
        keys = sorted(x_spec) if isinstance(x_spec, dict) else None
        raise ValueError(f"user_ids={key!r} names a feature of x, but x has " +
                         (f"the keys {keys}." if keys else "no named features (it is not a dict).") +
                         f" Give every example its user id as x[{key!r}] (e.g. from_tensor_slices(({{'features': x, "
                         f"{key!r}: ids}}, y))).")
    if x_spec[key].shape.rank != 0:
        raise ValueError(f"x[{key!r}] must hold ONE user id per example (a scalar), got shape {x_spec[key].shape}.")
    if isinstance(source, ArraySource):
        features = {name: column for name, column in source.x.items() if name != key}
        return ArraySource(features, source.y), np.asarray(source.x[key]).reshape(-1)
    if isinstance(source, DatasetSource):
        return _dataset_ids(source, key)
    return WithoutFeature(source, key), _read_ids(source, key)


def _dataset_ids(source: DatasetSource, key: str):
    """A random-access dataset's ids, each read as its row is: ``at(dataset, i)`` of the SAME
    dataset object (a shuffled pipeline's index order is not its iteration order), and the
    source reading the rows without the ids."""
    dataset = source.dataset
    read_id = tf.autograph.experimental.do_not_convert(lambda i: tf.data.experimental.at(dataset, i)[0][key])
    indices = tf.data.Dataset.range(len(source))
    blocks = indices.map(read_id, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).batch(ID_BLOCK)
    return WithoutFeature(source, key), np.concatenate(list(blocks.as_numpy_iterator())).reshape(-1)


def _read_ids(source: ExampleSource, key: str) -> np.ndarray:
    """Every example's ``key`` feature, read from the source ``ID_BLOCK`` examples at a time (one pass)."""
    blocks = [np.asarray(source.read_examples(np.arange(start, min(start + ID_BLOCK, len(source))))[0][key])
              for start in range(0, len(source), ID_BLOCK)]
    return np.concatenate(blocks).reshape(-1)


class WithoutFeature(ExampleSource):
    """``source`` whose x dict lacks ``key`` (the user ids the model must not see)."""

    def __init__(self, source: ExampleSource, key: str):
        self.source, self.key = source, key
        self._count = len(source)
        self.spec = (_without(source.spec[0], key), source.spec[1])
        self.extras = {}

    def __len__(self) -> int:
        return self._count

    def read_examples(self, rows):
        x, y = self.source.read_examples(rows)
        return _without(x, self.key), y

    def graph_read(self, indices, mask):
        x, y, _ = self.source.graph_read(indices, mask)
        return _without(x, self.key), y, graph_extras(self, indices, mask)

    def diagnose(self):
        """The wrapped source's named read error, if it can find one."""
        diagnose = getattr(self.source, "diagnose", None)
        return diagnose() if diagnose is not None else None


def _without(features: dict, key: str) -> dict:
    return {name: value for name, value in features.items() if name != key}


class UserPoissonSampler(StepSampler):
    """Endless stream of user-level Poisson batches as (index chunks [n, P, m], mask [n, P]).

    Args:
      user_ids: one user id per example (ints, strings or other hashables); the users are
        the distinct ids, N_u of them.
      expected_users: L_u, the expected number of users per step; q_u = L_u / N_u.
      examples_per_user: m ≥ 1, the examples each sampled user contributes (cycled through
        in a secret random order; a user with fewer than m examples repeats some).
      physical_batch_size: P, USERS per chunk (each row holds m examples); None chooses it
        by ``choose_physical_batch_size(N_u, q_u)``.
      seed: numpy seed of the user selection and of the per-user order (None: fresh OS
        entropy); batch t is drawn from ``numpy.random.default_rng([seed, t])``.
      secure: draw every step's uniforms from ``os.urandom`` (secure mode; no seed); the
        per-user order is then drawn once from the OS.
      chunk_multiple: the chunk count is padded to a multiple of this (the replicas).
    """

    def __init__(self, user_ids, expected_users: int, examples_per_user: int,
                 physical_batch_size: Optional[int] = None, seed: Optional[int] = None, secure: bool = False,
                 chunk_multiple: int = 1):
        users = user_index_of(user_ids)
        self.num_examples = len(users)
        self.num_users = int(users.max()) + 1
        self.examples_per_user = _checks.positive_int("examples_per_user", examples_per_user)
        self.expected_batch_size = users_per_step(self.num_users, expected_users)
        self.sampling_rate = self.expected_batch_size / self.num_users
        if physical_batch_size is None:
            physical_batch_size = choose_physical_batch_size(self.num_users, self.sampling_rate)
        self.physical_batch_size = _checks.positive_int("physical_batch_size", physical_batch_size)
        self.secure = secure
        self.seed = stream_seed(seed, secure)
        self.chunk_multiple = _checks.positive_int("chunk_multiple", chunk_multiple)
        self.next_step = 0
        self._order, self._start, self._count = self._secret_order(users)

    def _secret_order(self, users: np.ndarray):
        """(order, start, count): order[start[u] : start[u] + count[u]] are user u's example
        indices in a random order π_u (a sort by user, ties broken by secret uniforms)."""
        rng = os.urandom if self.secure else np.random.default_rng([self.seed, ORDER_STREAM])
        order = np.lexsort((_uniforms(rng, len(users)), users)).astype(np.int64)
        count = np.bincount(users, minlength=self.num_users).astype(np.int64)
        start = np.concatenate([[0], np.cumsum(count)[:-1]]).astype(np.int64)
        return order, start, count

    def examples_of(self, users: np.ndarray, step: int) -> np.ndarray:
        """[k, m] example indices of ``users`` at step ``step``: π_u[(t·m + j) mod n_u]."""
        m, count = self.examples_per_user, self._count[users][:, None]
        positions = ((int(step) % count) * m + np.arange(m, dtype=np.int64)[None, :]) % count
        return self._order[self._start[users][:, None] + positions]

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(example indices [n, P, m] — [n, P] for m = 1 —, per-user mask [n, P]) of the users sampled at ``step``."""
        rng = os.urandom if self.secure else np.random.default_rng([self.seed, int(step)])
        users = sample_poisson_batch(rng, self.num_users, self.sampling_rate)
        return self._layout(self.examples_of(users, step))

    def _layout(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        physical, m = self.physical_batch_size, self.examples_per_user
        chunks = max(1, math.ceil(len(rows) / physical))
        chunks = math.ceil(chunks / self.chunk_multiple) * self.chunk_multiple
        indices = np.full((chunks * physical, m), PAD_INDEX, np.int64)
        mask = np.zeros(chunks * physical, np.float32)
        indices[:len(rows)] = rows
        mask[:len(rows)] = 1.0
        shape = (chunks, physical, m) if m > 1 else (chunks, physical)  # m = 1: the example-level layout
        return indices.reshape(shape), mask.reshape(chunks, physical)



def users_per_step(num_users: int, batch_size) -> int:
    """L_u, the expected number of users per step, checked against N_u."""
    batch_size = _checks.positive_int("batch_size", batch_size)
    if batch_size > num_users:
        raise ValueError(f"`batch_size`={batch_size} (with `user_ids`: the expected number of USERS per step) "
                         f"exceeds the number of users ({num_users}): q_u = batch_size / users must be <= 1.")
    return batch_size


@register_sampling("user_poisson")
@dataclasses.dataclass(frozen=True)
class UserPoissonSampling(SamplingScheme):
    """Poisson sampling of users (docs/algorithms.md §11): N = N_u users, L = L_u users per
    step, q_u = L_u/N_u; each sampled user contributes m examples, averaged before the one
    clip per user. The ledger records a ``"user_poisson"`` phase: DP-SGD's event over users,
    whose ε is per user while every phase of the ledger is user-level.

    Attributes:
      user_index: the user (0..N_u−1) of each training example.
      examples_per_user: m.
    """

    user_index: np.ndarray = dataclasses.field(repr=False, compare=False, default=None)
    examples_per_user: int = 1
    FIT_ARGUMENTS = ("user_ids", "examples_per_user")
    event = staticmethod(events.user_poisson_event)  # DP-SGD's event over users (§11)
    unit = "user"

    @classmethod
    def for_fit(cls, num_examples: int, batch_size: int, user_ids=None, examples_per_user=None):
        """The scheme of ``fit(..., batch_size=L_u, user_ids=ids, examples_per_user=m)``."""
        if user_ids is None:
            raise ValueError("`examples_per_user` is for user-level DP: pass `user_ids` (one user id per example) "
                             "too.")
        if examples_per_user is None:
            raise ValueError("User-level DP needs `examples_per_user` (m, the examples each sampled user "
                             "contributes per step), e.g. fit(..., user_ids=ids, examples_per_user=8).")
        m = _checks.positive_int("examples_per_user", examples_per_user)
        users = user_index_of(user_ids, num_examples)
        num_users = int(users.max()) + 1
        return cls(num_users, users_per_step(num_users, batch_size), users, m)

    @property
    def ledger_scheme(self) -> str:
        return "user_poisson"  # DP-SGD's event over users: PoissonSampled(q_u, Gaussian(σ))^T

    @property
    def views(self) -> int:
        return self.examples_per_user

    def sampler(self, physical_batch_size, seed, secure, chunk_multiple=1):
        return UserPoissonSampler(self.user_index, self.expected_batch_size, self.examples_per_user,
                                  physical_batch_size, None if secure else seed, secure=secure,
                                  chunk_multiple=chunk_multiple)
