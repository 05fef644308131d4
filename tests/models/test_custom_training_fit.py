"""Users' own training logic under ``fit`` (tf_dp.models.custom_step):

* ``private_update`` with the plan's views (docs/algorithms.md §8, §11): a train step of one's
  own under ``fit(augment=, augmentation_multiplicity=K)`` or user-level sampling averages each
  unit's views of its per-example objective before clipping, exactly as the built-in step;
* ``fit(x)`` without targets for a model whose own ``compute_loss`` reads none (a VAE).

Each update at σ = 0 is compared with a per-example (per-user) GradientTape loop over the
batch the sampler drew (rebuilt from the same seed)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.models.test_augmentation_multiplicity import loop_reference, shift
from tests.models.test_custom_training import VAE
from tests.sampling.test_user_level import CLIP as USER_CLIP, per_user_loop, weights_of
from tf_dp.models.data import poisson_dataset
from tf_dp.sampling import UserPoissonSampler
from tf_dp.sampling.sources import ArraySource

AUGMENT_CLIP = 0.7  # test_augmentation_multiplicity's C


class OwnStep(tf_dp.DPModel):
    """A train step of one's own: the cross-entropy of each example through private_update."""

    def objective(self, x, y):
        return keras.losses.sparse_categorical_crossentropy(y, self(x, training=True), from_logits=True)

    def train_step(self, data):
        return self.private_update(self.objective, data)


def _own_cnn():
    keras.utils.set_random_seed(0)  # the weights of test_augmentation_multiplicity.cnn()
    inputs = keras.Input((6, 6, 2))
    h = keras.layers.Conv2D(3, 3, activation="tanh")(inputs)
    h = keras.layers.LayerNormalization()(h)
    model = OwnStep(inputs, keras.layers.Dense(4)(keras.layers.Flatten()(h)))
    model.compile(optimizer=tf_dp.DPSGD(0.5, l2_norm_clip=AUGMENT_CLIP, noise_multiplier=0.0, seed=1))
    return model


def test_private_update_averages_the_augmented_views_before_clipping():
    """K = 3 views by ``augment``: the update is Σ_i clip((1/K) Σ_k ∇term(x_i^(k))) / L (old
    code: fit refused augmentation_multiplicity for a train step of one's own)."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(40, 6, 6, 2)).astype("float32")
    y = rng.integers(0, 4, 40).astype("int32")
    model = _own_cnn()
    reference = _own_cnn()
    model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=1, sampling_seed=3, verbose=0, augment=shift,
              augmentation_multiplicity=3)
    element = next(iter(poisson_dataset(x, y, 40, 8, None, seed=3, augment=shift, views=3, augment_seed=3)))
    mask = element["mask"].numpy().reshape(-1)
    views = element["x"].numpy().reshape(-1, 3, 6, 6, 2)
    assert mask.sum() >= 2
    sums, _ = loop_reference(reference, views, element["y"].numpy().reshape(-1), mask, 3)
    for w, got, g in zip(reference.get_weights(), model.get_weights(), sums):
        np.testing.assert_allclose(got, w - 0.5 * g / 8, rtol=1e-4, atol=1e-5)
    assert int(model.privacy_ledger.steps.numpy()) == 1


def _own_dense():
    keras.utils.set_random_seed(0)  # the weights of test_user_level.dense_model()
    inputs = keras.Input((4,))
    h = keras.layers.Dense(6, activation="tanh")(inputs)
    model = OwnStep(inputs, keras.layers.Dense(3)(h))
    model.compile(optimizer=tf_dp.DPSGD(1.0, l2_norm_clip=USER_CLIP, noise_multiplier=0.0, seed=1), delta=1e-5)
    return model


def test_private_update_clips_each_users_mean_term_once():
    """User-level sampling: each sampled user's m examples, each with its own label, averaged
    and clipped once (old code: fit refused user-level sampling for a train step of one's own)."""
    rng = np.random.default_rng(3)
    n, users, m = 90, 6, 4
    x = (rng.normal(size=(n, 4)) * 4).astype("float32")
    y = rng.integers(0, 3, n)
    ids = np.array([f"user-{i}" for i in rng.integers(0, 20, n)])
    model, reference = _own_dense(), _own_dense()
    before = weights_of(model)
    model.fit(x, y, batch_size=users, user_ids=ids, examples_per_user=m, steps_per_epoch=1, sampling_seed=21,
              physical_batch_size=4, verbose=0)
    indices, mask = UserPoissonSampler(ids, users, m, physical_batch_size=4, seed=21).batch(0)
    rows, real = indices.reshape(-1, m), mask.reshape(-1)
    assert real.sum() >= 2
    total, _ = per_user_loop(reference, x[rows], y[rows], real)
    np.testing.assert_allclose(weights_of(model), before - total / users, rtol=1e-4, atol=1e-6)
    assert model.privacy_report()["unit"] == "user"


class LatentStep(OwnStep):
    """A per-example latent (a GAN discriminator's generator input) under K views: one draw per view."""

    def objective(self, x, y, latent):
        return super().objective(x, y) + 0.0 * tf.reduce_sum(latent, axis=-1)

    def train_step(self, data):
        return self.private_update(self.objective, data, latent_shape=(2,))


def test_private_update_with_a_latent_and_views_trains():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(24, 6, 6, 2)).astype("float32")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 6, 2))
    model = LatentStep(inputs, keras.layers.Dense(4)(keras.layers.Flatten()(inputs)))
    model.compile(optimizer=tf_dp.DPSGD(0.5, l2_norm_clip=AUGMENT_CLIP, noise_multiplier=0.0, seed=1))
    model.fit(x, rng.integers(0, 4, 24), batch_size=8, epochs=1, verbose=0, augment=shift,
              augmentation_multiplicity=2)
    assert int(model.privacy_ledger.steps.numpy()) == 3


