"""One allocator of random streams (tf_dp.streams, docs/algorithms.md B.3): every stream a module
uses is allocated there by name, the allocations are pairwise disjoint, and a (key, step, stream)
triple reproduces its draw while two streams of one key differ."""

import ast
import pathlib

import numpy as np
import pytest
import tensorflow as tf

from tf_dp import streams
from tf_dp.clipping.adaptive import COUNT_STREAM, count_stream
from tf_dp.noise.gaussian import draw_seed, gaussian_stream
from tf_dp.noise.laplace import LAPLACE_STREAM
from tf_dp.sampling import cyclic_poisson, users

ROOT = pathlib.Path(__file__).resolve().parents[2] / "tf_dp"
KEY = tf.constant(123456789, tf.int64)


@pytest.mark.parametrize("allocator", [streams.PHILOX, streams.SAMPLER, streams.SPAWN])
def test_all_allocated_streams_are_pairwise_disjoint(allocator):
    allocated = allocator.streams()
    assert len({s.name for s in allocated}) == len(allocated)
    for i, a in enumerate(allocated):
        for b in allocated[i + 1:]:
            assert a.last < b.first or b.last < a.first, (a, b)


def test_an_overlapping_or_repeated_allocation_is_refused():
    allocator = streams.StreamAllocator("test")
    allocator.allocate("wide", 0, 100)
    with pytest.raises(ValueError, match="overlaps"):
        allocator.allocate("inside", 50)
    with pytest.raises(ValueError, match="already allocated"):
        allocator.allocate("wide", 200)
    assert allocator.allocate("next").code == -1 and allocator.allocate("after").code == -2


def test_modules_use_the_allocated_codes():
    assert LAPLACE_STREAM == streams.SUM_RELEASE.code == -1  # the codes tf_dp has always drawn from
    assert COUNT_STREAM == streams.ADAPTIVE_COUNT.code == -2
    assert users.ORDER_STREAM == streams.USER_ORDER.code
    assert (cyclic_poisson._GROUP_STREAM, cyclic_poisson._STEP_STREAM) == (0, 1)
    for variable, replica, replicas in ((0, 0, 1), (7, 3, 4), (2**19, 2**19, 2**19)):
        assert int(gaussian_stream(variable, replica, replicas)) in streams.GAUSSIAN_GRADIENT
    for replica, replicas in ((0, 2), (2**20 - 2, 2**20 - 1)):
        assert int(count_stream(replica, replicas)) in streams.ADAPTIVE_COUNT_SHARES


def test_no_module_numbers_a_stream_by_hand():
    """Any module-level ``*_STREAM`` constant outside tf_dp/streams.py is read from the allocator."""
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name == "streams.py" and path.parent == ROOT:
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id.endswith("_STREAM")
                                                    for t in node.targets):
                if not any(isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
                           and isinstance(n.value.value, ast.Name) and n.value.value.id == "streams"
                           for n in ast.walk(node.value)):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


def test_same_key_and_stream_reproduce_and_distinct_streams_differ():
    codes = [streams.SUM_RELEASE.code, streams.ADAPTIVE_COUNT.code, int(gaussian_stream(0, 0, 1)),
             int(count_stream(1, 2))]
    seeds = [tuple(draw_seed(KEY, 9, code).numpy().tolist()) for code in codes]
    assert seeds == [tuple(draw_seed(KEY, 9, code).numpy().tolist()) for code in codes]
    assert len(set(seeds)) == len(seeds)
    draws = [tf.random.stateless_normal([1000], seed=s, alg="philox").numpy() for s in seeds]
    assert max(abs(np.corrcoef(a, b)[0, 1]) for i, a in enumerate(draws) for b in draws[i + 1:]) < 0.2
