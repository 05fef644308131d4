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

Batch-free calls: which arguments carry the example axis is read off the traced graph — an
argument does iff its value depends on the batch inputs (example_axis.py), never from its
shape. A layer applied to batch-free tensors only (ViT's position ids [1, T], keras.io's
``pos_emb(range(maxlen))`` of shape [T], a table of class features [K, f]) computes one output
shared by every example. Where that output is used only by element-wise ops broadcasting it
against the batch (``x + positions``), example i's output gradient is the VJP of that op at
row i, and the layer is replayed once per example with the shared inputs and those output
gradients (exact). A call mixing batched and batch-free tensor arguments, or a batch-free
output used any other way (a prototype head's ``h @ zᵀ``), sends the layer to the exact
whole-model route below (``whole_model_layers``).

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

from tf_dp.clipping.example_axis import BatchDependence, Dependence, broadcast_uses
from tf_dp.clipping.layer_per_example import LayerPerExampleRule
from tf_dp.clipping.registry import GhostRule, as_layer_registry

BATCHED, BATCH_FREE, MIXED = "batched", "batch-free", "mixed"


class LayerTap:
    """Context manager recording, per tapped layer, a list of ``Recording``s.

    ``batch_size``: the number of examples B (a scalar tensor or int); when None, taken from
    the first tapped call that carries an example axis. ``batch_inputs``: the model's inputs x
    (graph tensors), which decide which arguments carry the example axis; None (inspection
    only, e.g. listing a model's replayed layers) takes every tensor of rank ≥ 1 as batched.
    ``layer_registry``: the ``LayerRegistry`` whose rules the layers take (None: the default)."""

    def __init__(self, layers, use_ghost_rules: bool = True, batch_size=None, batch_inputs=None,
                 layer_registry=None):
        self.fallback = LayerPerExampleRule(self)
        registry = as_layer_registry(layer_registry)
        self.units: list[tuple[object, GhostRule]] = [
            (layer, (registry.resolve(layer) if use_ghost_rules else None) or self.fallback) for layer in layers
        ]
        self.recordings = {id(layer): [] for layer, _ in self.units}
        self.replayed = set()  # ids of layers with a call their rule does not model
        self.batch_size = batch_size
        self._paused = False
        self._owners = {id(v): layer for layer, _ in self.units for v in self.fallback.variables(layer)}
        self._running: list = []  # the tapped calls in progress, innermost last
        self.foreign_reads: dict[int, tuple] = {}  # id(variable) → (variable, owner, reader)
        self._dependence = None if batch_inputs is None else BatchDependence(batch_inputs)
        self.mixed_calls = set()  # ids of layers called with batched and batch-free tensors together

    def __enter__(self):
        _ReadWatch.enter(self)
        try:
            for layer, rule in self.units:
                original_call = type(layer).call.__get__(layer)
                object.__setattr__(layer, "call", self._recording_call(layer, rule, original_call))
        except BaseException:
            self._restore()  # __exit__ does not run when __enter__ raises
            raise
        return self

    def __exit__(self, *exc):
        self._restore()
        return False

    def _restore(self):
        """The layers' own calls back, and this tap's read watch closed, whatever raised."""
        try:
            for layer, _ in self.units:
                layer.__dict__.pop("call", None)
        finally:
            _ReadWatch.exit(self)

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
            kind, batched = self._classify(args, kwargs)
            self._require_examples_first(layer, args, kwargs, batched)
            use = rule
            if kind != BATCHED or (rule is not self.fallback and not rule.accepts_call(layer, args, kwargs)):
                self.replayed.add(id(layer))
                use = self.fallback
            if kind == MIXED:
                self.mixed_calls.add(id(layer))
            values = self.fallback.values(layer)
            outputs = use.tapped_call(layer, original_call, recordings, *args, **kwargs)
            recording = recordings[-1]
            if getattr(recording, "replay_instead", None):  # the rule found the call is not what it models
                self.replayed.add(id(layer))
                use = self.fallback
            recording.call_inputs, recording.values = (args, kwargs), values
            recording.batched_inputs, recording.batch_free = batched, kind == BATCH_FREE
            if use is not self.fallback and getattr(recording, "replay", None) is None:  # (a rule may give its own)
                recording.replay = _rule_replay(use, layer, original_call)
            return outputs

        return call

    def _classify(self, args, kwargs):
        """(kind, flat indices of the batched arguments): BATCHED when every tensor argument of
        rank ≥ 1 depends on the batch inputs, BATCH_FREE when none provably does, else MIXED
        (see the module docstring)."""
        flat = tf.nest.flatten((args, kwargs))
        tensors = [i for i, v in enumerate(flat) if tf.is_tensor(v) and v.shape.rank != 0]
        if self._dependence is None:
            dependence = {i: Dependence.DEPENDS for i in tensors}
        else:
            dependence = {i: self._dependence.of(flat[i]) for i in tensors}
        batched = [i for i in tensors if dependence[i] == Dependence.DEPENDS]
        if batched and self.batch_size is None:
            self.batch_size = tf.shape(flat[batched[0]])[0]
        if len(batched) == len(tensors) and batched:
            return BATCHED, batched
        if not batched and all(d == Dependence.INDEPENDENT for d in dependence.values()):
            return BATCH_FREE, batched
        return MIXED, batched

    def _require_examples_first(self, layer, args, kwargs, batched):
        """Refuses a batched argument whose static leading size is not the static batch size
        (examples folded into another axis, e.g. a [P·T, d] reshape): axis 0 must be the examples."""
        examples = self.batch_size if isinstance(self.batch_size, int) else None
        flat = tf.nest.flatten((args, kwargs))
        for index in batched:
            leading = flat[index].shape[0] if flat[index].shape.rank else None
            if examples is not None and leading is not None and leading != examples:
                raise ValueError(
                    f"Layer {layer.name!r} is called on a tensor of shape {flat[index].shape} computed from the batch "
                    f"inputs, whose leading axis is not the batch of {examples} examples. tf_dp clips per example "
                    "along axis 0: keep the examples on axis 0 of every tensor a trainable layer sees (e.g. reshape "
                    "[P·T, d] back to [P, T, d] before the layer), or use clipping_engine='vectorized'.")

    @contextlib.contextmanager
    def paused(self):
        """Plain calls (no recording) while a rule replays a layer."""
        previous, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = previous

    def whole_model_layers(self) -> list:
        """Tapped layers whose per-example gradients need the whole-model route, in tap order:
        variables read outside their own calls (``shared_layers``), calls mixing batched and
        batch-free tensors, and batch-free outputs used other than by a broadcast against the
        batch. Call after the forward pass and before any gradient (it reads the graph's
        consumers of the batch-free outputs)."""
        shared = {id(layer) for layer in self.shared_layers()}
        return [layer for layer, _ in self.units
                if id(layer) in shared or id(layer) in self.mixed_calls or not self._broadcasts_resolved(layer)]

    def _broadcasts_resolved(self, layer) -> bool:
        """Finds the broadcast uses of each batch-free recording's outputs; False if one has another use."""
        for recording in self.recordings[id(layer)]:
            if recording.batch_free and getattr(recording, "broadcast_uses", None) is None:
                uses = [broadcast_uses(t, self._dependence) for t in recording.watched]
                if any(u is None for u in uses):
                    return False
                recording.broadcast_uses = uses
        return True

    def watched_tensors(self, skip=()) -> list:
        """The tensors whose gradients the rules need (none of the layers in ``skip``): for a
        batch-free recording, the outputs of the ops that broadcast its outputs to the batch."""
        skipped = {id(layer) for layer in skip}
        kept = [layer for layer, _ in self.units if id(layer) not in skipped]
        unresolved = [layer.name for layer in kept if not self._broadcasts_resolved(layer)]
        if unresolved:
            raise ValueError(f"Layers {unresolved} have batch-free calls whose outputs are not only broadcast to the "
                             "batch: pass them in `skip` (see LayerTap.whole_model_layers).")
        return [t for layer in kept for r in self.recordings[id(layer)] for t in _gradient_targets(r)]

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
            per_recording = [self._recording_grads(r, [next(grads) for _ in _gradient_targets(r)])
                             for r in recordings]
            if recordings:
                use = self.fallback if id(layer) in self.replayed else rule
                result.append((layer, use, use.contribution(layer, recordings, per_recording)))
        return result

    def _recording_grads(self, recording, grads: list) -> list:
        """The output gradients of one recording: as given, or for a batch-free recording the
        per-example ones [P, *shape] of each output, summed over its broadcast uses."""
        if not recording.batch_free:
            return grads
        grads = iter(grads)
        per_output = []
        for tensor, uses in zip(recording.watched, recording.broadcast_uses):
            total = tf.zeros(tf.concat([[self.batch_size], tf.shape(tensor)], axis=0), tensor.dtype)
            for use in uses:
                grad = next(grads)
                if grad is not None:
                    total += use.per_example_cotangent(grad, self.batch_size)
            per_output.append(total)
        return per_output


class _ReadWatch:
    """Reports each read of a Keras variable to the taps open in the reading thread.

    Every read of a Keras 3 variable goes through the ``Variable.value`` property
    (``keras.src.backend.common.variables``), and nothing else in Keras sees reads, so while
    any tap is open that property is wrapped; the wrapper is installed once for all open taps
    and the original restored when the last one closes (``LayerTap`` closes its watch in a
    ``finally``, also when the traced forward pass raises). The taps are thread-local: a
    thread without an open tap (another model, another replica of a tf.distribute step, each
    replica with its own tap) reads through the wrapper the value it would read anyway, and
    its reads reach no tap; nested taps in one thread all see that thread's reads.

    Why Keras' own scopes do not fit. ``keras.StatelessScope`` is the one hook inside
    ``Variable.value`` (``scope.get_current_value(variable)``), and a subclass could note the
    read there, but (1) the property asks only the innermost stateless scope, so a scope
    opened inside the tap — the engine's own forward pass at other weights
    (``engine.forward``, DiSK/FIBER's θ + γd), or one in a user's layer — would hide its reads
    and a shared weight would be missed (a per-example gradient short of a term: sensitivity
    above C); and (2) inside any stateless scope Keras defers every ``Variable.assign``
    (BatchNormalization's moving statistics, the seed generators of Dropout and random
    augmentation layers), drops ``add_loss`` unless ``collect_losses``, and refuses or defers
    creating variables, so the tapped forward pass would no longer be the model's ordinary
    one. The layer call context (``keras.src.layers.layer.CallContext``) carries only the
    training flag and the entry layer and sees no reads; ``tf.variable_creator_scope`` sees
    creation only.
    """

    _lock = threading.Lock()
    _open = 0
    _original = None
    _local = threading.local()

    @classmethod
    def enter(cls, tap):
        with cls._lock:
            if cls._open == 0:
                cls._original = keras_variables.Variable.__dict__["value"]
                keras_variables.Variable.value = property(cls._watched_read(cls._original.fget))
            cls._open += 1
        cls._local.taps = cls.taps_of_this_thread() + (tap,)

    @classmethod
    def exit(cls, tap):
        cls._local.taps = tuple(t for t in cls.taps_of_this_thread() if t is not tap)
        with cls._lock:
            cls._open -= 1
            if cls._open == 0:
                keras_variables.Variable.value = cls._original
                cls._original = None

    @classmethod
    def taps_of_this_thread(cls) -> tuple:
        return getattr(cls._local, "taps", ())

    @classmethod
    def installed(cls) -> bool:
        """Whether ``Variable.value`` is wrapped now (some tap is open in some thread)."""
        return cls._original is not None

    @classmethod
    def _watched_read(cls, read):
        def value(variable):
            for open_tap in cls.taps_of_this_thread():
                open_tap._note_read(variable)
            return read(variable)
        return value


def _gradient_targets(recording) -> list:
    """The tensors whose gradients of Σ_i ℓ_i a recording needs: its watched outputs, or for a
    batch-free recording the outputs of their broadcast uses."""
    if not getattr(recording, "batch_free", False):
        return recording.watched
    return [use.output for uses in recording.broadcast_uses for use in uses]


def _rule_replay(rule, layer, original_call):
    """Arguments → the watched tensors of the rule's own recording of that call."""
    def replay(*args, **kwargs):
        recordings = []
        rule.tapped_call(layer, original_call, recordings, *args, **kwargs)
        return recordings[-1].watched
    return replay
