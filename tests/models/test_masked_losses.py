"""Keras output masks in the per-example loss (issue 33, item 2): the NMT pattern.

Embedding(mask_zero=True) → GRU/LSTM(return_sequences) or Dense over time → per-token logits,
SparseCategoricalCrossentropy. Keras' compiled loss weighs the masked positions 0 and divides
by the batch's count of unmasked tokens; DP training takes, per example, the mean over that
example's own unmasked tokens (docs/algorithms.md §1.2) — which is exactly what the Keras loss
gives on a batch of one. References, independent of tf_dp's engine: a GradientTape loop over
single examples evaluating the Keras loss (mask applied by Keras itself), the σ = 0 update
Σ_i c_i g_i built from that loop, and the token accuracy over unmasked tokens."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp.clipping import per_example_gradient_norms

P, T, V = 8, 12, 13
ENGINES = ["ghost", "vectorized"]
SPARSE_CE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def seq2seq(kind: str):
    keras.utils.set_random_seed(5)
    inputs = keras.Input((T,), dtype="int32")
    hidden = keras.layers.Embedding(V, 6, mask_zero=True, name="embed")(inputs)
    if kind == "dense":
        hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(hidden)
    else:
        layer = keras.layers.GRU if kind == "gru" else keras.layers.LSTM
        hidden = layer(8, return_sequences=True, name="recurrent")(hidden)
    return tf_dp.DPModel(inputs, keras.layers.Dense(V, name="logits")(hidden))


def padded_batch():
    """~70 % padding: example i has 2-5 tokens, then zeros (ids 0 are masked)."""
    rng = np.random.default_rng(11)
    lengths = rng.integers(2, 6, P)
    lengths[0] = T  # one example without padding
    x = rng.integers(1, V, (P, T)).astype("int32")
    x[np.arange(T)[None, :] >= lengths[:, None]] = 0
    return x, rng.integers(0, V, (P, T)).astype("int32")


def loop_gradients(model, x, y):
    """g_i = ∇ SPARSE_CE(y_i, f(x_i)) on a batch of one (Keras applies the output mask), float64."""
    gradients = []
    for i in range(P):
        with tf.GradientTape() as tape:
            value = SPARSE_CE(y[i:i + 1], model(x[i:i + 1], training=True))
        grads = tape.gradient(value, model.trainable_variables)
        gradients.append([np.asarray(tf.convert_to_tensor(g), np.float64) for g in grads])
    return gradients


def flat(arrays):
    return np.concatenate([np.ravel(a) for a in arrays])


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", ["dense", "gru", "lstm"])
def test_masked_norms_match_a_per_example_loop(kind, engine):
    model = seq2seq(kind)
    x, y = padded_batch()
    want = [np.linalg.norm(flat(g)) for g in loop_gradients(model, x, y)]
    total, _ = per_example_gradient_norms(model, SPARSE_CE, x, y, engine=engine)
    np.testing.assert_allclose(total.numpy(), want, rtol=1e-5)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", ["dense", "gru"])
def test_masked_update_and_metrics_match_the_masked_loss(kind, engine):
    """σ = 0, C = the median loop norm: the step moves θ by −lr Σ_i c_i g_i / P; the train
    accuracy is Keras' masked token accuracy (over the unmasked tokens of the batch)."""
    model = seq2seq(kind)
    x, y = padded_batch()
    gradients = loop_gradients(model, x, y)
    norms = np.array([np.linalg.norm(flat(g)) for g in gradients])
    clip = float(np.median(norms))
    factors = np.minimum(1.0, clip / norms)
    want = flat([sum(c * grads[k] for c, grads in zip(factors, gradients)) for k in range(len(gradients[0]))])
    logits = model(x, training=True).numpy()
    real = x != 0
    accuracy = np.sum((np.argmax(logits, -1) == y) & real) / np.sum(real)
    model.compile(optimizer=tf_dp.DPSGD(1.0, l2_norm_clip=clip, noise_multiplier=0.0, seed=0), loss=SPARSE_CE,
                  metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc")], clipping_engine=engine)
    before = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    logs = model.train_on_batch(x, y, batch_size=P, return_dict=True)
    got = flat([(b - v.numpy()) * P for b, v in zip(before, model.trainable_variables)])
    assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)
    np.testing.assert_allclose(logs["acc"], accuracy, rtol=1e-6)


def test_masked_loss_with_per_token_sample_weights_matches_keras_on_one_example():
    """Mask and per-token weights together: ℓ_i = Σ_t m_it w_it ℓ_it / Σ_t m_it, which is the
    Keras loss with ``sample_weight=w_i`` on a batch of one."""
    model = seq2seq("dense")
    x, y = padded_batch()
    w = np.random.default_rng(12).uniform(0.2, 2.0, (P, T)).astype("float32")
    want = []
    for i in range(P):
        with tf.GradientTape() as tape:
            value = SPARSE_CE(y[i:i + 1], model(x[i:i + 1], training=True), sample_weight=w[i:i + 1])
        grads = tape.gradient(value, model.trainable_variables)
        want.append(np.linalg.norm(flat([tf.convert_to_tensor(g) for g in grads])))
    total, _ = per_example_gradient_norms(model, SPARSE_CE, x, y, sample_weight=w)
    np.testing.assert_allclose(total.numpy(), want, rtol=1e-5)
