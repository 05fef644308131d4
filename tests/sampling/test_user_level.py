"""User-level DP (docs/algorithms.md §11): users Poisson-sampled at q_u = L_u/N_u, each sampled
user's m examples averaged and clipped ONCE, noise once, divided by L_u; the ledger's N is the
number of users. Each test compares against an independent computation: a per-user
GradientTape loop, numpy gathers of the sampler's indices, dp_accounting directly, a binomial
rate, the C/L_u bound on a user's influence."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant

import tf_dp
from tf_dp.accounting.accountant import RDP_ORDERS
from tf_dp.clipping.engine import AugmentationViews, clipped_gradient_sum
from tf_dp.models.data import poisson_dataset
from tf_dp.models.losses import WeightedTargets, per_example_loss
from tf_dp.sampling import UserPoissonSampler
from tf_dp.sampling.users import UserPoissonSampling
from tf_dp.sampling.sources import ArraySource

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
CLIP = 0.5


def dense_model(sigma=0.0, learning_rate=1.0, features=4, classes=3, clip=CLIP):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((features,))
    h = keras.layers.Dense(6, activation="tanh")(inputs)
    model = tf_dp.DPModel(inputs, keras.layers.Dense(classes)(h))
    model.compile(optimizer=tf_dp.DPSGD(learning_rate, l2_norm_clip=clip, noise_multiplier=sigma, seed=1), loss=LOSS,
                  delta=1e-5)
    return model


def conv_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 6, 2))
    h = keras.layers.Conv2D(3, 3, activation="tanh")(inputs)
    h = keras.layers.LayerNormalization()(h)
    h = keras.layers.Flatten()(h)
    model = tf_dp.DPModel(inputs, keras.layers.Dense(4)(h))
    model.compile(optimizer=tf_dp.DPSGD(0.5, l2_norm_clip=CLIP, noise_multiplier=0.0, seed=1), loss=LOSS)
    return model


def flat(tensors):
    return np.concatenate([np.asarray(t, np.float64).ravel() for t in tensors])


def weights_of(model):
    return flat(model.trainable_variables)


def per_user_loop(model, x, y, mask, weights=None):
    """Σ_u mask_u · clip_C(g_u), g_u = ∇ (1/m) Σ_j w_uj ℓ(θ; x_uj, y_uj), by a GradientTape per user."""
    total, norms = np.zeros_like(weights_of(model)), []
    for u in range(len(mask)):
        with tf.GradientTape() as tape:
            losses = keras.losses.sparse_categorical_crossentropy(y[u], model(x[u], training=True), from_logits=True)
            if weights is not None:
                losses = losses * weights[u]
            value = tf.reduce_mean(losses)
        g = flat(tape.gradient(value, model.trainable_variables))
        norms.append(np.linalg.norm(g))
        total += mask[u] * min(1.0, CLIP / norms[-1]) * g
    return total, np.array(norms)


# ----------------------------------------------------------- the clipped sum per user
@pytest.mark.parametrize("engine", ["ghost", "vectorized"])
@pytest.mark.parametrize("weighted", [False, True])
def test_per_user_norms_and_clipped_sum_match_a_per_user_loop(engine, weighted):
    model = conv_model()
    model._dp["engine"] = engine
    rng = np.random.default_rng(0)
    users, m = 5, 3
    x = (rng.normal(size=(users, m, 6, 6, 2)) * 3).astype("float32")
    y = rng.integers(0, 4, (users, m)).astype("int32")  # each example its own label
    mask = np.array([1, 1, 1, 1, 0], np.float32)
    weights = rng.uniform(0.2, 2.0, (users, m)).astype("float32") if weighted else None
    targets = tf.constant(y) if weights is None else WeightedTargets(tf.constant(y), tf.constant(weights))
    result = clipped_gradient_sum(model, per_example_loss(LOSS), tf.constant(x), targets, tf.constant(mask),
                                  tf.constant(CLIP), engine=engine,
                                  views=AugmentationViews(m, view_axis=True, targets_per_view=True))
    expected, norms = per_user_loop(model, x, y, mask, weights)
    assert np.all(norms > CLIP)  # every user is clipped: clipping per example would differ
    np.testing.assert_allclose(np.sqrt(result.squared_norms.numpy())[:4], norms[:4], rtol=1e-3)
    np.testing.assert_allclose(flat(result.clipped_sums), expected, rtol=2e-3, atol=2e-5)


def test_a_users_examples_with_different_labels_are_not_one_shared_label():
    """The views mechanism of augmentation shares one label; user-level must not (the loop differs)."""
    model = conv_model()
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 3, 6, 6, 2)).astype("float32")
    y = np.array([[0, 1, 2], [3, 0, 1]], np.int32)
    result = clipped_gradient_sum(model, per_example_loss(LOSS), tf.constant(x), tf.constant(y),
                                  tf.constant([1.0, 1.0]), tf.constant(CLIP),
                                  views=AugmentationViews(3, view_axis=True, targets_per_view=True))
    shared, _ = per_user_loop(model, x, np.repeat(y[:, :1], 3, axis=1), np.ones(2))
    own, _ = per_user_loop(model, x, y, np.ones(2))
    np.testing.assert_allclose(flat(result.clipped_sums), own, rtol=2e-3, atol=2e-5)
    assert np.linalg.norm(own - shared) > 1e-2


# ----------------------------------------------------------- the sampler
def test_users_are_poisson_sampled_at_q_u_whatever_their_number_of_examples():
    counts = [1] * 30 + [50] * 10  # per-example sampling would favour the 10 large users 50×
    ids = np.repeat(np.arange(40), counts)
    sampler = UserPoissonSampler(ids, expected_users=8, examples_per_user=4, physical_batch_size=5, seed=7)
    q, steps = 8 / 40, 3000
    taken = np.zeros(40)
    sizes = []
    for t in range(steps):
        indices, mask = sampler.batch(t)
        assert indices.shape[1:] == (5, 4) and mask.shape == indices.shape[:2]
        rows = indices.reshape(-1, 4)[mask.reshape(-1) > 0]
        owners = ids[rows]
        assert np.all(owners == owners[:, :1])  # a row holds m examples of ONE user
        assert len(set(owners[:, 0])) == len(owners)  # each sampled user once
        taken[owners[:, 0]] += 1
        sizes.append(len(rows))
    rate_sd = np.sqrt(q * (1 - q) / steps)
    assert np.all(np.abs(taken / steps - q) < 5 * rate_sd)
    assert abs(taken[:30].mean() - taken[30:].mean()) / steps < 5 * rate_sd
    size_sd = np.sqrt(40 * q * (1 - q) / steps)  # realized batch ~ Binomial(N_u, q_u)
    assert abs(np.mean(sizes) - 8) < 5 * size_sd
    assert abs(np.var(sizes) - 40 * q * (1 - q)) < 0.15 * 40 * q * (1 - q)


def test_each_user_cycles_through_all_of_its_examples_and_repeats_when_it_has_fewer_than_m():
    ids = np.array(["a"] * 2 + ["b"] * 9 + ["c"] * 5)
    sampler = UserPoissonSampler(ids, expected_users=3, examples_per_user=4, seed=3)  # q = 1: every user, every step
    used = {u: [] for u in "abc"}
    for t in range(9):
        indices, mask = sampler.batch(t)
        for row in indices.reshape(-1, 4)[mask.reshape(-1) > 0]:
            user = ids[row[0]]
            if user == "a":
                assert sorted(row.tolist()) == [0, 0, 1, 1]  # 2 examples, m = 4: each twice
            used[user].extend(row.tolist())
    for user in "abc":
        counts = np.bincount(used[user])[np.flatnonzero(ids == user)]
        assert counts.min() >= 1 and counts.max() - counts.min() <= 1  # every example, as evenly as cycling gives


def test_batch_t_is_a_function_of_seed_and_t_and_the_order_is_secret():
    ids = np.repeat(np.arange(20), 6)
    one, two = (UserPoissonSampler(ids, 5, 3, seed=11) for _ in range(2))
    for t in (0, 5, 3, 5):
        for a, b in zip(one.batch(t), two.batch(t)):
            np.testing.assert_array_equal(a, b)
    other = UserPoissonSampler(ids, 5, 3, seed=12)
    assert not np.array_equal(one._order, other._order)  # the per-user order comes from the seed
    fresh = UserPoissonSampler(ids, 5, 3)
    assert fresh.seed != UserPoissonSampler(ids, 5, 3).seed  # no seed: OS entropy
    secure = UserPoissonSampler(ids, 5, 3, secure=True)
    assert secure.batch(0)[0].shape[2] == 3
    assert UserPoissonSampler(ids, 5, 1, seed=11).batch(0)[0].ndim == 2  # m = 1: the example-level layout


def test_the_loader_gathers_each_users_examples_with_their_own_labels_and_weights():
    rng = np.random.default_rng(0)
    n = 60
    x = rng.normal(size=(n, 3)).astype("float32")
    y = np.arange(n, dtype=np.int64)
    weights = rng.uniform(size=n).astype("float32")
    ids = rng.integers(0, 12, n)
    scheme = UserPoissonSampling.for_fit(n, 4, user_ids=ids, examples_per_user=3)
    data = poisson_dataset(None, None, n, 4, 3, 5, {"sample_weight": weights}, source=ArraySource(x, y),
                           scheme=scheme, first_step=lambda: 10)
    element = next(iter(data))
    indices, mask = UserPoissonSampler(ids, 4, 3, physical_batch_size=3, seed=5).batch(10)
    real = (mask > 0)[..., None]
    np.testing.assert_array_equal(element["mask"].numpy(), mask)
    np.testing.assert_array_equal(element["y"].numpy(), np.where(real, y[indices], 0))
    np.testing.assert_array_equal(element["x"].numpy(), np.where(real[..., None], x[indices], 0))
    np.testing.assert_array_equal(element["sample_weight"].numpy(), np.where(real, weights[indices], 0))


# ----------------------------------------------------------- fit
def light_and_heavy_users(heavy: bool):
    """5 users of one example each, and (if ``heavy``) a 6th user owning 200 identical examples."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 4)).astype("float32")
    y = np.array([0, 1, 2, 0, 1])
    ids = np.arange(5)
    if heavy:
        x = np.concatenate([x, np.full((200, 4), 40.0, np.float32)])
        y = np.concatenate([y, np.full(200, 2)])
        ids = np.concatenate([ids, np.full(200, 99)])
    return x, y, ids


