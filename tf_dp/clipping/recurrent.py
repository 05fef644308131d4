"""Ghost rule for Keras' recurrent layers: LSTM, GRU, SimpleRNN (and Bidirectional ones).

A recurrent cell applies its kernel W (input → gates), recurrent kernel U (h_{t-1} → gates)
and bias b as Dense maps at every step: with the pre-activations z_t = x_t W + h_{t-1} U + b
and s_t = ∂ℓ/∂z_t (docs/algorithms.md §6),

    ∂ℓ_i/∂W = Σ_t x_itᵀ s_it,   ∂ℓ_i/∂U = Σ_t h_{i,t-1}ᵀ s_it,   ∂ℓ_i/∂b = Σ_t s_it,

the sequence form of the Dense rule, computed by dense.py's certified DenseContribution.

The tapped call computes zx = x W + b for the whole sequence outside the loop (a watched
tensor: its gradient is s, since z_t = zx_t + h_{t-1} U) and runs the recurrence with
Keras' own ``backend.rnn`` (masking, go_backwards, unroll, zero_output_for_mask exactly as
Keras; a while loop XLA compiles), its steps also emitting h_{t-1} (and GRU's reset gate r_t).
GRU: reset_after=True has a recurrent bias and s^h_t = [s^z_t, s^r_t, r_t ⊙ s^h̃_t] for U
and that bias; reset_after=False feeds r_t ⊙ h_{t-1} to U's candidate columns.

Anything else — another cell class, stateful layers, dropout or recurrent dropout in
training (random masks), frozen cell weights, a non-sequence input — falls back to the
exact per-example replay (layer_per_example.py).
"""

from __future__ import annotations

import inspect

import keras
import tensorflow as tf
from keras.src import backend as keras_backend

from tf_dp.clipping.dense import dense_contribution
from tf_dp.clipping.registry import Contribution, GhostRule, Recording, register_ghost_rule

_LAYERS = (keras.layers.LSTM, keras.layers.GRU, keras.layers.SimpleRNN, keras.layers.RNN)  # exact classes: a
# subclass may override inner_loop or get_initial_state, which the rule does not model


def _kind(cell) -> str:
    """'lstm', 'gru' or 'simple' for the exact Keras cell classes, else ''."""
    names = {keras.layers.LSTMCell: "lstm", keras.layers.GRUCell: "gru", keras.layers.SimpleRNNCell: "simple"}
    return names.get(type(cell), "")


def _activate(activation, value):
    return value if activation is None else activation(value)


class RecurrentRecording(Recording):
    """A recording whose per-example replay is the rule's linearised form (``_linearized``).

    The tap gives every rule recording a replay returning its watched tensors; for this rule
    the watched zx depends on W and b only, so a replay of zx alone would miss U's gradient.
    The tap's assignment is therefore ignored and the replay returns zx + h_{t-1} U (h_{t-1}
    held fixed), whose vector-Jacobian product with s is the exact per-example gradient."""

    @property
    def replay(self):
        return self._linearized_replay

    @replay.setter
    def replay(self, _value):
        pass


class RecurrentContribution(Contribution):
    """Dense contributions of the kernel, recurrent kernel and bias blocks; their squared
    norms add up and ``assemble`` puts their sums back into the cell's variable shapes."""

    def __init__(self, parts: list, assemble):
        self.parts, self.assemble = parts, assemble

    def squared_norms(self):
        return tf.add_n([part.squared_norms() for part in self.parts])

    def weighted_sums(self, clip_factors):
        return self.assemble([s for part in self.parts for s in part.weighted_sums(clip_factors)])


