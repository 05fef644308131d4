"""A loss must give one value per example, each depending on its row alone.

A loss reduced over the batch (or combining rows) makes every example's gradient depend on
the others, so clipping no longer bounds one example's influence. Every built-in Keras
loss is either refused with an error naming `loss`, or shown row-independent here.
"""

import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp.models.losses import _SingleOutputLoss, per_example_loss

ROWS = 5
RNG = np.random.default_rng(0)
PROBS = RNG.uniform(0.05, 1.0, size=(ROWS, 3)).astype("float32")
PROBS /= PROBS.sum(axis=1, keepdims=True)
ONE_HOT = np.eye(3, dtype="float32")[[0, 1, 2, 1, 0]]
SPARSE = np.array([0, 1, 2, 1, 0], "int32")
EMBEDDINGS = RNG.normal(size=(ROWS, 4)).astype("float32")
EMBEDDINGS /= np.linalg.norm(EMBEDDINGS, axis=1, keepdims=True)
CTC_LABELS = np.array([[1, 2, 0], [2, 2, 1], [3, 0, 0], [1, 3, 2], [2, 0, 0]], "int32")
CTC_LOGITS = RNG.normal(size=(ROWS, 6, 4)).astype("float32")

# (y_true, y_pred) per loss, by lower-cased name; the default suits the rest.
DATA = {
    "sparsecategoricalcrossentropy": (SPARSE, PROBS), "sparse_categorical_crossentropy": (SPARSE, PROBS),
    "categoricalgeneralizedcrossentropy": (SPARSE, PROBS),
    "ctc": (CTC_LABELS, CTC_LOGITS),
    "circle": (SPARSE, EMBEDDINGS),
}
# Keras losses that reduce over the batch (dice, tversky: axis=None) or combine rows
# (circle: pairwise distances in the batch); categorical_generalized_cross_entropy as a
# bare function needs `q`, so it cannot be evaluated (the class has a default q).
MUST_REFUSE = {"Dice", "dice", "Tversky", "tversky", "Circle", "circle", "categorical_generalized_cross_entropy"}


def builtin_losses():
    """Every loss class and function keras.losses exports."""
    found = {}
    for name in dir(keras.losses):
        obj = getattr(keras.losses, name)
        if name.startswith("_") or name in ("get", "serialize", "deserialize", "Loss"):
            continue
        if inspect.isclass(obj) and issubclass(obj, keras.losses.Loss):
            found[name] = obj()
        elif inspect.isfunction(obj):
            found[name] = obj
    return found


def perturbed(array, k):
    changed = array.copy()
    changed[k] = (array[k] + 1) % 3 if array.dtype.kind in "iu" else 1.0 - array[k]
    return changed


def evaluate(loss, y_true, y_pred):
    """ℓ_i of ``per_example_loss(loss)`` (a function of it, or the loss: wrapped and probed anew)."""
    wrapped = loss if isinstance(loss, _SingleOutputLoss) else per_example_loss(loss)
    return wrapped(tf.constant(y_true), tf.constant(y_pred)).numpy()


def test_every_builtin_keras_loss_is_refused_or_proven_row_independent():
    losses = builtin_losses()
    assert {"MeanSquaredError", "Dice", "Circle", "CTC", "CategoricalGeneralizedCrossEntropy"} <= set(losses)
    refused = {}
    for name, loss in losses.items():
        y_true, y_pred = DATA.get(name.lower(), (ONE_HOT, PROBS))
        # One wrapper per loss: its row probe (the refusal) runs at the first call, once per
        # input signature; the perturbed rows below check row independence by their values.
        try:
            loss = per_example_loss(loss)
            base = evaluate(loss, y_true, y_pred)
        except ValueError as error:
            refused[name] = str(error)
            continue
        assert base.shape == (ROWS,), name
        for k in range(ROWS):
            for changed in ((y_true, perturbed(y_pred, k)), (perturbed(y_true, k), y_pred)):
                values = evaluate(loss, *changed)
                others = np.arange(ROWS) != k
                np.testing.assert_array_equal(values[others], base[others], err_msg=f"{name}: row {k} moved others")
    assert set(refused) == MUST_REFUSE, sorted(refused)
    for name, message in refused.items():
        assert "`loss`" in message and "Fix:" in message, (name, message)


def test_scalar_and_batch_statistic_losses_are_refused_with_the_fix():
    y, p = tf.constant(ONE_HOT), tf.constant(PROBS)
    with pytest.raises(ValueError, match=r"`loss` returned shape \[\].*one loss value per example"):
        per_example_loss(lambda a, b: tf.reduce_mean(tf.square(a - b)))(y, p)
    with pytest.raises(ValueError, match="`loss` mixes examples"):
        per_example_loss(lambda a, b: tf.reduce_mean(tf.square(a - b - tf.reduce_mean(b, axis=0)), axis=-1))(y, p)
    with pytest.raises(ValueError, match="`loss` returned shape"):  # keepdims over the batch: 1 value for 5 rows
        per_example_loss(lambda a, b: tf.reduce_mean(tf.square(a - b), keepdims=True)[0])(y, p)


def test_dice_is_accepted_when_computed_per_example():
    values = evaluate(keras.losses.Dice(axis=(1,)), ONE_HOT, PROBS)
    expected = 1 - 2 * (ONE_HOT * PROBS).sum(1) / (ONE_HOT.sum(1) + PROBS.sum(1) + keras.backend.epsilon())
    np.testing.assert_allclose(values, expected, rtol=1e-6)


def test_probe_also_refuses_inside_a_traced_step():
    loss = per_example_loss(lambda a, b: tf.reduce_mean(tf.square(a - b), axis=-1) * tf.reduce_sum(b))
    with pytest.raises(ValueError, match="`loss` mixes examples"):
        tf.function(loss)(tf.constant(ONE_HOT), tf.constant(PROBS))


@pytest.mark.parametrize("engine", ["ghost", "vectorized"])
@pytest.mark.parametrize("loss", [lambda y, p: tf.reduce_mean(tf.square(y - p)), "dice"], ids=["reduce_mean", "dice"])
def test_dp_fit_refuses_a_batch_loss_in_both_engines(engine, loss):
    x = RNG.normal(size=(40, 6)).astype("float32")
    y = (RNG.uniform(size=(40, 3)) > 0.5).astype("float32")
    model = tf_dp.DPSequential([keras.Input((6,)), keras.layers.Dense(3, activation="sigmoid")])
    model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0), loss=loss,
                  clipping_engine=engine)
    with pytest.raises(ValueError, match="`loss`"):
        model.fit(x, y, batch_size=10, epochs=1, verbose=0)
    assert int(model.privacy_ledger.steps.numpy()) == 0
