"""The LayerNormalization rule (tf_dp/clipping/layer_normalization.py): γ and β (with and
without centering, and with β frozen) against the per-example loop."""

import pytest

from tests.clipping.rules.models import (check_every_layer_has_a_rule_and_matches_loop,
                                         check_frozen_weights_do_not_enter_per_example_norms,
                                         check_nan_example_adds_zero, layer_norm_model)


@pytest.mark.parametrize("build", [layer_norm_model], ids=lambda f: f.__name__)
def test_layer_normalization_ghost_rule_matches_loop(build):
    check_every_layer_has_a_rule_and_matches_loop(build)


@pytest.mark.parametrize("build", [layer_norm_model], ids=lambda f: f.__name__)
def test_nan_example_adds_zero_in_every_rule(build):
    check_nan_example_adds_zero(build)


@pytest.mark.parametrize("freeze", ["layer_norm_beta"])
def test_frozen_weights_do_not_enter_per_example_norms(freeze):
    check_frozen_weights_do_not_enter_per_example_norms(freeze)
