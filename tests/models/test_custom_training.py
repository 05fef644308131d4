"""Users' own DP training logic (tf_dp.models.custom_step, docs/guides/keras-models.md#your-own-training-logic):
keras.io's Distiller and VAE as ``compute_loss`` returning one loss per example, a GAN whose
own ``train_step`` calls ``private_update`` with a second (plain) optimizer, and the refusals.
Each update at σ = 0 is compared with an independent per-example computation: the clipped
gradients of the user's objective, one per example (a loop or the jacobian of the vector of
per-example terms of one batched pass), summed and divided by L."""

import numpy as np
import pytest
import keras
import tensorflow as tf
from keras import ops

import tf_dp

CLIP, RATE, L = 0.3, 0.5, 8


def _mlp(seed, inputs, outputs):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((inputs,)), keras.layers.Dense(6, activation="tanh"),
                             keras.layers.Dense(outputs)])


def _values(variables):
    return [np.array(v.numpy()) for v in variables]


def _clipped_mean_update(before, per_example_grads):
    """θ − RATE · (Σ_i min(1, C/‖g_i‖) g_i) / L: DP-SGD at σ = 0, from per-example gradients."""
    total = [np.zeros_like(b) for b in before]
    for grads in per_example_grads:
        norm = np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in grads))
        factor = min(1.0, CLIP / norm)
        total = [t + factor * g for t, g in zip(total, grads)]
    return [b - RATE * t / L for b, t in zip(before, total)]


def _jacobian_rows(losses_fn, variables):
    """Per-example gradients of the [L] vector ``losses_fn()`` by one jacobian per variable."""
    with tf.GradientTape(persistent=True) as tape:
        losses = losses_fn()
    jacobians = [tape.jacobian(losses, v).numpy() for v in variables]
    return [[j[i] for j in jacobians] for i in range(L)]


def _assert_close(after, expected):
    assert max(np.max(np.abs(a - e)) for a, e in zip(after, expected)) < 1e-5


def _dpsgd(noise_multiplier=0.0):
    return tf_dp.DPSGD(RATE, l2_norm_clip=CLIP, noise_multiplier=noise_multiplier)


# ----------------------------------------------------------------- Distiller
class Distiller(tf_dp.DPModel):
    """keras.io's knowledge distillation, as written in Keras 3 but for reduction=None."""

    def __init__(self, student, teacher):
        super().__init__()
        self.teacher, self.student = teacher, student

    def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha=0.1, temperature=3, **kwargs):
        super().compile(optimizer=optimizer, metrics=metrics, **kwargs)
        self.student_loss_fn, self.distillation_loss_fn = student_loss_fn, distillation_loss_fn
        self.alpha, self.temperature = alpha, temperature

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        teacher_pred = self.teacher(x, training=False)
        student_loss = self.student_loss_fn(y, y_pred)
        distillation_loss = self.distillation_loss_fn(
            ops.softmax(teacher_pred / self.temperature, axis=1),
            ops.softmax(y_pred / self.temperature, axis=1)) * (self.temperature ** 2)
        return self.alpha * student_loss + (1 - self.alpha) * distillation_loss

    def call(self, x):
        return self.student(x)


def _distiller(**kwargs):
    teacher, student = _mlp(1, 5, 3), _mlp(2, 5, 3)
    teacher.trainable = False
    model = Distiller(student=student, teacher=teacher)  # keywords: what old code's __new__ let through
    model.compile(_dpsgd(), ["accuracy"], keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None),
                  keras.losses.KLDivergence(reduction=None), **kwargs)
    return model


def _data(rows=48, features=5, classes=3):
    rng = np.random.default_rng(0)
    return rng.normal(size=(rows, features)).astype("float32"), rng.integers(0, classes, rows)


def test_distiller_trains_on_its_compute_loss_per_example():
    """The update is the clipped per-example gradients of the user's compute_loss (on the
    old code compile refused the missing `loss`, and a given loss was trained instead)."""
    model, (x, y) = _distiller(), _data()
    before = _values(model.trainable_variables)
    model.train_on_batch(x[:L], y[:L], batch_size=L)
    after = _values(model.trainable_variables)
    for variable, value in zip(model.trainable_variables, before):
        variable.assign(value)
    grads = []
    for i in range(L):
        with tf.GradientTape() as tape:
            loss = model.compute_loss(x[i:i + 1], y[i:i + 1], model.student(x[i:i + 1]))[0]
        grads.append([g.numpy() for g in tape.gradient(loss, model.trainable_variables)])
    _assert_close(after, _clipped_mean_update(before, grads))
    assert int(model.privacy_ledger.steps.numpy()) == 1
    history = model.fit(x, y, batch_size=L, epochs=1, verbose=0).history  # Poisson batches
    assert np.isfinite(history["loss"][0]) and int(model.privacy_ledger.steps.numpy()) == 1 + len(x) // L
    assert np.isfinite(model.evaluate(x, y, verbose=0, return_dict=True)["loss"])


