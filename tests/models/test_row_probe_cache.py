"""A passed row-independence verdict is reused only while what it was computed on is unchanged.

The probe (tf_dp.models.row_independence) checks that each example's output, loss and
gradient depend on its own row only (docs/algorithms.md §1). A verdict reused after the
model, its loss or the probed rows changed would let a row-mixing layer train: one example
would then move the released sum by more than C. Each refusal below is preceded by an
independent check that the change really mixes rows (other rows' outputs or losses move
when one row is changed, computed directly on the model); the reuse tests count the
probe's runs.
"""

import gc
import types
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.harness import sparse_ce
from tf_dp.models import row_independence

FEATURES, CLASSES, ROWS, BATCH, MAGIC = 6, 3, 64, 16, 7.0


class RollWhenEnabled(keras.layers.Layer):
    """Identity, or (``enabled``) each row takes the previous row's input: an attribute that mixes rows."""

    def __init__(self, enabled=False, **kwargs):
        super().__init__(**kwargs)
        self.enabled = enabled

    def call(self, inputs):
        return tf.roll(inputs, 1, axis=0) if self.enabled else inputs


class ScaleByBatchSize(keras.layers.Layer):
    """x · B: every row's output depends on how many rows the batch has."""

    def call(self, inputs):
        return inputs * tf.cast(tf.shape(inputs)[0], inputs.dtype)


class RollOnMagicValue(keras.layers.Layer):
    """A row whose first feature is the magic value takes the previous row's input."""

    def call(self, inputs):
        return tf.where(inputs[:, :1] == MAGIC, tf.roll(inputs, 1, axis=0), inputs)


class CrossEntropyPlusNeighbour(keras.losses.Loss):
    """Sparse cross-entropy, plus (``mix``) the previous row's: a loss attribute that mixes rows."""

    def __init__(self, mix=False):
        super().__init__(name="ce_plus_neighbour")
        self.mix = mix

    def call(self, y_true, y_pred):
        values = keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
        return values + tf.roll(values, 1, axis=0) if self.mix else values


def data(magic_row=None):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, FEATURES)).astype("float32")
    if magic_row is not None:
        x[magic_row, 0] = MAGIC
    return x, (np.arange(ROWS) % CLASSES).astype("int32")


def compile_dp(model, loss=sparse_ce):
    model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0), loss=loss)
    return model


def sequential(*middle, loss=sparse_ce, first=()):
    """Input → [first] → Dense(8, tanh) → [middle] → Dense(CLASSES)."""
    keras.utils.set_random_seed(0)
    return compile_dp(tf_dp.DPSequential([keras.Input((FEATURES,)), *first, keras.layers.Dense(8, activation="tanh"),
                                          *middle, keras.layers.Dense(CLASSES)]), loss)


def fit(model, x, y):
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


def steps(model) -> int:
    return int(model.privacy_ledger.steps.numpy())


def other_rows_move(model, x, loss=None) -> bool:
    """Independent of the probe: changing row 0 of a batch moves row 1's output (or loss)."""
    changed = x.copy()
    changed[0] = -3.0 * x[0] + 1.0
    y = np.arange(len(x)) % CLASSES
    values = []
    for batch in (x, changed):
        out = model(batch, training=False)
        values.append(np.asarray(out if loss is None else loss.call(y, out)))
    return not np.array_equal(values[0][1:], values[1][1:])


@pytest.fixture
def probe_runs(monkeypatch):
    """How many times the probe ran (fits whose verdict was reused do not count)."""
    runs = []
    check = row_independence._check

    def counting(*args, **kwargs):
        runs.append(1)
        return check(*args, **kwargs)

    monkeypatch.setattr(row_independence, "_check", counting)
    return runs


def test_an_attribute_flipped_to_mix_rows_is_refused_on_the_next_fit():
    layer = RollWhenEnabled()
    model = sequential(layer)
    x, y = data()
    fit(model, x, y)
    taken = steps(model)
    assert taken > 0 and not other_rows_move(model, x[:BATCH])
    layer.enabled = True
    assert other_rows_move(model, x[:BATCH])
    with pytest.raises(ValueError, match=f"mixes examples.*{layer.name}"):
        fit(model, x, y)
    assert steps(model) == taken


def test_a_call_replaced_on_the_instance_is_refused_on_the_next_fit():
    layer = RollWhenEnabled()
    model = sequential(layer)
    x, y = data()
    fit(model, x, y)
    layer.call = types.MethodType(ScaleByBatchSize.call, layer)
    assert not np.allclose(model(x[:4], training=False)[:3], model(x[:3], training=False))  # rows see B
    with pytest.raises(ValueError, match=f"mixes examples.*{layer.name}"):
        fit(model, x, y)


