"""Shared test helpers: the per-example-loop reference (one GradientTape per example), flat
norms, a read-recording source and a small DP classifier. Every test file imports them from here
(`from tests.harness import ...`); tests/conftest.py holds only pytest hooks and fixtures."""

import contextlib

import keras
import numpy as np
import tensorflow as tf


def sparse_ce(y_true, y_pred):
    return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)


def loop_per_example_gradients(model, x, y, loss=sparse_ce):
    """Reference: per-example gradients by a Python loop over single examples."""
    grads = []
    for i in range(len(y)):
        x_i = tf.nest.map_structure(lambda a: a[i : i + 1], x)
        with tf.GradientTape() as tape:
            value = loss(y[i : i + 1], model(x_i, training=True))[0]
        grads.append([tf.convert_to_tensor(g).numpy() for g in tape.gradient(value, model.trainable_variables)])
    return grads


def flat_norms(per_example):
    return np.array([np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads)) for grads in per_example])


class CountingSource:
    """A map-style source over arrays that records every index read."""

    def __init__(self, x, y):
        self.x, self.y, self.reads = x, y, []

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        self.reads.append(int(index))
        return self.x[index], self.y[index]


def small_dp_classifier(features: int, classes: int, sigma: float, engine: str = "ghost"):
    """features → Dense(8, tanh) → Dense(classes), DP-SGD(0.2, C = 0.5, σ, seed 3), weights seeded."""
    import tf_dp

    keras.utils.set_random_seed(0)
    inputs = keras.Input((features,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    model = tf_dp.DPModel(inputs, keras.layers.Dense(classes)(hidden))
    model.compile(optimizer=tf_dp.DPSGD(0.2, l2_norm_clip=0.5, noise_multiplier=sigma, seed=3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), clipping_engine=engine)
    return model


@contextlib.contextmanager
def reference_steps(*models):
    """Test only: lets ``model.train_step`` run outside ``fit``/``train_on_batch`` for the block,
    as a REFERENCE computation (the one-device or hand-fed twin a fit is compared with, a step
    fed a hand-made batch). tf_dp refuses such steps of a user's own loop
    (tf_dp.models.step.StepDoor; tests/models/test_phase_closed.py); this opens that door by hand."""
    doors = [model._step_door for model in models]
    previous = [(door.phase_open, door.executing) for door in doors]
    for door in doors:
        door.phase_open = door.executing = True
    try:
        with contextlib.ExitStack() as windows:  # and the optimizers' drawing windows (drawing_noise)
            for model in models:
                if hasattr(getattr(model, "optimizer", None), "drawing_window"):
                    windows.enter_context(model.optimizer.drawing_window())
            yield
    finally:
        for door, (phase_open, executing) in zip(doors, previous):
            door.phase_open, door.executing = phase_open, executing


@contextlib.contextmanager
def drawing_noise(*optimizers):
    """Test only: opens the optimizers' drawing windows for the block, so that a test may call
    ``apply_private_gradients`` directly on hand-made clipped sums (a REFERENCE computation of
    the mechanism). tf_dp refuses such a call outside a model's train function
    (tests/optimizers/test_direct_release_refused.py)."""
    with contextlib.ExitStack() as stack:
        for optimizer in optimizers:
            stack.enter_context(optimizer.drawing_window())
        yield