class ScalarDistiller(Distiller):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        return ops.mean(super().compute_loss(x, y, y_pred, sample_weight))


def test_a_scalar_compute_loss_is_refused_with_the_fix():
    """keras.io's batch-mean return has no per-example gradient (old code: silently ignored)."""
    teacher, student = _mlp(1, 5, 3), _mlp(2, 5, 3)
    model = ScalarDistiller(student=student, teacher=teacher)
    model.compile(_dpsgd(), [], keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None),
                  keras.losses.KLDivergence(reduction=None), loss="mse")
    x, y = _data()
    with pytest.raises(ValueError, match=r"compute_loss returned shape \[\].*ONE loss per example.*\[batch\]"):
        model.train_on_batch(x[:L], y[:L], batch_size=L)


class MixingDistiller(Distiller):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        losses = super().compute_loss(x, y, y_pred, sample_weight)
        return losses - ops.mean(losses) + ops.max(losses)  # every row reads the batch


def test_a_compute_loss_that_mixes_rows_is_refused():
    """The row-independence probe runs on the user's compute_loss (old code: ignored it)."""
    teacher, student = _mlp(1, 5, 3), _mlp(2, 5, 3)
    model = MixingDistiller(student=student, teacher=teacher)
    model.compile(_dpsgd(), [], keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None),
                  keras.losses.KLDivergence(reduction=None), loss="mse")
    x, y = _data()
    with pytest.raises(ValueError, match="mixes examples"):
        model.train_on_batch(x[:L], y[:L], batch_size=L)


# ----------------------------------------------------------------------- VAE
class Sampling(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        epsilon = keras.random.normal(shape=ops.shape(z_mean), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


class VAE(tf_dp.DPModel):
    """keras.io's VAE with its loss as compute_loss, reconstruction and KL terms per example."""

    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder, self.decoder = encoder, decoder

    def call(self, x):
        z_mean, z_log_var, z = self.encoder(x)
        return z_mean, z_log_var, self.decoder(z)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        z_mean, z_log_var, reconstruction = y_pred
        reconstruction_loss = ops.sum(keras.losses.binary_crossentropy(x[..., None], reconstruction[..., None]),
                                      axis=1)
        kl_loss = -0.5 * ops.sum(1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var), axis=1)
        return reconstruction_loss + kl_loss


def _vae():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(5, activation="relu")(inputs)
    z_mean, z_log_var = keras.layers.Dense(2)(hidden), keras.layers.Dense(2)(hidden)
    encoder = keras.Model(inputs, [z_mean, z_log_var, Sampling()([z_mean, z_log_var])])
    decoder = keras.Sequential([keras.Input((2,)), keras.layers.Dense(6, activation="sigmoid")])
    return VAE(encoder, decoder)


def test_dp_model_with_two_sub_models_is_not_taken_as_functional():
    """``VAE(encoder, decoder)``: two positional arguments that are not Keras tensors (old
    code: DPModel.__new__ took them as (inputs, outputs) and Functional.__init__ failed)."""
    model = _vae()
    assert not isinstance(model, keras.src.models.functional.Functional)
    assert len(model.trainable_variables) == 8


def test_vae_trains_on_its_per_example_kl_and_reconstruction():
    model = _vae()
    model.compile(_dpsgd())
    x = np.random.default_rng(1).uniform(size=(32, 6)).astype("float32")
    seeds = model.encoder.layers[-1].seed_generator
    model(x[:2])
    state = seeds.state.numpy().copy()
    before = _values(model.trainable_variables)
    model.train_on_batch(x[:L], x[:L], batch_size=L)
    after = _values(model.trainable_variables)
    for variable, value in zip(model.trainable_variables, before):
        variable.assign(value)
    seeds.state.assign(state)  # the step's ε draws, replayed
    grads = _jacobian_rows(lambda: model.compute_loss(x[:L], None, model(x[:L])), model.trainable_variables)
    _assert_close(after, _clipped_mean_update(before, grads))


# ----------------------------------------------------------------------- GAN
class GAN(tf_dp.DPModel):
    """keras.io's GAN step: the discriminator by ``private_update`` with the compiled DP
    optimizer, the generator by a plain optimizer from values that never read ``data``."""

    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator, self.generator, self.latent_dim = discriminator, generator, latent_dim
        self.seed_generator = keras.random.SeedGenerator(7)

    def compile(self, d_optimizer, g_optimizer):
        super().compile(optimizer=d_optimizer)
        self.g_optimizer = g_optimizer

    def call(self, x):
        return self.discriminator(x)

    def d_loss(self, real, unused_y, latent):
        real_logits, fake_logits = self.discriminator(real), self.discriminator(self.generator(latent))
        bce = keras.losses.binary_crossentropy
        return (bce(ops.ones_like(real_logits), real_logits, from_logits=True)
                + bce(ops.zeros_like(fake_logits), fake_logits, from_logits=True))

    def train_step(self, data):
        logs = self.private_update(self.d_loss, data, trains=self.discriminator, latent_shape=(self.latent_dim,))
        noise = keras.random.normal((L, self.latent_dim), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            fake_logits = self.discriminator(self.generator(noise))
            g_loss = ops.mean(keras.losses.binary_crossentropy(ops.ones_like(fake_logits), fake_logits,
                                                               from_logits=True))
        grads = tape.gradient(g_loss, self.generator.trainable_variables)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_variables))
        return {**logs, "g_loss": g_loss}