def seed_sampling_every_user(ids, users, m):
    for seed in range(1000):
        _, mask = UserPoissonSampler(ids, users, m, seed=seed).batch(0)
        if mask.sum() == len(np.unique(ids)):
            return seed
    raise AssertionError("no seed samples every user")


def test_a_user_with_200_identical_examples_moves_the_release_by_at_most_c_over_l():
    users, m = 5, 16  # m examples of the 200 per step (m = 200 traces 200 passes: minutes, same bound)
    released = []
    for heavy in (False, True):
        x, y, ids = light_and_heavy_users(heavy)
        model = dense_model()
        seed = seed_sampling_every_user(ids, users, m)
        before = weights_of(model)
        model.fit(x, y, batch_size=users, user_ids=ids, examples_per_user=m, steps_per_epoch=1, epochs=1,
                  sampling_seed=seed, verbose=0)
        released.append(weights_of(model) - before)
    moved = np.linalg.norm(released[1] - released[0])
    # learning rate 1, σ = 0: the release is −Σ_u clip(g_u)/L_u. Clipping each example would
    # move it by m·C/L_u (by 200·C/L with example-level sampling of all 200); one clip per user
    # bounds it by C/L_u (attained: the user's gradient is far above C).
    assert moved <= CLIP / users * (1 + 1e-5)
    assert moved >= 0.99 * CLIP / users


