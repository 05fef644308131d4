"""The Dense rule (tf_dp/clipping/dense.py): per-example norms and clipped sums of flat and
sequence Dense layers, explicit and Gram forms, against the per-example loop."""

import pytest

from tests.clipping.rules.models import (assert_ghost_matches_loop, check_clipped_sum_matches_loop,
                                         check_frozen_weights_do_not_enter_per_example_norms,
                                         check_nan_example_adds_zero, check_norms_agree_ghost_vectorized_loop,
                                         conv_model, dense_model, dense_sequence_model, single_channel_conv_model)

MODELS = [dense_model, dense_sequence_model]


@pytest.mark.parametrize("build", MODELS, ids=lambda f: f.__name__)
def test_norms_agree_ghost_vectorized_loop(build):
    check_norms_agree_ghost_vectorized_loop(build)


@pytest.mark.parametrize("build", MODELS, ids=lambda f: f.__name__)
def test_clipped_sum_matches_loop(build):
    check_clipped_sum_matches_loop(build)


def test_gram_form_beyond_the_memory_budget_matches_loop(monkeypatch):
    # Per-example kernel gradients over the budget: unfolded patches, Gram form only (never
    # the explicit [P, d, k] products), for conv layers and Dense on sequences alike.
    from tf_dp.clipping import dense

    monkeypatch.setattr(dense, "EXPLICIT_FLOATS", 0)
    explicit = []
    monkeypatch.setattr(dense.DenseContribution, "_per_example_kernel_grads",
                        lambda self: explicit.append(self) or pytest.fail("explicit form over the budget"))
    for build in (conv_model, single_channel_conv_model, dense_sequence_model):
        model, x = build()
        assert_ghost_matches_loop(model, x)
    assert not explicit


@pytest.mark.parametrize("build", MODELS, ids=lambda f: f.__name__)
def test_nan_example_adds_zero_in_every_rule(build):
    check_nan_example_adds_zero(build)


@pytest.mark.parametrize("freeze", ["bias"])
def test_frozen_weights_do_not_enter_per_example_norms(freeze):
    check_frozen_weights_do_not_enter_per_example_norms(freeze)
