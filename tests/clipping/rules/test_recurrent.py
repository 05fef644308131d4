"""The recurrent rule (tf_dp/clipping/recurrent.py): LSTM, GRU, SimpleRNN, Bidirectional,
masking, encoder-decoder with initial_state: per-example norms and clipped sums of both
engines, with and without XLA, rolled or unrolled, inside a compiled train step, against a
per-example GradientTape loop; the per-example replay of a layer without a rule compiles
under XLA; a warning names the layers on the slow per-example path."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.clipping.rules.models import assert_ghost_matches_loop
from tests.harness import flat_norms, loop_per_example_gradients, sparse_ce
from tf_dp.clipping import clipped_gradient_sum
from tf_dp.clipping.recurrent import RecurrentRule
from tf_dp.clipping.registry import ghost_rule_for

BATCH, STEPS, DECODER_STEPS = 6, 6, 4


def sequence_ce(y_true, y_pred):
    """Cross-entropy averaged over the decoder's steps: one value per example."""
    return tf.reduce_mean(sparse_ce(y_true, y_pred), axis=-1)


def _sequential(recurrent, pooled=False):
    layers = [keras.Input((STEPS, 4)), recurrent]
    if pooled:
        layers.append(keras.layers.GlobalAveragePooling1D())
    return keras.Sequential(layers + [keras.layers.Dense(3)])


def _masked():
    inputs = keras.Input((STEPS,), dtype="int32")
    hidden = keras.layers.Embedding(20, 4, mask_zero=True)(inputs)
    hidden = keras.layers.LSTM(8, return_sequences=True)(hidden)
    hidden = keras.layers.GRU(6)(hidden)
    return keras.Model(inputs, keras.layers.Dense(3)(hidden))


def _seq2seq():
    """keras.io's LSTM encoder-decoder: the encoder's final states start the decoder."""
    encoder_in, decoder_in = keras.Input((STEPS, 4)), keras.Input((DECODER_STEPS, 5))
    _, h, c = keras.layers.LSTM(8, return_state=True)(encoder_in)
    decoded = keras.layers.LSTM(8, return_sequences=True)(decoder_in, initial_state=[h, c])
    return keras.Model([encoder_in, decoder_in], keras.layers.Dense(3)(decoded))


MODELS = {
    "lstm": lambda: _sequential(keras.layers.LSTM(8)),
    "gru": lambda: _sequential(keras.layers.GRU(8, return_sequences=True), pooled=True),
    "gru_reset_before": lambda: _sequential(keras.layers.GRU(8, reset_after=False, implementation=1)),
    "simple_rnn": lambda: _sequential(keras.layers.SimpleRNN(8, go_backwards=True)),
    "bidirectional": lambda: _sequential(keras.layers.Bidirectional(keras.layers.LSTM(8, return_sequences=True)),
                                         pooled=True),
    "masked": _masked,
    "seq2seq": _seq2seq,
}


def _data(name, rng):
    if name == "masked":  # lengths 6, 5, 4, 2, 1, 0 real ids then padding 0 (masked steps)
        ids = rng.integers(1, 20, size=(BATCH, STEPS))
        ids[np.arange(STEPS)[None, :] >= np.linspace(STEPS, 0, BATCH).round()[:, None]] = 0
        return ids.astype("int32"), rng.integers(0, 3, BATCH), sparse_ce
    if name == "seq2seq":
        x = [rng.normal(size=(BATCH, STEPS, 4)).astype("float32"),
             rng.normal(size=(BATCH, DECODER_STEPS, 5)).astype("float32")]
        return x, rng.integers(0, 3, (BATCH, DECODER_STEPS)), sequence_ce
    return rng.normal(size=(BATCH, STEPS, 4)).astype("float32"), rng.integers(0, 3, BATCH), sparse_ce


def _recurrent_layers(model):
    return [layer for layer in model._flatten_layers() if isinstance(layer, keras.layers.RNN)]