def test_one_fit_step_is_the_per_user_loop_over_the_sampled_users():
    rng = np.random.default_rng(3)
    n, users, m = 90, 6, 4
    x = (rng.normal(size=(n, 4)) * 4).astype("float32")
    y = rng.integers(0, 3, n)
    ids = np.array([f"user-{i}" for i in rng.integers(0, 20, n)])
    model = dense_model()
    before = weights_of(model)
    expected_model = dense_model()
    model.fit(x, y, batch_size=users, user_ids=ids, examples_per_user=m, steps_per_epoch=1, sampling_seed=21,
              physical_batch_size=4, verbose=0)
    indices, mask = UserPoissonSampler(ids, users, m, physical_batch_size=4, seed=21).batch(0)
    rows, real = indices.reshape(-1, m), mask.reshape(-1)
    assert real.sum() >= 2
    total, _ = per_user_loop(expected_model, x[rows], y[rows], real)
    np.testing.assert_allclose(weights_of(model), before - total / users, rtol=1e-4, atol=1e-6)


def test_epsilon_is_per_user_from_dp_accounting_with_n_the_number_of_users():
    rng = np.random.default_rng(0)
    n, num_users, users, sigma, epochs = 400, 50, 10, 1.1, 2
    x = rng.normal(size=(n, 4)).astype("float32")
    y = rng.integers(0, 3, n)
    ids = rng.permutation(np.arange(n) % num_users)
    model = dense_model(sigma=sigma, learning_rate=0.1)
    model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=CLIP, noise_multiplier=sigma), loss=LOSS, delta=1e-5)
    model.fit(x, y, batch_size=users, user_ids=ids, examples_per_user=2, epochs=epochs, verbose=0)
    steps = epochs * int(np.ceil(num_users / users))  # an epoch is ⌈N_u / L_u⌉ steps
    [phase] = model.privacy_ledger.phases()
    assert (phase.scheme, phase.num_examples, phase.steps) == ("user_poisson", num_users, steps)
    assert model.privacy_report()["unit"] == "user"
    accountant = rdp_privacy_accountant.RdpAccountant(RDP_ORDERS)
    accountant.compose(dp_event.PoissonSampledDpEvent(users / num_users, dp_event.GaussianDpEvent(sigma)), steps)
    want = accountant.get_epsilon(1e-5)
    np.testing.assert_allclose(model.get_epsilon(), want, rtol=1e-3)
    per_example = rdp_privacy_accountant.RdpAccountant(RDP_ORDERS)
    per_example.compose(dp_event.PoissonSampledDpEvent(users / n, dp_event.GaussianDpEvent(sigma)), steps)
    assert per_example.get_epsilon(1e-5) < 0.7 * want  # N = examples would report a far smaller ε


