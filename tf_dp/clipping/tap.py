"""Taps: swap each trainable layer's ``call`` for its rule's recording call, for one trace.

Inside ``LayerTap`` every layer that owns trainable variables records what its rule needs
(inputs, pre-activation outputs) during the model's ordinary forward pass; outside, the
layers are untouched. The swap is per instance and undone on exit, so the same model keeps
serving plain Keras calls.

Every recording also keeps the call's arguments, the variable values in effect and a
``replay`` function (arguments → the recording's watched tensors), so that any call can be
differentiated per example by the fallback (layer_per_example.py). A layer is replayed
per example in all its calls as soon as one call is not what its rule models
(``GhostRule.accepts_call``): the per-example gradient is then the sum over the calls,
cross terms included.

Batch-free calls: a layer applied to tensors without the example axis (ViT's position ids
of shape [1, T], broadcast to the batch by the next op) sends every example's gradient
through the same output; its per-example gradients are those of the broadcast copies, so
the tap broadcasts such inputs to the batch first, and example i's gradient flows through
its own slice.

Shared weights: a variable of a tapped layer read while another layer's call (or no
tapped call) is running — logits = h Eᵀ written by hand with another layer's table —
is a use no rule sees; its per-example gradient would miss that use's term. The tap notes
every such read (``shared_layers``); the engine then leaves those layers out of the taps and
takes their variables' per-example gradients through the whole model instead (exact, all
uses summed; tied embeddings through ``ReversibleEmbedding(reverse=True)`` are one layer's
calls, handled by its rule at ghost cost).
"""

from __future__ import annotations

import contextlib
import functools
import threading

import tensorflow as tf
from keras.src.backend.common import variables as keras_variables

from tf_dp.clipping.layer_per_example import LayerPerExampleRule, is_batched
from tf_dp.clipping.registry import GhostRule, ghost_rule_for