def _step(model, loss, clip, engine, jit):
    """The clipping step as one tf.function: called again with another mask, it is not traced again."""

    @tf.function(jit_compile=jit)
    def step(x, y, mask):
        result = clipped_gradient_sum(model, loss, x, y, mask, clip, engine=engine)
        return result.squared_norms, result.clipped_sums

    return step


def _clip(model, loss, x, y, clip, engine, jit, mask=None, step=None):
    mask = tf.ones(BATCH) if mask is None else mask
    step = _step(model, loss, clip, engine, jit) if step is None else step
    return step(tf.nest.map_structure(tf.constant, x), tf.constant(y), mask)


def _cases():
    """Every model × engine × XLA; all but the ghost engine on the LSTM and the seq2seq
    (2–8 s each on 2 cores) are in the slow tier."""
    for name in sorted(MODELS):
        for engine in ("ghost", "vectorized"):
            for jit in (False, True):
                fast = engine == "ghost" and name in ("lstm", "seq2seq")
                yield pytest.param(name, engine, jit, marks=() if fast else pytest.mark.slow,
                                   id=f"{name}-{engine}-{'xla' if jit else 'graph'}")


_LOOP_REFERENCES = {}


def _loop_reference(name, model, x, y, loss):
    """The per-example loop's gradients, computed once per model name and set of weights (the
    four engine × XLA cases of a model build it with the same seed): keyed by the weights' bytes."""
    key = (name, b"".join(w.tobytes() for w in model.get_weights()))
    if key not in _LOOP_REFERENCES:
        _LOOP_REFERENCES[key] = loop_per_example_gradients(model, x, y, loss)
    return _LOOP_REFERENCES[key]


@pytest.mark.parametrize("name,engine,jit", list(_cases()))
def test_recurrent_norms_and_clipped_sums_match_a_per_example_loop(name, engine, jit):
    model = MODELS[name]()
    x, y, loss = _data(name, np.random.default_rng(0))
    per_example = _loop_reference(name, model, x, y, loss)
    norms = flat_norms(per_example)
    clip = float(np.median(norms))
    if engine == "ghost":
        assert all(isinstance(ghost_rule_for(layer), RecurrentRule) for layer in _recurrent_layers(model))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        squared_norms, sums = _clip(model, loss, x, y, clip, engine, jit)
    assert not [w for w in caught if "slow per-example path" in str(w.message)]
    np.testing.assert_allclose(np.sqrt(squared_norms.numpy().astype(np.float64)), norms, rtol=1e-5)
    factors = np.minimum(1.0, clip / norms)
    for v, total in enumerate(sums):
        want = sum(factors[i] * per_example[i][v].astype(np.float64) for i in range(BATCH))
        np.testing.assert_allclose(total.numpy(), want, rtol=1e-5, atol=1e-5 * np.max(np.abs(want)))


@pytest.mark.parametrize("name", ["seq2seq", "bidirectional", "masked"])
def test_one_example_weighted_100_moves_the_clipped_sum_by_at_most_c(name):
    model = MODELS[name]()
    x, y, loss = _data(name, np.random.default_rng(1))
    clip = 0.1
    weights = tf.constant([100.0] + [1.0] * (BATCH - 1))

    def weighted_loss(y_true, y_pred):
        return loss(y_true, y_pred) * weights

    step = _step(model, weighted_loss, clip, "ghost", False)  # one trace for both masks
    _, with_it = _clip(model, weighted_loss, x, y, clip, "ghost", False, step=step)
    _, without_it = _clip(model, weighted_loss, x, y, clip, "ghost", False, mask=tf.constant([0.0] + [1.0] * 5),
                          step=step)
    moved = np.sqrt(sum(np.sum((a.numpy().astype(np.float64) - b.numpy()) ** 2) for a, b in zip(with_it, without_it)))
    assert 0.5 * clip < moved <= clip * (1 + 1e-5)