def test_a_batch_size_dependent_layer_swapped_in_is_refused_on_the_next_fit():
    model = sequential()
    x, y = data()
    fit(model, x, y)
    taken = steps(model)
    head = model.pop()
    model.add(ScaleByBatchSize(name="scale_by_batch_size"))
    model.add(head)
    assert not np.allclose(model(x[:4], training=False)[:3], model(x[:3], training=False))
    with pytest.raises(ValueError, match="mixes examples.*scale_by_batch_size"):
        fit(model, x, y)
    assert steps(model) == taken


def test_a_loss_attribute_flipped_to_mix_rows_is_refused_on_the_next_fit():
    loss = CrossEntropyPlusNeighbour()
    model = sequential(loss=loss)
    x, y = data()
    fit(model, x, y)
    taken = steps(model)
    loss.mix = True
    assert other_rows_move(model, x[:BATCH], loss)
    with pytest.raises(ValueError, match="mixes examples"):
        fit(model, x, y)
    assert steps(model) == taken


def test_rows_first_seen_in_the_next_fit_are_probed():
    """Mixing only for a value in the data: the first fit's rows lack it, the second's hold it."""
    model = sequential(first=[RollOnMagicValue(name="roll_on_magic")])
    x, y = data()
    fit(model, x, y)
    magic_x, magic_y = data(magic_row=5)
    assert other_rows_move(model, magic_x[[4, 5, 6]])  # the magic row 5 reads row 4
    with pytest.raises(ValueError, match="mixes examples.*roll_on_magic"):
        fit(model, magic_x, magic_y)


def test_every_fit_is_probed_and_an_unchanged_train_on_batch_loop_is_not(probe_runs):
    """fit probes on every call (and the step again whenever it is traced: what it computes
    may depend on values no key holds); train_on_batch reuses the verdict by key."""
    model = sequential(RollWhenEnabled(), keras.layers.Dropout(0.2))
    x, y = data()
    fit(model, x, y)
    assert len(probe_runs) == 2  # fit's own probe, and the first trace of its step
    model.evaluate(x, y, verbose=0)
    model.predict(x, verbose=0)
    assert len(probe_runs) == 2
    for _ in range(2):
        probed = len(probe_runs)
        fit(model, x, y)
        assert len(probe_runs) > probed
    model.train_on_batch(x[:BATCH], y[:BATCH], batch_size=BATCH)
    model.train_on_batch(x[:BATCH], y[:BATCH], batch_size=BATCH)  # the phase last opened is now "batches"
    probed = len(probe_runs)
    # train_on_batch keys its batches by structure, dtypes and shapes (not values): a loop over
    # new batches is not probed on every call
    for start in range(0, ROWS, BATCH):
        model.train_on_batch(x[start:start + BATCH], y[start:start + BATCH], batch_size=BATCH)
    assert len(probe_runs) == probed


def test_a_changed_loss_is_probed_again(probe_runs):
    loss = CrossEntropyPlusNeighbour()
    model = sequential(loss=loss)
    x, y = data()
    for _ in range(3):
        model.train_on_batch(x[:BATCH], y[:BATCH], batch_size=BATCH)
    probed = len(probe_runs)
    compile_dp(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.train_on_batch(x[:BATCH], y[:BATCH], batch_size=BATCH)
    assert len(probe_runs) > probed
    probed = len(probe_runs)
    for _ in range(2):
        model.train_on_batch(x[:BATCH], y[:BATCH], batch_size=BATCH)
    assert len(probe_runs) == probed


def test_verdicts_hold_their_model_weakly():
    model = sequential()
    x, y = data()
    row_independence.check_rows_independent(model, model._dp_loss, x, y)
    assert model in row_independence._checked
    dead = weakref.ref(model)
    del model
    gc.collect()
    assert dead() is None


class ScaledByHelper(keras.layers.Layer):
    """x · helper(x): the helper is a method of the class, looked up at call time."""

    def helper(self, inputs):
        return tf.ones_like(inputs)

    def call(self, inputs):
        return inputs * self.helper(inputs)


def test_a_helper_method_replaced_on_the_class_is_refused_on_the_next_fit(monkeypatch):
    layer = ScaledByHelper(name="scaled_by_helper")
    model = sequential(layer)
    x, y = data()
    fit(model, x, y)
    monkeypatch.setattr(ScaledByHelper, "helper", lambda self, inputs: tf.reduce_mean(inputs, axis=0, keepdims=True))
    assert other_rows_move(model, x[:BATCH])
    with pytest.raises(ValueError, match="mixes examples.*scaled_by_helper"):
        fit(model, x, y)
