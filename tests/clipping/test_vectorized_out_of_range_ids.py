"""Token ids outside [0, V) in the vectorized engine (per-example gradients by vectorized_map).

The ghost rules look up a zero vector with no gradient for an id ≥ V or < −V (Keras' result
on a GPU; tests/clipping/test_embedding_out_of_range_ids.py). The whole-model vectorized engine ran
plain Keras' lookup inside the map, which fails on a CPU: a DP step that failed at the
first batch sampling such an example would tell when it was sampled. It now matches the
ghost rules; compared with a per-example loop of plain Keras whose lookups zero those
positions.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.clipping.test_embedding_out_of_range_ids import (KINDS, LENGTH, VOCABULARY, _batch, _models,
                                                         assert_matches_loop, token_loss)


@pytest.mark.parametrize("kind", KINDS)
def test_vectorized_engine_looks_up_zero_for_ids_out_of_range(kind):
    dp_model, reference = _models(kind)
    assert_matches_loop(dp_model, reference, *_batch([VOCABULARY, -1, VOCABULARY + 3, -VOCABULARY - 1]),
                        "vectorized")


def test_vectorized_engine_leaves_the_embedding_as_it_was():
    """The wrapped lookup is only in place while the map is traced: afterwards plain Keras
    again fails on an out-of-range id on a CPU, as it did before."""
    dp_model, _ = _models("embedding")
    x, y = _batch([VOCABULARY, -1, VOCABULARY + 3, -VOCABULARY - 1])
    tf_dp.clipping.clipped_gradient_sum(dp_model, token_loss, tf.constant(x), tf.constant(y), tf.ones(len(x)), 1.0,
                                        engine="vectorized")
    table = [layer for layer in dp_model._flatten_layers() if isinstance(layer, keras.layers.Embedding)][0]
    assert "call" not in vars(table)


def test_dp_fit_with_the_vectorized_engine_and_out_of_range_ids_completes():
    dp_model, _ = _models("embedding")
    model = tf_dp.DPModel(dp_model.inputs, dp_model.outputs)
    model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0), loss=token_loss,
                  clipping_engine="vectorized")
    x = np.random.default_rng(1).integers(0, VOCABULARY, (32, LENGTH)).astype("int32")
    y = np.roll(x, -1, axis=1)
    x[5, 1], x[20, 3], x[9, 0] = VOCABULARY, -1, -VOCABULARY - 2
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, sampling_seed=0)
    assert int(model.privacy_ledger.steps.numpy()) >= 2
    assert all(np.all(np.isfinite(v.numpy())) for v in model.trainable_variables)