def _stacked_rnn(steps=STEPS):
    """An RNN over StackedRNNCells: no ghost rule, replayed per example."""
    cells = [keras.layers.LSTMCell(8), keras.layers.GRUCell(5)]
    return keras.Sequential([keras.Input((steps, 4)), keras.layers.RNN(cells, name="stacked"), keras.layers.Dense(3)])


@pytest.mark.parametrize("engine", ["ghost", "vectorized"])
def test_recurrent_layer_without_rule_is_replayed_per_example_under_xla(engine):
    # Used to fail to compile: TensorListReserve not supported on XLA_CPU (the layer's while
    # loop inside the per-example tf.map_fn), where plain Keras compiles the same model.
    model = _stacked_rnn()
    x, y, loss = _data("lstm", np.random.default_rng(2))
    per_example = loop_per_example_gradients(model, x, y, loss)
    squared_norms, sums = _clip(model, loss, x, y, 1e9, engine, True)
    np.testing.assert_allclose(np.sqrt(squared_norms.numpy().astype(np.float64)), flat_norms(per_example), rtol=1e-5)
    for v, total in enumerate(sums):
        want = sum(g[v].astype(np.float64) for g in per_example)
        np.testing.assert_allclose(total.numpy(), want, rtol=1e-5, atol=1e-5 * np.max(np.abs(want)))


def test_recurrent_replay_with_unknown_steps_under_xla_warns_and_is_exact():
    model = _stacked_rnn(steps=None)
    x, y, loss = _data("lstm", np.random.default_rng(3))
    per_example = loop_per_example_gradients(model, x, y, loss)

    @tf.function(jit_compile=True, input_signature=[tf.TensorSpec([BATCH, None, 4])])
    def step(x):
        return clipped_gradient_sum(model, loss, x, tf.constant(y), tf.ones(BATCH), 1e9).squared_norms

    with pytest.warns(RuntimeWarning, match="recurrent layer 'stacked'.*unknown number of time steps"):
        squared_norms = step(tf.constant(x))
    np.testing.assert_allclose(np.sqrt(squared_norms.numpy().astype(np.float64)), flat_norms(per_example), rtol=1e-5)


def test_slow_path_warning_names_the_replayed_layers_once_per_model():
    model = _stacked_rnn()
    x, y, loss = _data("lstm", np.random.default_rng(4))
    slow = r"slow per-example path.*layer 'stacked' \(RNN\): roughly P=6 times"
    with pytest.warns(UserWarning, match=slow) as caught:
        clipped_gradient_sum(model, loss, tf.constant(x), tf.constant(y), tf.ones(BATCH), 1.0)
    assert len([w for w in caught if "slow per-example path" in str(w.message)]) == 1
    assert "dense" not in str([w.message for w in caught if "slow" in str(w.message)][0])
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        clipped_gradient_sum(model, loss, tf.constant(x), tf.constant(y), tf.ones(BATCH) * 0.5, 2.0)
        clipped_gradient_sum(MODELS["lstm"](), loss, tf.constant(x), tf.constant(y), tf.ones(BATCH), 1.0)
    assert not [w for w in again if "slow per-example path" in str(w.message)]


def test_seq2seq_trains_with_train_on_batch_under_xla():
    # Plain Keras compiles this model with jit_compile=True; the DP step used to fail to.
    model = tf_dp.DPModel(*_io(_seq2seq()))
    x, y, _ = _data("seq2seq", np.random.default_rng(5))
    model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True)
    before = [v.numpy() for v in model.trainable_variables]
    loss = model.train_on_batch(x, y, batch_size=BATCH)
    assert np.all(np.isfinite(loss))
    assert all(not np.array_equal(a, v.numpy()) for a, v in zip(before, model.trainable_variables))


def _io(model):
    return model.inputs, model.outputs


