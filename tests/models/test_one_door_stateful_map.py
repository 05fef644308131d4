"""The door refuses a map/filter whose function carries state from one element into the next
(a tf.Variable written from the element: a ``scan`` in disguise), found by an adversarial review:
at σ = 0 one person moved the released sum by 3.31·C through ``map(lambda x: x + prev; prev = x)``.
Element-independent state (a random layer's seed counter) stays allowed."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dp.sampling.dataset_graph import refused_by_graph, refused_operations

N = 16


def rows():
    rng = np.random.default_rng(0)
    return tf.data.Dataset.from_tensor_slices((rng.normal(size=(N, 3)).astype("float32"), np.zeros(N, "float32")))


def carried_previous_row():
    previous = tf.Variable(tf.zeros([3]))

    def mix(x, y):
        out = x + previous.read_value()
        with tf.control_dependencies([out]):
            previous.assign(x)
        return out, y

    return mix


def counted_rows():
    counter = tf.Variable(0.0)

    def count(x, y):
        counter.assign_add(1.0)  # the element is not written: each row stays its own
        return x, y

    return count


@pytest.mark.parametrize("batched", [False, True])
def test_a_map_writing_a_variable_from_the_element_is_refused(batched):
    dataset = rows().map(carried_previous_row())
    if batched:
        dataset = dataset.batch(4)
    # Independent check that the pipeline mixes examples: row 1 carries row 0.
    x = np.stack([e[0] for e in rows().map(carried_previous_row()).as_numpy_iterator()])
    plain = np.stack([e[0] for e in rows().as_numpy_iterator()])
    np.testing.assert_allclose(x[1], plain[1] + plain[0], rtol=1e-6)
    refused = refused_operations(dataset, batched)
    assert refused and "writes a tf.Variable from the element" in refused[0]
    assert refused == refused_by_graph(dataset, batched)


def test_a_map_through_a_nested_function_writing_state_is_refused():
    previous = tf.Variable(tf.zeros([3]))

    @tf.function
    def remember(x):
        out = x + previous.read_value()
        with tf.control_dependencies([out]):
            previous.assign(x)
        return out

    assert refused_operations(rows().map(lambda x, y: (remember(x), y)), batched=False)


def test_element_independent_state_and_random_layers_stay_allowed():
    assert refused_operations(rows().map(counted_rows()), batched=False) == []
    noise = keras.layers.GaussianNoise(0.1)
    assert refused_operations(rows().map(lambda x, y: (noise(x, training=True), y)), batched=False) == []
    images = tf.data.Dataset.from_tensor_slices((np.zeros((4, 8, 8, 3), "float32"), np.zeros(4, "float32")))
    flip = keras.layers.RandomFlip("horizontal")
    assert refused_operations(images.map(lambda x, y: (flip(x, training=True), y)).batch(2), batched=True) == []