# ------------------------------------------------------------- fit(x) without y
class AutoEncoder(VAE):
    """test_custom_training's VAE (its compute_loss: reconstruction + KL per example, reading
    x and no y) without the sampling draw, z = z_mean, so a loop can replay the step."""

    def call(self, x):
        z_mean, z_log_var = self.encoder(x)
        return z_mean, z_log_var, self.decoder(z_mean)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        assert y is None  # fit(x): Keras hands compute_loss y=None
        return super().compute_loss(x, y, y_pred, sample_weight, training)


def _autoencoder():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(5, activation="tanh")(inputs)
    encoder = keras.Model(inputs, [keras.layers.Dense(2)(hidden), keras.layers.Dense(2)(hidden)])
    decoder = keras.Sequential([keras.Input((2,)), keras.layers.Dense(6, activation="sigmoid")])
    model = AutoEncoder(encoder, decoder)
    model.compile(tf_dp.DPSGD(0.5, l2_norm_clip=0.3, noise_multiplier=0.0, seed=1))
    return model


def test_fit_x_without_y_trains_a_compute_loss_that_reads_no_targets():
    """``fit(x)`` (old code: "DP fit needs both `x` and `y`") takes the step a per-example
    loop of the user's compute_loss computes on the batch the sampler drew."""
    x = np.random.default_rng(1).uniform(size=(40, 6)).astype("float32")
    model, reference = _autoencoder(), _autoencoder()
    before = [v.numpy() for v in reference.trainable_variables]
    model.fit(x, batch_size=8, epochs=1, steps_per_epoch=1, sampling_seed=5, verbose=0)
    element = next(iter(poisson_dataset(None, None, 40, 8, None, seed=5,
                                        source=ArraySource(x, None, targets_optional=True))))
    assert element["y"] == ()  # the loader carries no targets
    mask = element["mask"].numpy().reshape(-1)
    rows = element["x"].numpy().reshape(-1, 6)[mask == 1]
    assert len(rows) >= 2
    total = [np.zeros(v.shape, np.float64) for v in reference.trainable_variables]
    for row in rows:
        with tf.GradientTape() as tape:
            loss = reference.compute_loss(row[None], None, reference(row[None]))[0]
        grads = [np.asarray(g, np.float64) for g in tape.gradient(loss, reference.trainable_variables)]
        factor = min(1.0, 0.3 / np.sqrt(sum(np.sum(g ** 2) for g in grads)))
        total = [t + factor * g for t, g in zip(total, grads)]
    for variable, start, t in zip(model.trainable_variables, before, total):
        np.testing.assert_allclose(variable.numpy(), start - 0.5 * t / 8, rtol=1e-4, atol=1e-6)
    assert int(model.privacy_ledger.steps.numpy()) == 1
    history = model.fit(x, batch_size=8, epochs=1, validation_split=0.25, verbose=0).history  # x alone validates
    assert np.isfinite(history["val_loss"][0])


def test_fit_x_without_y_is_still_refused_for_a_compiled_loss():
    inputs = keras.Input((6,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(6)(inputs))
    model.compile(tf_dp.DPSGD(0.5, l2_norm_clip=0.3, noise_multiplier=0.0), loss="mse")
    with pytest.raises(ValueError, match="needs both `x` and `y`"):
        model.fit(np.zeros((16, 6), "float32"), batch_size=4, epochs=1, verbose=0)
    assert int(model.privacy_ledger.steps.numpy()) == 0