class RecurrentRule(GhostRule):
    """LSTM, GRU (both reset_after, both implementations) and SimpleRNN layers, and
    ``keras.layers.RNN`` over one of their cells."""

    def applies_to(self, layer) -> bool:
        cell = getattr(layer, "cell", None)
        if type(layer) not in _LAYERS or not _kind(cell) or getattr(layer, "stateful", False):
            return False
        if not getattr(cell, "built", False):
            return False
        return all(v.trainable for v in cell._trainable_variables) and len(cell._trainable_variables) == len(
            self.variables(layer))

    def accepts_call(self, layer, args, kwargs) -> bool:
        try:
            bound = inspect.signature(self.tapped_call).bind(layer, None, None, *args, **kwargs)
        except TypeError:
            return False
        sequences, training = bound.arguments.get("sequences"), bound.arguments.get("training", False)
        if not tf.is_tensor(sequences) or sequences.shape.rank != 3:
            return False
        random_masks = layer.cell.dropout > 0 or layer.cell.recurrent_dropout > 0
        return not (random_masks and training is not False and training is not None)

    def variables(self, layer):
        cell = layer.cell
        return [cell.kernel, cell.recurrent_kernel] + ([cell.bias] if cell.use_bias else [])

    def tapped_call(self, layer, original_call, recordings, sequences, initial_state=None, mask=None,
                    training=False):
        cell, kind = layer.cell, _kind(layer.cell)
        x = tf.cast(sequences, cell.compute_dtype)
        zx = keras.ops.matmul(x, cell.kernel)
        if cell.use_bias:
            zx = zx + (cell.bias[0] if kind == "gru" and cell.reset_after else cell.bias)
        states = _initial_states(layer, x, initial_state)
        if tf.nest.is_nested(mask):
            mask = tf.nest.flatten(mask)[0]
        last, outputs, final_states = keras_backend.rnn(
            _step_function(cell, kind), zx, states, go_backwards=layer.go_backwards, mask=mask, unroll=layer.unroll,
            input_length=x.shape[1], zero_output_for_mask=layer.zero_output_for_mask, return_all_outputs=True)
        units = cell.units
        previous = outputs[:, :, units:2 * units]
        reset = outputs[:, :, 2 * units:] if kind == "gru" else None
        if layer.go_backwards:  # steps ran in reverse: align h_{t-1} and r_t with x_t and zx_t
            previous = tf.reverse(previous, [1])
            reset = None if reset is None else tf.reverse(reset, [1])
        recording = RecurrentRecording(x, [zx], extras=(previous, reset))
        recording._linearized_replay = self._linearized_replay(layer, original_call)
        recordings.append(recording)
        output = outputs[:, :, :units] if layer.return_sequences else last[:, :units]
        output = tf.cast(output, layer.compute_dtype)
        final_states = [tf.cast(s, layer.compute_dtype) for s in final_states]
        return [output, *final_states] if layer.return_state else output

    def _linearized_replay(self, layer, original_call):
        """Arguments → [zx + h_{t-1} U (+ GRU's recurrent bias)], h_{t-1} and r_t held fixed
        (see RecurrentRecording)."""
        def replay(*args, **kwargs):
            recordings = []
            self.tapped_call(layer, original_call, recordings, *args, **kwargs)
            recording = recordings[-1]
            previous, reset = (tf.stop_gradient(t) if t is not None else None for t in recording.extras)
            return [recording.watched[0] + _recurrent_linear(layer.cell, previous, reset)]
        return replay

    def contribution(self, layer, recordings, output_grads):
        cell, kind = layer.cell, _kind(layer.cell)
        grads = [g[0] if g[0] is not None else tf.zeros_like(r.watched[0]) for r, g in zip(recordings, output_grads)]
        inputs = [r.inputs for r in recordings]
        previous = [r.extras[0] for r in recordings]
        if kind != "gru":
            return RecurrentContribution(
                [dense_contribution(inputs, grads, cell.use_bias), dense_contribution(previous, grads, False)],
                lambda sums: [sums[0], sums[-1]] + sums[1:-1])  # [W, b?] + [U] → [W, U, b?]
        resets = [r.extras[1] for r in recordings]
        if cell.reset_after:
            return _gru_reset_after(cell, inputs, previous, resets, grads)
        return _gru_reset_before(cell, inputs, previous, resets, grads)


def _gru_reset_after(cell, inputs, previous, resets, grads) -> RecurrentContribution:
    """W, b_in from (x, s); U, b_rec from (h_{t-1}, [s^z, s^r, r ⊙ s^h̃])."""
    units = cell.units
    recurrent_grads = [tf.concat([g[:, :, :2 * units], r * g[:, :, 2 * units:]], axis=-1)
                       for g, r in zip(grads, resets)]
    parts = [dense_contribution(inputs, grads, cell.use_bias),
             dense_contribution(previous, recurrent_grads, cell.use_bias)]

    def assemble(sums):
        if not cell.use_bias:
            return sums
        kernel, input_bias, recurrent_kernel, recurrent_bias = sums
        return [kernel, recurrent_kernel, tf.stack([input_bias, recurrent_bias])]

    return RecurrentContribution(parts, assemble)


