"""Token ids outside [0, V) in the ghost rules of Embedding and (tied) ReversibleEmbedding.

Keras' ``ops.take`` counts a negative id from the end (−1 is row V − 1). The Embedding rule
dropped those positions from its norm and clipped sum (scattered at −1) while the forward
pass read row V − 1, and the tied ReversibleEmbedding rule failed at the step that first
sampled such an example — a failure whose time tells when the example was sampled. An id
still out of range (≥ V, or < −V) made the DP step fail on a CPU; it now looks up a zero
vector with no gradient (Keras' result on a GPU), and the step goes on.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.harness import flat_norms, loop_per_example_gradients
from tf_dp.clipping import clipped_gradient_sum, dense

keras_hub = pytest.importorskip("keras_hub", reason="keras-hub is not installed (pip install tf_dp[hub])")

VOCABULARY, WIDTH, BATCH, LENGTH = 7, 4, 4, 5
KINDS = ["embedding", "keras_reversible", "keras_hub_reversible"]


def token_loss(y, logits):
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True), axis=-1)


def _models(kind):
    """(DP model, reference model) sharing their layers: the reference looks up only ids in
    [−V, V) — negative ones through Keras' own ``take`` — and zeroes the other positions."""
    keras.utils.set_random_seed(0)
    if kind == "embedding":
        table = keras.layers.Embedding(VOCABULARY, WIDTH)
    elif kind == "keras_reversible":
        table = keras.layers.ReversibleEmbedding(VOCABULARY, WIDTH)
    else:
        table = keras_hub.layers.ReversibleEmbedding(VOCABULARY, WIDTH)
    hidden = keras.layers.Dense(WIDTH, activation="tanh")
    head = keras.layers.Dense(VOCABULARY) if kind == "embedding" else (lambda h: table(h, reverse=True))

    ids = keras.Input((LENGTH,), dtype="int32")
    dp_model = keras.Model(ids, head(hidden(table(ids))))
    valid = keras.layers.Lambda(lambda t: keras.ops.logical_and(t >= -VOCABULARY, t < VOCABULARY))(ids)
    looked_up = table(keras.layers.Lambda(lambda a: keras.ops.where(a[1], a[0], 0))([ids, valid]))
    zeroed = keras.layers.Lambda(lambda a: a[0] * keras.ops.cast(a[1], a[0].dtype)[..., None])([looked_up, valid])
    return dp_model, keras.Model(ids, head(hidden(zeroed)))


def _batch(bad_ids):
    x = np.random.default_rng(0).integers(0, VOCABULARY, (BATCH, LENGTH)).astype("int32")
    y = np.roll(x, -1, axis=1)
    x[1, 2], x[2, 0], x[2, 3], x[3, 1] = bad_ids[0], bad_ids[1 % len(bad_ids)], VOCABULARY - 1, 2
    x[3, 4] = bad_ids[-1]
    return x, y


def assert_matches_loop(dp_model, reference, x, y, engine):
    per_example = loop_per_example_gradients(reference, x, y, token_loss)
    order = {id(v): j for j, v in enumerate(reference.trainable_variables)}
    norms = flat_norms(per_example)
    clip = float(np.median(norms))
    result = clipped_gradient_sum(dp_model, token_loss, tf.constant(x), tf.constant(y), tf.ones(BATCH), clip,
                                  engine=engine)
    got = np.sqrt(result.squared_norms.numpy().astype(np.float64))
    np.testing.assert_allclose(got, norms, rtol=1e-4)
    factors = np.minimum(1.0, clip / got)
    for variable, total in zip(dp_model.trainable_variables, result.clipped_sums):
        want = sum(factors[i] * per_example[i][order[id(variable)]] for i in range(BATCH))
        np.testing.assert_allclose(total.numpy(), want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("engine", ["ghost", "gram", "vectorized"])
@pytest.mark.parametrize("kind", KINDS)
def test_negative_ids_are_counted_from_the_end_as_keras_does(kind, engine, monkeypatch):
    """−1 and −V (rows V − 1 and 0, by Keras' take) next to explicit V − 1 and 0: norms and
    clipped sums equal a per-example loop of plain Keras ("gram": the tied rule's Gram form)."""
    if engine == "gram":
        if kind == "embedding":
            pytest.skip("one form")
        monkeypatch.setattr(dense, "EXPLICIT_FLOATS", 0)
        engine = "ghost"
    dp_model, _ = _models(kind)
    assert_matches_loop(dp_model, dp_model, *_batch([-1, -VOCABULARY]), engine)


@pytest.mark.parametrize("form", ["explicit", "gram"])
@pytest.mark.parametrize("kind", KINDS)
def test_ids_out_of_range_look_up_zero_and_add_no_gradient(kind, form, monkeypatch):
    """V, V + 3 and −V − 1 next to −1: the ghost step does not fail, and its norms and clipped
    sums equal a per-example loop in which those positions look up zero vectors (the tied
    rule in both of its forms)."""
    if form == "gram":
        if kind == "embedding":
            pytest.skip("one form")
        monkeypatch.setattr(dense, "EXPLICIT_FLOATS", 0)  # [P, V, d] never fits: the float64 Gram form
    dp_model, reference = _models(kind)
    assert_matches_loop(dp_model, reference, *_batch([VOCABULARY, -1, VOCABULARY + 3, -VOCABULARY - 1]), "ghost")


def test_dp_fit_with_out_of_range_ids_completes():
    dp_model, _ = _models("keras_hub_reversible")
    model = tf_dp.DPModel(dp_model.inputs, dp_model.outputs)
    model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0), loss=token_loss)
    x = np.random.default_rng(1).integers(0, VOCABULARY, (32, LENGTH)).astype("int32")
    y = np.roll(x, -1, axis=1)  # targets in range: the ids looked up are not
    x[5, 1], x[20, 3], x[9, 0] = VOCABULARY, -1, -VOCABULARY - 2
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, sampling_seed=0)
    assert int(model.privacy_ledger.steps.numpy()) >= 2
    assert all(np.all(np.isfinite(v.numpy())) for v in model.trainable_variables)
