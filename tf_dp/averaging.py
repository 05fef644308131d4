"""Parameter averaging (docs/algorithms.md §9): evaluate and export an exponential moving average
of the iterates, keep training the iterates themselves.

    θ̄_t = β θ̄_{t−1} + (1 − β) θ_t     for t > s,      θ̄_t = θ_t for t ≤ max(s, 1),

with β the momentum and s the step the average starts at. θ̄ is a function of the released
iterates only, so it is post-processing: it costs no privacy and the ledger is untouched.

The average itself is Keras' optimizer EMA, which every tf_dp optimizer accepts — it is
updated inside the compiled train step after each update (so every step counts, whatever
``steps_per_execution``), lives in the optimizer's variables (saved in ``.keras`` files
and checkpoints) and works under tf.distribute::

    optimizer = tf_dp.DPSGD(0.5, noise_multiplier=1.1, use_ema=True, ema_momentum=0.999)
    model.compile(optimizer=optimizer, loss=...)
    model.fit(x, y, validation_data=..., callbacks=[tf_dp.ParameterAveraging(start_step=500)])
    model.evaluate(x_test, y_test)        # θ̄: fit ended with the average in the model

What Keras lacks, ``ParameterAveraging`` adds: the average starts at ``start_step``;
validation, ``evaluate`` and ``predict`` run on θ̄ and training resumes on θ exactly (Keras'
``SwapEMAWeights`` swaps by adding and subtracting, which rounds θ); at the end of ``fit``
the model holds θ̄ while θ is kept, so a later ``fit`` with the same callback continues from
θ (Keras' own end-of-fit overwrite loses θ). ``averaged_weights(model)`` swaps θ̄ in for a
``with`` block.
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import tensorflow as tf

from tf_dp import _checks


def averaged_pairs(model) -> list:
    """(model variable, its average θ̄) for every averaged trainable variable."""
    optimizer = _averaging_optimizer(model)
    return [(v, a) for v, a in zip(optimizer._trainable_variables, optimizer._model_variables_moving_average)
            if a is not None]


@contextlib.contextmanager
def averaged_weights(model):
    """``with averaged_weights(model): model.evaluate(...)`` runs on θ̄; the weights the model
    had before (θ) are restored exactly afterwards."""
    pairs = averaged_pairs(model)
    saved = [np.array(v.numpy()) for v, _ in pairs]
    _copy([(a, v) for v, a in pairs])
    try:
        yield model
    finally:
        for (variable, _), value in zip(pairs, saved):
            variable.assign(value)


class ParameterAveraging(keras.callbacks.Callback):
    """Evaluates on θ̄, trains on θ, ends ``fit`` with θ̄ in the model (module docstring).

    Needs the optimizer built with ``use_ema=True, ema_momentum=β`` (β = 0.999 is a
    common choice for long DP runs; the average spans ~1/(1 − β) steps), and no
    ``ema_overwrite_frequency`` (that would train on θ̄).

    Args:
      start_step: s: up to optimizer step s the average is the iterate itself, θ̄_t = θ_t;
        from there on it is the EMA. Skipping the first, far-from-optimal iterates matters
        when 1/(1 − β) is a sizeable part of the run. With ``steps_per_execution = k`` the
        start is rounded up to the end of the execution holding step s.
      swap_at_end: leave θ̄ in the model when ``fit`` ends (to evaluate and export it);
        θ is kept by the callback and restored when it sees the next ``fit``. False leaves
        θ in the model; use ``averaged_weights`` then.
    """

    def __init__(self, start_step: int = 0, swap_at_end: bool = True):
        super().__init__()
        self.start_step = _checks.non_negative("start_step", start_step)
        if not float(self.start_step).is_integer():
            raise ValueError(f"`start_step` must be a whole number of steps, got {start_step}.")
        self.start_step = int(self.start_step)
        self.swap_at_end = _checks.boolean("swap_at_end", swap_at_end)
        self._iterates = None  # θ, kept while θ̄ is in the model
        self._average_in_model = False  # θ̄ left in the model by the end of fit
        self._swapped = False  # θ̄ swapped in for an evaluation or prediction
        self._started = False  # the optimizer has passed start_step

    # -- training: θ in the model --
    def on_train_begin(self, logs=None):
        _check_optimizer(self.model.optimizer)
        self._started = False
        if self._average_in_model:
            pairs = averaged_pairs(self.model)
            if _holds_averages(pairs):  # the model still holds the θ̄ this callback left
                self._put_iterates_back(pairs)
            self._average_in_model = False

    def on_train_batch_end(self, batch, logs=None):
        if self._started:
            return
        if int(self.model.optimizer.iterations.numpy()) <= self.start_step:
            _copy(averaged_pairs(self.model))  # θ̄_t = θ_t until the average starts
        else:
            self._started = True

    def on_epoch_end(self, epoch, logs=None):
        # Keras' fit overwrites θ with θ̄ right after the last epoch: keep θ now.
        self._keep_iterates(averaged_pairs(self.model))

    def on_train_end(self, logs=None):
        pairs = averaged_pairs(self.model)
        if self._iterates is None:
            return
        if self.swap_at_end:
            _copy([(a, v) for v, a in pairs])
            self._average_in_model = True
        else:
            self._put_iterates_back(pairs)

    # -- evaluation and prediction: θ̄ in the model --
    def on_test_begin(self, logs=None):
        self._swap_average_in()

    def on_test_end(self, logs=None):
        self._swap_iterates_back()

    def on_predict_begin(self, logs=None):
        self._swap_average_in()

    def on_predict_end(self, logs=None):
        self._swap_iterates_back()

    def _swap_average_in(self):
        if self._average_in_model:
            return
        pairs = averaged_pairs(self.model)
        self._keep_iterates(pairs)
        _copy([(a, v) for v, a in pairs])
        self._swapped = True

    def _swap_iterates_back(self):
        if self._swapped:
            self._put_iterates_back(averaged_pairs(self.model))
            self._swapped = False

    # -- θ kept in variables of the callback (exact copies) --
    def _keep_iterates(self, pairs):
        if self._iterates is None:
            with self.model.distribute_strategy.scope():
                self._iterates = [tf.Variable(tf.zeros_like(v.value), trainable=False) for v, _ in pairs]
        _copy([(v, kept) for (v, _), kept in zip(pairs, self._iterates)])

    def _put_iterates_back(self, pairs):
        _copy([(kept, v) for (v, _), kept in zip(pairs, self._iterates)])


def _averaging_optimizer(model):
    optimizer = _check_optimizer(model.optimizer)
    if not optimizer.built:
        raise ValueError("The optimizer is not built yet: call fit (or build the model and optimizer) first.")
    return optimizer


def _check_optimizer(optimizer):
    if optimizer is None or not getattr(optimizer, "use_ema", False):
        raise ValueError(
            "Parameter averaging keeps θ̄ in the optimizer: build it with `use_ema=True, ema_momentum=0.999` "
            "(any tf_dp optimizer accepts them), e.g. tf_dp.DPSGD(0.5, noise_multiplier=1.1, use_ema=True, "
            "ema_momentum=0.999)."
        )
    if optimizer.ema_overwrite_frequency:
        raise ValueError(
            f"`ema_overwrite_frequency={optimizer.ema_overwrite_frequency}` overwrites the iterates θ with θ̄ "
            "during training; parameter averaging trains on θ and evaluates θ̄. Leave it None."
        )
    return optimizer


def _copy(pairs):
    """target ← source for every (source, target), exactly (on every replica)."""
    for source, target in pairs:
        target.assign(source.value if isinstance(source, keras.Variable) else source)


def _holds_averages(pairs) -> bool:
    return all(np.array_equal(v.numpy(), a.numpy()) for v, a in pairs)
