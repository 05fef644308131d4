"""The Embedding rule (tf_dp/clipping/embedding.py): per-example norms and clipped sums with
ids repeated within an example (the cross terms), in graph mode and under XLA, against the
per-example loop."""

import pytest

from tests.clipping.rules.models import (assert_xla_matches_graph_mode, attention_model,
                                         check_clipped_sum_matches_loop, check_nan_example_adds_zero,
                                         check_norms_agree_ghost_vectorized_loop, embedding_model)

MODELS = [embedding_model]


@pytest.mark.parametrize("build", MODELS, ids=lambda f: f.__name__)
def test_norms_agree_ghost_vectorized_loop(build):
    check_norms_agree_ghost_vectorized_loop(build)


@pytest.mark.parametrize("build", MODELS, ids=lambda f: f.__name__)
def test_clipped_sum_matches_loop(build):
    check_clipped_sum_matches_loop(build)


@pytest.mark.parametrize("build", MODELS, ids=lambda f: f.__name__)
def test_nan_example_adds_zero_in_every_rule(build):
    check_nan_example_adds_zero(build)


def test_embedding_and_attention_rules_under_xla_match_graph_mode():
    # The Embedding rule groups repeated ids without tf.unique, so it compiles under XLA.
    for build in (embedding_model, attention_model):
        assert_xla_matches_graph_mode(build, atol=1e-5)  # XLA fuses attention differently