class TwiceCalledLSTM(keras.layers.Layer):
    """One LSTM on the batch and on a batch-free constant sequence (broadcast to the batch):
    the batch-free call sends the layer to the per-example replay of both its calls."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.lstm = keras.layers.LSTM(8)

    def build(self, shape):
        self.lstm.build(shape)

    def call(self, x):
        return self.lstm(x) + self.lstm(tf.ones([1, STEPS, 4]) * 0.3)


def test_replay_of_a_rule_recording_includes_the_recurrent_kernel():
    # The replay of a rule's recording returns its watched zx = xW + b, which alone has no
    # U gradient: U's per-example gradient (3% of the norm here) would have gone missing.
    inputs = keras.Input((STEPS, 4))
    model = keras.Model(inputs, keras.layers.Dense(3)(TwiceCalledLSTM()(inputs)))
    x, y, loss = _data("lstm", np.random.default_rng(6))
    per_example = loop_per_example_gradients(model, x, y, loss)
    squared_norms, sums = _clip(model, loss, x, y, 1e9, "ghost", False)
    np.testing.assert_allclose(np.sqrt(squared_norms.numpy().astype(np.float64)), flat_norms(per_example), rtol=1e-5)
    for v, total in enumerate(sums):
        want = sum(g[v].astype(np.float64) for g in per_example)
        np.testing.assert_allclose(total.numpy(), want, rtol=1e-5, atol=1e-5 * np.max(np.abs(want)))


REAL_ARCHITECTURES = {
    "lstm_unrolled": lambda: keras.layers.LSTM(3, unroll=True),
    "lstm": lambda: keras.layers.LSTM(3),
    "gru": lambda: keras.layers.GRU(3, return_sequences=True),
    "simple_rnn": lambda: keras.layers.SimpleRNN(3),
    "bidirectional": lambda: keras.layers.Bidirectional(keras.layers.LSTM(2)),
}


@pytest.mark.parametrize("name", sorted(REAL_ARCHITECTURES))
def test_recurrent_layers_match_loop(name):
    inputs = keras.Input((4, 2))
    hidden = keras.layers.Flatten()(REAL_ARCHITECTURES[name]()(inputs))
    model = keras.Model(inputs, keras.layers.Dense(3)(hidden))
    assert_ghost_matches_loop(model, np.random.randn(4, 4, 2).astype("float32"))


@pytest.mark.parametrize("unroll", [False, True])
@pytest.mark.parametrize("recurrent", ["lstm", "gru", "bidirectional"])
def test_recurrent_layers_clip_exactly_in_graph_mode(recurrent, unroll):
    # Inside a compiled train step the cell runs in the layer's while loop, so the whole RNN
    # layer is the tapped unit (its cell's recorded inputs are out of reach).
    layer = {"lstm": lambda: keras.layers.LSTM(8, unroll=unroll), "gru": lambda: keras.layers.GRU(8, unroll=unroll),
             "bidirectional": lambda: keras.layers.Bidirectional(keras.layers.SimpleRNN(8, unroll=unroll))}[recurrent]
    model = tf_dp.DPSequential([keras.Input((10, 4)), layer(), keras.layers.Dense(3)])
    x = np.random.rand(6, 10, 4).astype("float32")
    y = np.arange(6) % 3
    per_example = loop_per_example_gradients(model, x, y)

    @tf.function
    def clip():
        result = clipped_gradient_sum(model, sparse_ce, tf.constant(x), tf.constant(y), tf.ones(6), 1e9)
        return result.squared_norms, result.clipped_sums

    squared_norms, sums = clip()
    np.testing.assert_allclose(np.sqrt(squared_norms.numpy()), flat_norms(per_example), rtol=1e-4)
    for v, total in enumerate(sums):
        np.testing.assert_allclose(total.numpy(), sum(g[v] for g in per_example), rtol=1e-4, atol=1e-6)
    model.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0), loss=sparse_ce)
    model.train_on_batch(x, y, batch_size=6)
