"""LayerRegistry: ghost rules as an object handed to one model (compile / make_private /
the engine), the default registry untouched. References: a per-example loop of
GradientTapes (norms), and the σ = 0 DPSGD update −(1/L) Σ_i min(1, C/n_i) g_i computed from
the loop's gradients, with n_i the norm the registry's rule reports."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.harness import flat_norms, loop_per_example_gradients, sparse_ce
from tf_dp.clipping import GhostRule, LayerRegistry, Recording, default_layer_registry, ghost_rule_for
from tf_dp.clipping.layer_per_example import MaterializedContribution
from tf_dp.clipping.norms import per_example_gradient_norms

P, FEATURES, CLASSES = 6, 4, 3


class Scale(keras.layers.Layer):
    """y = x ⊙ w: a layer tf_dp has no registered rule for."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.w


class ScaleRule(GhostRule):
    """Exact: g_i = x_i ⊙ s_i. ``inflate`` multiplies the reported norms (a rule that is
    deliberately wrong, so which registry a model used shows in its update)."""

    def __init__(self, inflate=1.0):
        self.inflate, self.calls = inflate, 0

    def variables(self, layer):
        return [layer.w]

    def tapped_call(self, layer, original_call, recordings, x):
        self.calls += 1
        y = x * layer.w
        recordings.append(Recording(x, [y]))
        return y

    def contribution(self, layer, recordings, output_grads):
        per_example = tf.add_n([r.inputs * g for r, (g,) in zip(recordings, output_grads)])
        return _Inflated(MaterializedContribution([per_example]), self.inflate)


class _Inflated:
    def __init__(self, inner, factor):
        self.inner, self.factor = inner, factor

    def squared_norms(self):
        return self.inner.squared_norms() * self.factor ** 2

    def weighted_sums(self, clip_factors):
        return self.inner.weighted_sums(clip_factors)


def scale_model(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((FEATURES,))
    scaled = Scale(name="scale")(keras.layers.Dense(FEATURES, activation="tanh", name="hidden")(inputs))
    return keras.Model(inputs, keras.layers.Dense(CLASSES, name="head")(scaled))


def batch(seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(P, FEATURES)).astype("float32"), rng.integers(0, CLASSES, P).astype("int32")


def norms_of_scale(model, x, y, registry=None):
    return per_example_gradient_norms(model, sparse_ce, x, y, layer_registry=registry)[1]["scale"].numpy()


def test_two_registries_two_rules_and_the_default_untouched():
    """The same layer class takes each registry's rule, only for the call given it."""
    exact, inflated = ScaleRule(), ScaleRule(inflate=2.0)
    mine = default_layer_registry().copy().register(Scale, exact)
    theirs = default_layer_registry().copy().register(Scale, inflated)
    model = scale_model(0)
    x, y = batch(0)
    loop = flat_norms([[g[2]] for g in loop_per_example_gradients(model, x, y)])  # scale/w is variable 2
    np.testing.assert_allclose(norms_of_scale(model, x, y, mine), loop, rtol=1e-5)
    np.testing.assert_allclose(norms_of_scale(model, x, y, theirs), 2 * loop, rtol=1e-5)
    assert exact.calls and inflated.calls
    calls = (exact.calls, inflated.calls)
    np.testing.assert_allclose(norms_of_scale(model, x, y), loop, rtol=1e-5)  # default: op-level rule or replay
    assert (exact.calls, inflated.calls) == calls  # neither rule reached the default path
    assert ghost_rule_for(model.get_layer("scale")) is None
    assert ghost_rule_for(model.get_layer("scale"), mine) is exact
    assert ghost_rule_for(model.get_layer("hidden"), mine) is ghost_rule_for(model.get_layer("hidden"))  # copied


def expected_update(model, x, y, clip, inflate):
    """−(1/L) Σ_i min(1, C/n_i) g_i (SGD rate 1, σ = 0) from the loop's g_i, with n_i the
    norm reported: Scale's part of ‖g_i‖² multiplied by inflate²."""
    per_example = loop_per_example_gradients(model, x, y)
    squared = [sum(float(np.sum(np.float64(g) ** 2)) * (inflate ** 2 if k == 2 else 1.0) for k, g in enumerate(gs))
               for gs in per_example]
    factors = [min(1.0, clip / np.sqrt(s)) for s in squared]
    return [-sum(c * np.float64(gs[k]) for c, gs in zip(factors, per_example)) / len(y)
            for k in range(len(per_example[0]))]


def trained_update(model, x, y, clip, **compile_kwargs):
    model.compile(optimizer=tf_dp.DPSGD(1.0, l2_norm_clip=clip, noise_multiplier=0.0), loss=sparse_ce,
                  **compile_kwargs)
    before = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    model.train_on_batch(x, y, batch_size=len(y))
    return [v.numpy() - b for v, b in zip(model.trainable_variables, before)]


@pytest.mark.parametrize("route", ["compile", "make_private"])
def test_models_given_different_registries_clip_with_their_own_rules(route):
    """Three models, one per registry (exact, inflated ×2, default): each σ = 0 update equals
    the per-example loop clipped at the norms its own registry's rule gives."""
    clip = 0.05  # below every norm: the update depends on the norms
    x, y = batch(1)
    registries = {1.0: LayerRegistry().register(Scale, ScaleRule()),
                  2.0: LayerRegistry().register(Scale, ScaleRule(inflate=2.0)), None: None}
    for inflate, registry in registries.items():
        plain = scale_model(1)
        expected = expected_update(plain, x, y, clip, inflate or 1.0)
        if route == "compile":
            model, kwargs = tf_dp.make_private(plain), {"layer_registry": registry}
        else:
            model, kwargs = tf_dp.make_private(plain, layer_registry=registry), {}
        for got, want in zip(trained_update(model, x, y, clip, **kwargs), expected):
            np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-7)


def test_a_registry_is_checked():
    with pytest.raises(TypeError, match="LayerRegistry"):
        tf_dp.make_private(scale_model(2)).compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                                                   loss=sparse_ce, layer_registry={Scale: ScaleRule()})
    with pytest.raises(TypeError, match="GhostRule"):
        LayerRegistry().register(Scale, object())
    with pytest.raises(TypeError, match="class"):
        LayerRegistry({"Scale": ScaleRule()})