# ----------------------------------------------------------- refusals
def test_user_ids_errors_name_the_argument_and_the_fix():
    x, y, ids = light_and_heavy_users(heavy=True)
    model = dense_model()
    fit = lambda **kw: model.fit(x, y, **{"batch_size": 2, "verbose": 0, **kw})  # noqa: E731
    with pytest.raises(ValueError, match=r"`user_ids` has 204 entries but there are 205 training examples"):
        fit(user_ids=ids[:-1], examples_per_user=2)
    with pytest.raises(ValueError, match="`examples_per_user`"):
        fit(user_ids=ids)
    with pytest.raises(ValueError, match="`examples_per_user` must be a positive integer"):
        fit(user_ids=ids, examples_per_user=0)
    with pytest.raises(TypeError, match="`examples_per_user` must be a positive integer"):
        fit(user_ids=ids, examples_per_user=2.5)
    with pytest.raises(ValueError, match="pass `user_ids`"):
        fit(examples_per_user=2)
    with pytest.raises(ValueError, match=r"exceeds the number of users \(6\)"):
        fit(user_ids=ids, examples_per_user=2, batch_size=7)
    with pytest.raises(ValueError, match="`user_ids` has no id for example 3"):
        fit(user_ids=[0, 1, 2, None] + list(ids[4:]), examples_per_user=2)
    with pytest.raises(ValueError, match="`user_ids` must hold one id per example"):
        fit(user_ids=ids.reshape(5, 41), examples_per_user=2)
    with pytest.raises(ValueError, match="augmentation_multiplicity"):
        fit(user_ids=ids, examples_per_user=2, augmentation_multiplicity=2, augment=lambda x, s: x)
    with pytest.raises(ValueError, match="`class_weight` is not supported with 'user_poisson' sampling"):
        fit(user_ids=ids, examples_per_user=2, class_weight={0: 1.0, 1: 2.0})
    batched = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    with pytest.raises(ValueError, match="user_ids.*batched dataset"):
        model.fit(batched, user_ids=ids, examples_per_user=2, verbose=0)
    with pytest.raises(ValueError, match="user_ids.*train_on_batch"):
        model.train_on_batch(x[:4], y[:4], user_ids=ids[:4])
    assert int(model.privacy_ledger.steps.numpy()) == 0  # nothing was trained


def test_string_and_mixed_ids_are_users_and_examples_per_user_one_is_one_example_per_user_step():
    x, y, _ = light_and_heavy_users(heavy=False)
    model = dense_model()
    model.fit(x, y, batch_size=2, user_ids=["ann", 7, "ann", (1, 2), 7], examples_per_user=1, epochs=1, verbose=0)
    [phase] = model.privacy_ledger.phases()
    assert phase.num_examples == 3 and phase.sampling_rate == pytest.approx(2 / 3)


