"""The row-probe key's memo (tf_dp.models.probe_key._KeyMemo) never hides a change.

``train_on_batch`` computes the verdict key on every call; the memo reuses an object's
attribute keys while its ``__dict__`` holds the same objects. Each test changes something in
place after a memoized walk and compares the memoized key with an independent one: a walk
with the memo emptied (what the key was before the memo existed). The two must agree, and
the change must change the key.
"""

import functools

import keras
import numpy as np
import pytest

from tf_dp.models import probe_key
from tf_dp.models.probe_key import verdict_key


def _model():
    inputs = keras.Input((3,))
    dense = keras.layers.Dense(2, name="dense")
    model = keras.Model(inputs, dense(inputs))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, dense, loss


HEAD = (np.zeros((4, 3), np.float32), np.zeros(4, np.int64))


def _key(model, loss):
    return verdict_key(model, loss, HEAD, 2, key_contents=False)


def _fresh_key(model, loss):
    object.__setattr__(model, probe_key.MEMO_ATTRIBUTE, probe_key._KeyMemo())
    return _key(model, loss)


def _helper(x, scale=1):
    return x * scale


CHANGES = {
    "an int rebound": (lambda d: setattr(d, "extra", 1), lambda d: setattr(d, "extra", 2)),
    "a list appended to": (lambda d: setattr(d, "extra", [1]), lambda d: d.extra.append(2)),
    "a list element replaced": (lambda d: setattr(d, "extra", [1, 2]), lambda d: d.extra.__setitem__(0, 3)),
    "a dict in a tuple changed": (lambda d: setattr(d, "extra", ({"a": [1]},)), lambda d: d.extra[0]["a"].append(2)),
    "a dict value replaced": (lambda d: setattr(d, "extra", {"a": 1}), lambda d: d.extra.__setitem__("a", 2)),
    "a dict key True for 1": (lambda d: setattr(d, "extra", {True: 1}),
                              lambda d: (d.extra.clear(), d.extra.__setitem__(1, 1))),
    "a partial's keywords changed": (lambda d: setattr(d, "extra", functools.partial(_helper, scale=1)),
                                     lambda d: d.extra.keywords.__setitem__("scale", 2)),
    "a set removed from a list": (lambda d: setattr(d, "extra", [set(), [1]]), lambda d: d.extra.pop(0)),
    "an attribute added": (lambda d: None, lambda d: object.__setattr__(d, "extra", True)),
    "an attribute deleted": (lambda d: setattr(d, "extra", 0.5), lambda d: d.__dict__.pop("extra")),
    "a function swapped": (lambda d: setattr(d, "extra", _helper), lambda d: setattr(d, "extra", _fresh_key)),
}


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_a_layer_attribute_changed_in_place_changes_the_memoized_key(name):
    model, dense, loss = _model()
    before, change = CHANGES[name]
    before(dense)
    first = _key(model, loss)
    assert _key(model, loss) == first  # memoized, unchanged
    change(dense)
    memoized = _key(model, loss)
    assert memoized != first, name
    assert memoized == _fresh_key(model, loss), name


def test_a_dict_reordered_keeps_its_key():
    """Keys of dicts are sorted: a reordered dict is not a change (and the memo agrees)."""
    model, dense, loss = _model()
    dense.extra = {"a": 1, "b": 2}
    first = _key(model, loss)
    dense.extra["a"] = dense.extra.pop("a")
    assert _key(model, loss) == first == _fresh_key(model, loss)


def test_a_list_holding_a_set_stays_skipped_whatever_else_changes_in_it():
    """A container holding a skipped value directly is skipped: its other elements may change."""
    model, dense, loss = _model()
    dense.extra = [set(), [1]]
    first = _key(model, loss)
    dense.extra[1].append(2)
    assert _key(model, loss) == first == _fresh_key(model, loss)


def test_a_loss_attribute_changed_in_place_changes_the_memoized_key():
    """The loss is keyed two objects deep: its attributes are keyed again at every walk."""
    model, _, loss = _model()
    first = _key(model, loss)
    assert _key(model, loss) == first
    loss._fn_kwargs["from_logits"] = False  # Keras' LossFunctionWrapper: the function's arguments
    memoized = _key(model, loss)
    assert memoized != first
    assert memoized == _fresh_key(model, loss)


def test_an_unchanged_model_reuses_every_attribute_key(monkeypatch):
    """What makes the per-call walk cheap: no layer's attributes are keyed afresh."""
    model, _, loss = _model()
    first = _key(model, loss)
    built = []
    node = probe_key._node
    monkeypatch.setattr(probe_key, "_node", lambda value, depth: built.append(value) or node(value, depth))
    assert _key(model, loss) == first
    assert not built