class LayerTap:
    """Context manager recording, per tapped layer, a list of ``Recording``s.

    ``batch_size``: the number of examples B (a scalar tensor or int); when None, taken from
    the first tapped call that carries an example axis."""

    def __init__(self, layers, use_ghost_rules: bool = True, batch_size=None):
        self.fallback = LayerPerExampleRule(self)
        self.units: list[tuple[object, GhostRule]] = [
            (layer, (ghost_rule_for(layer) if use_ghost_rules else None) or self.fallback) for layer in layers
        ]
        self.recordings = {id(layer): [] for layer, _ in self.units}
        self.replayed = set()  # ids of layers with a call their rule does not model
        self.batch_size = batch_size
        self._paused = False
        self._owners = {id(v): layer for layer, _ in self.units for v in self.fallback.variables(layer)}
        self._running: list = []  # the tapped calls in progress, innermost last
        self.foreign_reads: dict[int, tuple] = {}  # id(variable) → (variable, owner, reader)

    def __enter__(self):
        for layer, rule in self.units:
            original_call = type(layer).call.__get__(layer)
            object.__setattr__(layer, "call", self._recording_call(layer, rule, original_call))
        _ReadWatch.enter(self)
        return self

    def __exit__(self, *exc):
        for layer, _ in self.units:
            layer.__dict__.pop("call", None)
        _ReadWatch.exit(self)
        return False

    def _note_read(self, variable):
        owner = self._owners.get(id(variable))
        if owner is None or self._paused:
            return
        reader = self._running[-1] if self._running else None
        if reader is not owner:
            self.foreign_reads.setdefault(id(variable), (variable, owner, reader))

    def shared_layers(self) -> list:
        """Tapped layers whose variables were read outside their own calls, in tap order."""
        owners = {id(owner) for _, owner, _ in self.foreign_reads.values()}
        return [layer for layer, _ in self.units if id(layer) in owners]

    def _recording_call(self, layer, rule, original_call):
        recordings = self.recordings[id(layer)]

        @functools.wraps(original_call)
        def call(*args, **kwargs):
            if self._paused:
                return original_call(*args, **kwargs)
            self._running.append(layer)
            try:
                return record(*args, **kwargs)
            finally:
                self._running.pop()

        def record(*args, **kwargs):
            args, kwargs = self._with_example_axis(args, kwargs)
            use = rule
            if rule is not self.fallback and not rule.accepts_call(layer, args, kwargs):
                self.replayed.add(id(layer))
                use = self.fallback
            values = self.fallback.values(layer)
            outputs = use.tapped_call(layer, original_call, recordings, *args, **kwargs)
            recording = recordings[-1]
            recording.call_inputs, recording.values = (args, kwargs), values
            if use is not self.fallback:
                recording.replay = _rule_replay(use, layer, original_call)
            return outputs

        return call

    def _with_example_axis(self, args, kwargs):
        """The call's arguments, with tensors lacking the example axis broadcast to the
        batch when no argument has one (a batch-free call, see the module docstring)."""
        flat = tf.nest.flatten((args, kwargs))
        tensors = [v for v in flat if tf.is_tensor(v) and v.shape.rank is not None and v.shape.rank >= 1]
        batched = [v for v in tensors if is_batched(v, None)]
        if batched and self.batch_size is None:
            self.batch_size = tf.shape(batched[0])[0]
        if batched or not tensors or self.batch_size is None:
            return args, kwargs
        examples = self.batch_size

        def broadcast(value):
            if tf.is_tensor(value) and value.shape.rank is not None and value.shape.rank >= 1:
                return tf.broadcast_to(value, tf.concat([[examples], tf.shape(value)[1:]], axis=0))
            return value

        return tf.nest.pack_sequence_as((args, kwargs), [broadcast(v) for v in flat])

    @contextlib.contextmanager
    def paused(self):
        """Plain calls (no recording) while a rule replays a layer."""
        previous, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = previous

    def watched_tensors(self, skip=()) -> list:
        """The tensors whose gradients the rules need (none of the layers in ``skip``)."""
        skipped = {id(layer) for layer in skip}
        return [t for layer, _ in self.units if id(layer) not in skipped
                for r in self.recordings[id(layer)] for t in r.watched]

    def contributions(self, output_grads: list, skip=()):
        """Splits the flat gradient list of ``watched_tensors`` back per layer and builds
        each layer's ``Contribution`` (skipping layers not called in this pass); a layer
        with a call its rule does not model is replayed per example in all its calls."""
        grads = iter(output_grads)
        skipped = {id(layer) for layer in skip}
        result = []
        for layer, rule in self.units:
            if id(layer) in skipped:
                continue
            recordings = self.recordings[id(layer)]
            per_recording = [[next(grads) for _ in r.watched] for r in recordings]
            if recordings:
                use = self.fallback if id(layer) in self.replayed else rule
                result.append((layer, use, use.contribution(layer, recordings, per_recording)))
        return result


class _ReadWatch:
    """Wraps Keras' ``Variable.value`` (every read of a Keras variable goes through it) while
    any tap is open, reporting reads to the taps open in the reading thread (replicas of a
    tf.distribute step run in threads, each with its own tap). Installed once for all open
    taps, removed when the last one closes."""

    _lock = threading.Lock()
    _open = 0
    _original = None
    _local = threading.local()

    @classmethod
    def enter(cls, tap):
        with cls._lock:
            if cls._open == 0:
                cls._original = keras_variables.Variable.value
                original = cls._original

                def value(variable):
                    for open_tap in getattr(cls._local, "taps", ()):
                        open_tap._note_read(variable)
                    return original.fget(variable)

                keras_variables.Variable.value = property(value)
            cls._open += 1
        cls._local.taps = getattr(cls._local, "taps", ()) + (tap,)

    @classmethod
    def exit(cls, tap):
        cls._local.taps = tuple(t for t in getattr(cls._local, "taps", ()) if t is not tap)
        with cls._lock:
            cls._open -= 1
            if cls._open == 0:
                keras_variables.Variable.value = cls._original
                cls._original = None


def _rule_replay(rule, layer, original_call):
    """Arguments → the watched tensors of the rule's own recording of that call."""
    def replay(*args, **kwargs):
        recordings = []
        rule.tapped_call(layer, original_call, recordings, *args, **kwargs)
        return recordings[-1].watched
    return replay
