"""The row-independence verdict describes the step that runs: re-probed on every fit and whenever the step is re-traced.

A verdict reused after what the step computes changed — a variable read by a layer's
control flow, a Python global read at trace time — would let a row-mixing layer train.
Each test measures what the step releases against an independent reference, the
neighbouring-dataset difference at σ = 0: the clipped sum released on a batch X and on X
without one example, both from the same weights, with the probe switched off for the
neighbour (the mechanism as it runs). The test passes if the step is refused before it
runs, or if the two releases differ by at most C.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.harness import sparse_ce
from tf_dp.models import fitting, step

FEATURES, CLASSES, ROWS, CLIP, RATE = 6, 3, 32, 0.1, 0.5
LOUD = 3  # the example removed in the neighbouring data set: large, so centring the batch moves every row

CENTRE_AT_TRACE = False  # read by CentreIfGlobal when its call is traced


class CentreWhenFlagged(keras.layers.Layer):
    """Identity, or x − mean over the batch once the non-trainable tf.Variable ``flag`` is set."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.flag = tf.Variable(False, trainable=False)

    def call(self, inputs):
        return tf.cond(self.flag, lambda: inputs - tf.reduce_mean(inputs, axis=0, keepdims=True), lambda: inputs)


class CentreIfGlobal(keras.layers.Layer):
    """x − mean over the batch if the module global ``CENTRE_AT_TRACE`` is set when the call is traced."""

    def call(self, inputs):
        return inputs - tf.reduce_mean(inputs, axis=0, keepdims=True) if CENTRE_AT_TRACE else inputs


def model_with(layer, jit_compile=False):
    keras.utils.set_random_seed(0)
    model = tf_dp.DPSequential([keras.Input((FEATURES,)), layer, keras.layers.Dense(8, activation="tanh"),
                                keras.layers.Dense(CLASSES)])
    model.compile(optimizer=tf_dp.DPSGD(RATE, l2_norm_clip=CLIP, noise_multiplier=0.0), loss=sparse_ce,
                  jit_compile=jit_compile)
    return model


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, FEATURES)).astype("float32")
    x[LOUD] *= 40.0
    return x, (np.arange(ROWS) % CLASSES).astype("int32")


def without_loud(x, y):
    keep = np.arange(len(y)) != LOUD
    return x[keep], y[keep]


def flat(model) -> np.ndarray:
    return np.concatenate([np.ravel(v.numpy()) for v in model.trainable_variables])


def released_sum(model, x, y, callbacks=()) -> np.ndarray:
    """The clipped sum one full-batch step (q = 1, σ = 0) releases, S = (θ₀ − θ₁)·L/η;
    the model's weights are restored afterwards."""
    weights = model.get_weights()
    before = flat(model)
    model.fit(x, y, batch_size=len(y), epochs=1, verbose=0, callbacks=list(callbacks))
    released = (before - flat(model)) * len(y) / RATE
    model.set_weights(weights)
    return released


def neighbour_release(model, x, y, monkeypatch) -> np.ndarray:
    """The release on x without the loud example, the probe switched off (the reference)."""
    with monkeypatch.context() as patch:
        patch.setattr(fitting, "check_rows_independent", lambda *args, **kwargs: None)
        patch.setattr(step, "reprobe_on_trace", lambda *args, **kwargs: None, raising=False)
        return released_sum(model, *without_loud(x, y))


def assert_refused_or_within_clip(model, layer, x, y, monkeypatch, callbacks=()):
    try:
        released = released_sum(model, x, y, callbacks)
    except ValueError as error:
        assert "mixes examples" in str(error) and layer.name in str(error)
        return
    neighbour = neighbour_release(model, x, y, monkeypatch)
    assert np.linalg.norm(released - neighbour) <= CLIP * (1 + 1e-4)


def test_a_variable_flag_set_between_fits_is_probed_on_the_next_fit(monkeypatch):
    layer = CentreWhenFlagged(name="centre_when_flagged")
    model = model_with(layer)
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # probed with the flag off: passes
    layer.flag.assign(True)
    neighbour = neighbour_release(model, x, y, monkeypatch)
    with monkeypatch.context() as patch:  # the reference really mixes: the step would release > C
        patch.setattr(fitting, "check_rows_independent", lambda *args, **kwargs: None)
        patch.setattr(step, "reprobe_on_trace", lambda *args, **kwargs: None, raising=False)
        assert np.linalg.norm(released_sum(model, x, y) - neighbour) > 2 * CLIP  # 3.02·C
    assert_refused_or_within_clip(model, layer, x, y, monkeypatch)


def test_a_global_read_at_trace_time_is_probed_when_a_new_batch_size_retraces(monkeypatch):
    monkeypatch.setitem(globals(), "CENTRE_AT_TRACE", False)
    layer = CentreIfGlobal(name="centre_if_global")
    model = model_with(layer)
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # traced and probed with the global off
    monkeypatch.setitem(globals(), "CENTRE_AT_TRACE", True)
    assert_refused_or_within_clip(model, layer, x, y, monkeypatch)  # batch size 32: a new trace


class SetGlobalOnTrainBegin(keras.callbacks.Callback):
    """Sets ``CENTRE_AT_TRACE`` after fit's own probe, before the step is traced."""

    def on_train_begin(self, logs=None):
        globals()["CENTRE_AT_TRACE"] = True


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_global_set_after_the_fits_probe_is_probed_when_the_step_is_traced(monkeypatch, jit_compile):
    monkeypatch.setitem(globals(), "CENTRE_AT_TRACE", False)
    layer = CentreIfGlobal(name="centre_if_global")
    model = model_with(layer, jit_compile)
    x, y = data()
    assert_refused_or_within_clip(model, layer, x, y, monkeypatch, callbacks=[SetGlobalOnTrainBegin()])


def test_train_on_batch_is_probed_again_when_its_step_is_retraced(monkeypatch):
    """Same shapes, same phase — a key the last verdict matches — but a new trace: sample
    weights change the step's plan, which re-traces it with the global now set."""
    monkeypatch.setitem(globals(), "CENTRE_AT_TRACE", False)
    layer = CentreIfGlobal(name="centre_if_global")
    model = model_with(layer)
    x, y = data()
    model.train_on_batch(x, y, batch_size=ROWS)
    monkeypatch.setitem(globals(), "CENTRE_AT_TRACE", True)
    weights = np.ones(ROWS, np.float32)
    before = flat(model)
    try:
        model.train_on_batch(x, y, sample_weight=weights, batch_size=ROWS)
    except ValueError as error:
        assert "mixes examples" in str(error) and layer.name in str(error)
        return
    released = (before - flat(model)) * ROWS / RATE
    pytest.fail(f"a re-traced row-mixing step trained (released norm {np.linalg.norm(released):.3f})")