def test_train_metrics_compare_each_users_first_example_with_its_own_prediction():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(40, 4)).astype("float32")
    ids = np.repeat(np.arange(10), 4)
    y = np.tile([0, 1, 2, 1], 10)  # a user's examples have different labels
    model = dense_model(learning_rate=0.0)
    model.compile(optimizer=tf_dp.DPSGD(0.0, l2_norm_clip=CLIP, noise_multiplier=0.0), loss=LOSS,
                  metrics=["accuracy"])
    history = model.fit(x, y, batch_size=10, user_ids=ids, examples_per_user=4, steps_per_epoch=1, sampling_seed=0,
                        verbose=0).history
    indices, mask = UserPoissonSampler(ids, 10, 4, seed=0).batch(0)  # q = 1: every user
    first = indices.reshape(-1, 4)[mask.reshape(-1) > 0][:, 0]
    predicted = np.argmax(model.predict(x[first], verbose=0), axis=-1)
    np.testing.assert_allclose(history["accuracy"][0], np.mean(predicted == y[first]), atol=1e-6)


# ----------------------------------------------------------- the Shakespeare roles
def test_speeches_are_parsed_by_speaker_and_stage_directions_and_headings_dropped():
    from tf_dp.data.shakespeare import parse_speeches
    text = ("PERSONS REPRESENTED.\nHAMLET, Prince of Denmark.\n\nACT I.\n\nSCENE I. Elsinore.\n\n"
            "Ber.\nWho's there?\n\nFRAN.\nNay, answer me. [Exit.]\nStand.\n\n[Enter Horatio.]\n\n"
            "KING HENRY V. \nOnce more unto the breach.\n")
    assert parse_speeches(text) == [("BER", "Who's there?"), ("FRAN", "Nay, answer me.\nStand."),
                                    ("KING HENRY V", "Once more unto the breach.")]


def test_shakespeare_windows_are_one_roles_next_characters_split_by_role():
    from tf_dp.data import DataPackageNotInstalledError, load_shakespeare
    try:
        data = load_shakespeare(sequence_length=20, plays=["macbeth", "tempest"], test_fraction=0.2)
    except DataPackageNotInstalledError as error:
        pytest.skip(str(error))
    np.testing.assert_array_equal(data.x_train[:, 1:], data.y_train[:, :-1])  # y is x shifted by one
    assert data.x_train.shape[1] == 20 and len(data.users_train) == len(data.x_train)
    assert not set(data.users_train) & set(data.users_test)
    assert {u.split(":")[0] for u in data.users_train} == {"macbeth", "tempest"}
    assert "macbeth:MACBETH" in set(data.users_train) | set(data.users_test)


def test_a_ledger_mixing_user_and_example_level_steps_claims_epsilon_per_example_only():
    """ε per user needs every step user-level: an example-level step protects a user only by
    group privacy over the user's examples. A fit that mixes the units warns, and the report's
    unit falls back to "example"; the ε composed is still dp_accounting's of both phases."""
    rng = np.random.default_rng(3)
    n, num_users, users, sigma = 96, 24, 6, 1.0
    x = rng.normal(size=(n, 4)).astype("float32")
    y = rng.integers(0, 3, n)
    ids = rng.permutation(np.arange(n) % num_users)
    model = dense_model(sigma=sigma, learning_rate=0.1)
    model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=CLIP, noise_multiplier=sigma), loss=LOSS, delta=1e-5)
    model.fit(x, y, batch_size=users, user_ids=ids, examples_per_user=2, epochs=1, verbose=0)
    assert model.privacy_report()["unit"] == "user"
    with pytest.warns(UserWarning, match="holds per EXAMPLE only"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    report = model.privacy_report()
    assert (report["unit"], report["adjacency"]) == ("example", "add/remove one example")
    accountant = rdp_privacy_accountant.RdpAccountant(RDP_ORDERS)
    accountant.compose(dp_event.PoissonSampledDpEvent(users / num_users, dp_event.GaussianDpEvent(sigma)),
                       int(np.ceil(num_users / users)))
    accountant.compose(dp_event.PoissonSampledDpEvent(8 / n, dp_event.GaussianDpEvent(sigma)), int(np.ceil(n / 8)))
    np.testing.assert_allclose(model.get_epsilon(), accountant.get_epsilon(1e-5), rtol=1e-3)
    with pytest.warns(UserWarning, match="user-level but the privacy ledger already holds example-level"):
        model.fit(x, y, batch_size=users, user_ids=ids, examples_per_user=2, epochs=1, verbose=0)
    assert model.privacy_report()["unit"] == "example"
