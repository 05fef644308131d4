"""The tap's watch of Keras variable reads (tap.py, _ReadWatch): installed only while a tap is
open, removed even when the tapped pass raises, re-entrant, and thread-local — another
thread's reads return the variable's value and reach no tap of this thread."""

import threading

import keras
import numpy as np
import pytest

from tf_dp.clipping.tap import LayerTap, _ReadWatch
from keras.src.backend.common import variables as keras_variables


def dense():
    layer = keras.layers.Dense(3)
    layer.build((None, 2))
    return layer


def original_value_property():
    return keras_variables.Variable.__dict__["value"]


def test_the_watch_is_removed_after_an_exception_inside_the_tap():
    original = original_value_property()
    layer = dense()
    with pytest.raises(RuntimeError, match="inside the tap"):
        with LayerTap([layer]):
            assert _ReadWatch.installed() and original_value_property() is not original
            raise RuntimeError("inside the tap")
    assert not _ReadWatch.installed()
    assert original_value_property() is original
    assert "call" not in layer.__dict__  # the layer's own call is back


def test_nested_taps_share_one_watch_removed_with_the_last():
    original = original_value_property()
    first, second = dense(), dense()
    with LayerTap([first]) as outer:
        with LayerTap([second]) as inner:
            np.asarray(first.kernel)  # a read outside any tapped call: a foreign read for both taps
        assert _ReadWatch.installed()
        np.asarray(first.kernel)
    assert original_value_property() is original
    assert id(first.kernel) in outer.foreign_reads
    assert not inner.foreign_reads  # first's kernel is not a variable of the inner tap


def test_another_threads_reads_are_unaffected_while_a_tap_is_open():
    layer = dense()
    want = layer.kernel.numpy().copy()
    seen = {}

    def other_thread():
        seen["value"] = np.asarray(layer.kernel)  # read while the main thread's tap is open
        seen["taps"] = _ReadWatch.taps_of_this_thread()

    with LayerTap([layer]) as tap:
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        assert not tap.foreign_reads  # the other thread's read reached no tap
        np.asarray(layer.kernel)  # the same read in this thread does (the check can fail)
        assert id(layer.kernel) in tap.foreign_reads
    np.testing.assert_array_equal(seen["value"], want)
    assert seen["taps"] == ()
