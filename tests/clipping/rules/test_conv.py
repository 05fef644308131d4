"""The Conv1D/Conv2D rule (tf_dp/clipping/conv.py): the grouped route (single input channel,
in groups of examples), the unfolded route (also under XLA and where TensorFlow has no grouped
filter-gradient kernel), groups > 1, against the per-example loop."""

import pytest

from tests.clipping.rules.models import (assert_ghost_matches_loop, assert_xla_matches_graph_mode,
                                         check_every_layer_has_a_rule_and_matches_loop,
                                         check_nan_example_adds_zero, conv1d_model, conv_model, grouped_conv_model,
                                         single_channel_conv_model)


@pytest.mark.parametrize("build", [single_channel_conv_model, conv_model], ids=lambda f: f.__name__)
def test_grouped_route_in_example_groups_matches_loop(monkeypatch, build):
    # Large physical batches are cut into groups of examples for the grouped-convolution
    # call; groups of 4 and a remainder must give the same norms and sums as the loop.
    from tf_dp.clipping import conv

    monkeypatch.setattr(conv, "_EXAMPLES_PER_CALL", 4)  # BATCH = 6: groups of 4 and 2
    monkeypatch.setattr(conv, "_GROUPED_MAX_CHANNELS", 16)  # also C_in = 2 (conv_model)
    model, x = build()
    assert_ghost_matches_loop(model, x)


def test_conv_rules_under_xla_match_graph_mode(monkeypatch):
    # Under XLA the conv rule takes the unfolded route (the grouped filter gradient's XLA CPU
    # kernel is pathologically slow); both routes must give the same norms and sums.
    from tf_dp.clipping import conv

    routes = []
    choose = conv._uses_grouped_route
    monkeypatch.setattr(conv, "_uses_grouped_route", lambda *args: routes.append(choose(*args)) or routes[-1])
    for build in (conv_model, single_channel_conv_model):
        assert_xla_matches_graph_mode(build, atol=1e-6)
    grouped_kernel = conv.grouped_conv_filter_gradient_available()  # oneDNN off: unfolded everywhere
    assert False in routes and (True in routes) == grouped_kernel


def test_without_grouped_kernel_every_conv_takes_the_unfolded_route(monkeypatch):
    # Where TensorFlow has no grouped filter-gradient kernel (oneDNN off), the single-channel
    # layers that would take the grouped route are unfolded instead; force that on any machine.
    from tf_dp.clipping import conv

    monkeypatch.setattr(conv, "grouped_conv_filter_gradient_available", lambda: False)
    routes = []
    choose = conv._uses_grouped_route
    monkeypatch.setattr(conv, "_uses_grouped_route", lambda *args: routes.append(choose(*args)) or routes[-1])
    model, x = single_channel_conv_model()
    assert_ghost_matches_loop(model, x)
    assert routes and not any(routes)


@pytest.mark.parametrize("build", [conv_model, single_channel_conv_model, conv1d_model, grouped_conv_model],
                         ids=lambda f: f.__name__)
def test_conv_ghost_rule_matches_loop(build):
    check_every_layer_has_a_rule_and_matches_loop(build)


@pytest.mark.parametrize("build", [conv_model, single_channel_conv_model], ids=lambda f: f.__name__)
def test_nan_example_adds_zero_in_every_rule(build):
    check_nan_example_adds_zero(build)
