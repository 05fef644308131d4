"""User ids travel with their rows (issue 31 item 1; docs/algorithms.md §11).

Ids given as an array beside a shuffled ``from_tensor_slices((x, y)).shuffle(N)`` labelled the rows
in the dataset's shuffled order with ids in array order: one person's 20 examples fell under 17
ids, each clipped to C on its own (14.2·C measured). For a dataset or a source the id is now a
feature of each element, ``user_ids="uid"`` naming x's key (removed before the model sees it); an
array of ids is refused there and accepted only beside arrays. Each fit is checked against an
independent per-user GradientTape loop over the users' rows grouped by numpy, and one user's
contribution is the released sum with and without that user at σ = 0 (bound C)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
CLIP, USERS, M, FEATURES, TARGET = 0.5, 8, 4, 4, 103


def dense_model(jit_compile=False):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,), name="features")
    model = tf_dp.DPModel(inputs, keras.layers.Dense(3)(keras.layers.Dense(6, activation="tanh")(inputs)))
    model.compile(optimizer=tf_dp.DPSGD(1.0, l2_norm_clip=CLIP, noise_multiplier=0.0, seed=1), loss=LOSS,
                  delta=1e-5, jit_compile=jit_compile)
    return model


def people(with_target=True):
    """USERS users of M examples each (ids 100..), rows in a random order; user TARGET's examples are
    large, so its averaged gradient is far above C."""
    rng = np.random.default_rng(0)
    ids = np.repeat(np.arange(100, 100 + USERS), M)
    x = rng.normal(size=(len(ids), FEATURES)).astype("float32")
    x[ids == TARGET] *= 30.0
    y = rng.integers(0, 3, len(ids)).astype("int32")
    keep = ids != TARGET if not with_target else np.ones(len(ids), bool)
    order = rng.permutation(int(keep.sum()))
    return x[keep][order], y[keep][order], ids[keep][order]


def flat(tensors):
    return np.concatenate([np.asarray(t, np.float64).ravel() for t in tensors])


def per_user_sum(model, x, y, ids):
    """Σ_u clip_C(∇ (1/m) Σ_j ℓ(x_uj, y_uj)) over every user (q = 1: all sampled, each with all M
    examples), by a GradientTape per user; and each user's unclipped norm."""
    total, norms = 0.0, {}
    for uid in np.unique(ids):
        rows = ids == uid
        with tf.GradientTape() as tape:
            value = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                y[rows], model({"features": x[rows]}, training=True), from_logits=True))
        g = flat(tape.gradient(value, model.trainable_variables))
        norms[int(uid)] = np.linalg.norm(g)
        total = total + min(1.0, CLIP / norms[int(uid)]) * g
    return total, norms


def pipeline(kind, x, y, ids):
    rows = tf.data.Dataset.from_tensor_slices(({"features": x, "uid": ids}, y))
    if kind == "shuffled":
        return rows.shuffle(len(ids), seed=5)  # read in its shuffled order (materialized)
    if kind == "mapped":
        return rows.map(lambda f, t: (f, t))  # random access (tf.data.experimental.at)
    return rows


def released_sum(model, data, users, **kwargs):
    """−Σ (the released clipped sum) of one step at learning rate 1, σ = 0: the update times L_u."""
    before = flat(model.trainable_variables)
    model.fit(data, batch_size=users, user_ids="uid", examples_per_user=M, steps_per_epoch=1, epochs=1,
              sampling_seed=3, verbose=0, **kwargs)
    return (before - flat(model.trainable_variables)) * users


@pytest.mark.parametrize("kind", ["shuffled", "mapped", "slices"])
def test_ids_named_as_a_feature_of_a_dataset_give_the_per_user_loop(kind):
    x, y, ids = people()
    expected, norms = per_user_sum(dense_model(), x, y, ids)
    assert norms[TARGET] > CLIP
    got = released_sum(dense_model(), pipeline(kind, x, y, ids), USERS)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_one_user_of_a_shuffled_dataset_moves_the_released_sum_by_at_most_c(jit_compile):
    with_user = released_sum(dense_model(jit_compile), pipeline("shuffled", *people(True)), USERS)
    without = released_sum(dense_model(jit_compile), pipeline("shuffled", *people(False)), USERS - 1)
    moved = np.linalg.norm(with_user - without)
    assert moved <= CLIP * (1 + 1e-4)
    assert moved >= 0.99 * CLIP  # attained: the user's gradient is far above C (not a vacuous bound)


class Records:
    """A random-access source: record i = ({"features": x_i, "uid": id_i}, y_i)."""

    def __init__(self, x, y, ids):
        self.x, self.y, self.ids = x, y, ids

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        return {"features": self.x[index], "uid": self.ids[index]}, self.y[index]


def test_ids_named_as_a_record_field_of_a_source_give_the_per_user_loop():
    x, y, ids = people()
    expected, _ = per_user_sum(dense_model(), x, y, ids)
    got = released_sum(dense_model(), Records(x, y, ids), USERS)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_an_id_array_is_accepted_beside_arrays_and_a_feature_key_beside_a_dict_of_arrays():
    x, y, ids = people()
    expected, _ = per_user_sum(dense_model(), x, y, ids)
    model = dense_model()
    before = flat(model.trainable_variables)
    model.fit(x, y, batch_size=USERS, user_ids=ids, examples_per_user=M, steps_per_epoch=1, sampling_seed=3,
              verbose=0)
    np.testing.assert_allclose((before - flat(model.trainable_variables)) * USERS, expected, rtol=1e-4, atol=1e-5)
    got = released_sum(dense_model(), {"features": x, "uid": ids}, USERS, y=y)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_an_id_array_beside_a_dataset_or_a_source_is_refused_with_the_fix(jit_compile):
    """The old behaviour (ids in array order beside a shuffled dataset: 14.2·C) is refused."""
    x, y, ids = people()
    model = dense_model(jit_compile)
    shuffled = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(y), seed=5)
    with pytest.raises(ValueError, match=r"(?s)beside a tf\.data\.Dataset.*user_ids='uid'"):
        model.fit(shuffled, batch_size=USERS, user_ids=ids, examples_per_user=M, verbose=0)
    with pytest.raises(ValueError, match=r"(?s)beside a source.*user_ids='uid'"):
        model.fit(Records(x, y, ids), batch_size=USERS, user_ids=ids, examples_per_user=M, verbose=0)
    with pytest.raises(ValueError, match=r"user_ids='user' names a feature of x, but x has the keys"):
        model.fit(pipeline("shuffled", x, y, ids), batch_size=USERS, user_ids="user", examples_per_user=M, verbose=0)
    assert int(model.privacy_ledger.steps.numpy()) == 0