def _gan():
    model = GAN(_mlp(4, 4, 1), _mlp(5, 3, 4), 3)
    model.compile(_dpsgd(), keras.optimizers.SGD(0.1))
    return model


def test_gan_step_with_two_optimizers_through_private_update():
    model, x = _gan(), _data(features=4)[0]
    latent_seeds = model._latent_seeds()
    state = latent_seeds.state.numpy().copy()
    d_before, g_before = _values(model.discriminator.trainable_variables), _values(model.generator.trainable_variables)
    logs = model.train_on_batch(x[:L], np.zeros(L), batch_size=L, return_dict=True)
    d_after, g_after = _values(model.discriminator.trainable_variables), _values(model.generator.trainable_variables)
    assert int(model.privacy_ledger.steps.numpy()) == 1 and set(logs) >= {"loss", "g_loss", "nonfinite_examples"}
    assert max(np.max(np.abs(a - b)) for a, b in zip(g_after, g_before)) > 0  # the generator trained too
    for variable, value in zip(model.trainable_variables, d_before + g_before):
        variable.assign(value)
    latent_seeds.state.assign(state)
    latent = keras.random.normal((1, L, 3), seed=latent_seeds)[0]
    grads = _jacobian_rows(lambda: model.d_loss(x[:L], None, latent), model.discriminator.trainable_variables)
    _assert_close(d_after, _clipped_mean_update(d_before, grads))
    model.fit(x, np.zeros(len(x)), batch_size=L, epochs=1, verbose=0)  # Poisson batches
    assert int(model.privacy_ledger.steps.numpy()) == 1 + len(x) // L


class TwiceGAN(GAN):
    def train_step(self, data):
        self.private_update(self.d_loss, data, trains=self.discriminator, latent_shape=(self.latent_dim,))
        return self.private_update(self.d_loss, data, trains=self.discriminator, latent_shape=(self.latent_dim,))


def test_two_private_updates_in_one_step_are_refused():
    """Two releases of one batch are one mechanism at σ/√2, not two steps at σ."""
    model = TwiceGAN(_mlp(4, 4, 1), _mlp(5, 3, 4), 3)
    model.compile(_dpsgd(), keras.optimizers.SGD(0.1))
    x = _data(features=4)[0]
    with pytest.raises(RuntimeError, match="twice in one train step"):
        model.train_on_batch(x[:L], np.zeros(L), batch_size=L)
    assert int(model.privacy_ledger.steps.numpy()) == 0


class RawGradientModel(tf_dp.DPModel):
    def train_step(self, data):
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            loss = ops.mean(ops.square(self(x) - y))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


def test_raw_gradients_are_refused_naming_private_update():
    inputs = keras.Input((4,))
    model = RawGradientModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(_dpsgd(), loss="mse")
    x = _data(features=4)[0]
    with pytest.raises(TypeError, match=r"self\.private_update\(per_example_loss, data\)"):
        model.train_on_batch(x[:L], np.zeros((L, 1), "float32"), batch_size=L)


# -------------------------------------------------------------- make_private
class OwnStep(keras.Model):
    def train_step(self, data):
        return super().train_step(data)


class OwnLoss(keras.Model):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return super().compute_loss(x, y, y_pred, sample_weight, training)


@pytest.mark.parametrize("cls, method", [(OwnStep, "train_step"), (OwnLoss, "compute_loss")])
def test_make_private_refuses_a_model_with_its_own_training_logic(cls, method):
    """Old code returned a DPModel that silently ran tf_dp's step instead."""
    inputs = keras.Input((4,))
    with pytest.raises(TypeError, match=rf"{method}.*subclass tf_dp\.DPModel.*private_update"):
        tf_dp.make_private(cls(inputs, keras.layers.Dense(1)(inputs)))


class MixingGAN(GAN):
    def d_loss(self, real, unused_y, latent):
        losses = super().d_loss(real, unused_y, latent)
        return losses + ops.mean(losses)  # every example's term reads the batch


def test_a_private_update_objective_that_mixes_rows_is_refused():
    """The row-independence probe runs on private_update's objective, before any release."""
    model = MixingGAN(_mlp(4, 4, 1), _mlp(5, 3, 4), 3)
    model.compile(_dpsgd(), keras.optimizers.SGD(0.1))
    x = _data(features=4)[0]
    with pytest.raises(ValueError, match="mixes examples"):
        model.train_on_batch(x[:L], np.zeros(L), batch_size=L)
    assert int(model.privacy_ledger.steps.numpy()) == 0
