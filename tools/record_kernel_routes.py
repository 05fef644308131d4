"""A pytest plugin that lists the tests reaching a kernel-route decision that depends on
oneDNN (tf_dp/clipping/kernels.py): the grouped filter-gradient route of a convolution
(conv.py), a per-example replay of a grouped convolution, or the crash-prone batched-matmul
check of a vectorized per-example map. Those are the tests scripts/test.sh must run under
both TF_ENABLE_ONEDNN_OPTS settings.

    PYTHONPATH=tools TF_ENABLE_ONEDNN_OPTS=1 python -m pytest -p record_kernel_routes tests/clipping/test_x.py
    # appends "nodeid<TAB>decision" lines to kernel_route_hits.tsv (KERNEL_ROUTE_HITS overrides)
"""

from __future__ import annotations

import os

import pytest

_CURRENT: list = [None]
_SEEN: set = set()


def _mark(decision: str) -> None:
    """Appends (current test, ``decision``) once to the hits file."""
    key = (_CURRENT[0], decision)
    if _CURRENT[0] is None or key in _SEEN:
        return
    _SEEN.add(key)
    with open(os.environ.get("KERNEL_ROUTE_HITS", "kernel_route_hits.tsv"), "a") as hits:
        hits.write(f"{key[0]}\t{decision}\n")


def pytest_configure(config):
    """Wraps the decision points where the clipping code imported them."""
    import tf_dp.clipping.conv as conv
    import tf_dp.clipping.kernels as kernels
    import tf_dp.clipping.layer_per_example as layer_per_example
    import tf_dp.clipping.per_example as per_example

    available = conv.grouped_conv_filter_gradient_available

    def recorded_available():  # called last in conv._uses_grouped_route: every other condition holds
        _mark("conv grouped filter-gradient route")
        return available()

    conv.grouped_conv_filter_gradient_available = recorded_available
    for module in (layer_per_example, per_example):
        def recorded_require(layers, route, require=module.require_grouped_conv_kernels):
            if any(kernels.grouped_conv_layers(layer) for layer in layers):
                _mark("grouped convolution replayed per example")
            return require(layers, route)

        module.require_grouped_conv_kernels = recorded_require
    check = layer_per_example.crash_prone_batch_matmuls

    def recorded_check(operations):
        operations = list(operations)
        if any(op.type in kernels._BATCH_MATMULS for op in operations):
            _mark("batched matmul in a vectorized per-example map")
        return check(operations)

    layer_per_example.crash_prone_batch_matmuls = recorded_check


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _CURRENT[0] = item.nodeid
    yield
    _CURRENT[0] = None