def _gru_reset_before(cell, inputs, previous, resets, grads) -> RecurrentContribution:
    """W, b from (x, s); U's update/reset columns from (h_{t-1}, s^{z,r}), its candidate
    columns from (r ⊙ h_{t-1}, s^h̃)."""
    units = cell.units
    parts = [dense_contribution(inputs, grads, cell.use_bias),
             dense_contribution(previous, [g[:, :, :2 * units] for g in grads], False),
             dense_contribution([r * h for r, h in zip(resets, previous)], [g[:, :, 2 * units:] for g in grads], False)]

    def assemble(sums):
        kernel, rest = sums[0], sums[1:]
        bias = rest[:-2]
        return [kernel, tf.concat(rest[-2:], axis=1)] + bias

    return RecurrentContribution(parts, assemble)


def _recurrent_linear(cell, previous, reset):
    """The recurrent term of the pre-activations as a function of U (and GRU's recurrent bias)
    with h_{t-1} and r_t fixed, shaped like zx."""
    kind, units = _kind(cell), cell.units
    if kind != "gru":
        return keras.ops.matmul(previous, cell.recurrent_kernel)
    if cell.reset_after:
        inner = keras.ops.matmul(previous, cell.recurrent_kernel)
        if cell.use_bias:
            inner = inner + cell.bias[1]
        return tf.concat([inner[:, :, :2 * units], reset * inner[:, :, 2 * units:]], axis=-1)
    return tf.concat([keras.ops.matmul(previous, cell.recurrent_kernel[:, :2 * units]),
                      keras.ops.matmul(reset * previous, cell.recurrent_kernel[:, 2 * units:])], axis=-1)


def _initial_states(layer, x, initial_state) -> list:
    """The states the layer starts from, as ``RNN.call`` builds them."""
    if initial_state is None:
        initial_state = layer.get_initial_state(batch_size=tf.shape(x)[0])
    if not tf.nest.is_nested(initial_state):
        initial_state = [initial_state]
    return [tf.cast(s, layer.cell.compute_dtype) for s in tf.nest.flatten(initial_state)]


def _step_function(cell, kind):
    """(zx_t, states) → ([h_t, h_{t-1}(, r_t)], new states): Keras' cell math on the
    precomputed input projection zx_t."""
    units = cell.units

    def lstm(zx_t, states):
        h_prev, c_prev = states
        z = zx_t + keras.ops.matmul(h_prev, cell.recurrent_kernel)
        z_i, z_f, z_c, z_o = tf.split(z, 4, axis=-1)
        i, f, o = (cell.recurrent_activation(v) for v in (z_i, z_f, z_o))
        c = f * c_prev + i * cell.activation(z_c)
        h = o * cell.activation(c)
        return tf.concat([h, h_prev], axis=-1), [h, c]

    def gru(zx_t, states):
        h_prev = states[0]
        x_z, x_r, x_h = tf.split(zx_t, 3, axis=-1)
        if cell.reset_after:
            inner = keras.ops.matmul(h_prev, cell.recurrent_kernel)
            if cell.use_bias:
                inner = inner + cell.bias[1]
        else:
            inner = keras.ops.matmul(h_prev, cell.recurrent_kernel[:, :2 * units])
        z = cell.recurrent_activation(x_z + inner[:, :units])
        r = cell.recurrent_activation(x_r + inner[:, units:2 * units])
        if cell.reset_after:
            candidate = r * inner[:, 2 * units:]
        else:
            candidate = keras.ops.matmul(r * h_prev, cell.recurrent_kernel[:, 2 * units:])
        h = z * h_prev + (1 - z) * _activate(cell.activation, x_h + candidate)
        return tf.concat([h, h_prev, r], axis=-1), [h]

    def simple(zx_t, states):
        h_prev = states[0]
        h = _activate(cell.activation, zx_t + keras.ops.matmul(h_prev, cell.recurrent_kernel))
        return tf.concat([h, h_prev], axis=-1), [h]

    return {"lstm": lstm, "gru": gru, "simple": simple}[kind]


RECURRENT_RULE = RecurrentRule()
for _layer_class in _LAYERS:
    register_ghost_rule(_layer_class, RECURRENT_RULE)
