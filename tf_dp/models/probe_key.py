"""What the row-independence verdict depends on: the key under which a passed probe is reused.

``tf_dp.models.row_independence`` tests that each example's output, loss and gradient depend
on its own row only (docs/algorithms.md §1), by running the model on a few real rows. The
verdict holds for the model, loss and rows it was computed on, so it is reused only while
all of these are unchanged:

  * every layer of the model (the model itself included, in ``_flatten_layers`` order): its
    identity and class, the function its ``call`` resolves to, the functions of the user's
    classes in its MRO (not Keras' or tf_dp's), its dtype policy, ``trainable``,
    and its configuration attributes — the scalars, tuples/lists/dicts of scalars and the
    functions (by identity, e.g. ``activation``) held in the instance's ``__dict__``, private
    ones included (Keras' training-loop bookkeeping on the model, ``_TRANSIENT``, excepted);
    a layer swapped in or out, an attribute flipped by hand, a ``call`` replaced on the
    instance or the class, all change the key;
  * every model variable (weights and seed states): identity, shape, dtype, ``trainable``;
  * the per-example loss: its identity and, two objects deep, its attributes (the user's loss
    object, its function and arguments), so a recompile (a new loss) or a loss attribute
    changed in place re-probes;
  * the probed rows: their count m, and a blake2b digest of the head rows the probe reads
    (structure, dtypes, shapes and bytes), so another data set, other shapes (a recompile for
    other inputs) or a new ``train_on_batch`` batch re-probe;
  * the phase the model last opened (scheme, q, N, L, parameter; not σ, which a schedule
    changes step by step): ``train_on_batch`` after a ``fit``, or after a call that declared a
    new batch size, probes again.

Objects are held weakly (``_Identity``): a key whose object was collected matches nothing, so
an address reused by a new object never revives an old verdict. Variable values are not part
of the key (they change every step): a layer that mixes rows only for some weight values is
outside the probe (module docstring of ``row_independence``, limits). Only ``train_on_batch``
reuses verdicts by this key; ``fit`` probes on every call, and every trace of the step probes
again (``row_independence.reprobe_on_trace``).

The key is computed afresh on every ``train_on_batch`` call. ``_KeyMemo`` makes that cheap
without trusting anything it did not look at: an object's attribute keys are reused only
while its ``__dict__`` holds the same objects of the same types, containers element by
element (compared by identity, the values held so an address cannot be reused); values
whose key may change while they stay the same object are keyed again every time.
"""

from __future__ import annotations

import functools
import hashlib
import operator
import types
import weakref

import keras
import numpy as np
import tensorflow as tf

MEMO_ATTRIBUTE = "_probe_key_memo"  # the model's _KeyMemo (held on the model: no global table keeps it alive)
# Model attributes that Keras' and tf_dp's training loops (fit, evaluate, predict, train_on_batch)
# rewrite between calls; none changes what a forward pass computes.
_TRANSIENT = frozenset({
    "_called", "_distributed_dataset", "_eval_epoch_iterator", "_initial_epoch", "_lock", "_self_update_uid",
    "predict_function", "stop_evaluating", "stop_predicting", "stop_training", "test_function", "train_function",
    "history", "_declared_batch_size", "step_plan", "_private_run", MEMO_ATTRIBUTE,
})
_SCALARS = (bool, int, float, complex, str, bytes, type(None), np.generic)
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial,
              staticmethod, classmethod)
_LIBRARIES = frozenset({"builtins", "keras", "tensorflow", "tf_keras", "tf_dp"})  # methods not keyed
_SKIP = object()
LOSS_DEPTH = 2  # the loss wrapper → the user's loss object → its function and arguments


class _Identity:
    """An object compared by identity, held weakly when it can be: equal to another
    ``_Identity`` only while both refer to the same live object."""

    __slots__ = ("_get",)

    def __init__(self, obj):
        try:
            self._get = weakref.ref(obj)
        except TypeError:  # not weakly referable (a builtin, a slot class): held strongly
            self._get = lambda: obj

    def __eq__(self, other) -> bool:
        if not isinstance(other, _Identity):
            return NotImplemented
        mine = self._get()
        return mine is not None and mine is other._get()

    def __hash__(self) -> int:
        return 0  # keys are compared, never hashed into a table

    def __repr__(self) -> str:
        return f"_Identity({type(self._get()).__name__})"


def verdict_key(model, per_example_loss, head, rows: int, key_contents: bool = True) -> tuple:
    """The key of a row-independence verdict for ``model`` (built), ``per_example_loss`` and
    ``head`` = the (x, y) numpy rows the probe reads, of which the first ``rows`` are W.

    ``key_contents=False`` keys the rows by structure, dtypes and shapes only (``train_on_batch``:
    a loop over new batches would otherwise pay a probe, ~0.2–0.4 s, on every call)."""
    memo = _KeyMemo.of(model)
    layers = tuple(_layer_key(layer, memo) for layer in model._flatten_layers(include_self=True))
    variables = tuple((_Identity(v), tuple(v.shape), str(v.dtype), bool(v.trainable)) for v in model.variables)
    key = (layers, variables, _value_key(per_example_loss, LOSS_DEPTH, memo), int(rows),
           rows_digest(head, contents=key_contents), _phase_key(model))
    memo.finish()
    return key


def _phase_key(model) -> tuple:
    """The settings of the phase the model's last ``fit``/``train_on_batch`` opened (scheme,
    q, N, L, parameter; ``PrivateRun.open_phase``), () before any: host values, no ledger read."""
    run = getattr(model, "_private_run", None)
    return tuple(run.phase_arguments) if run is not None else ()


def rows_digest(structure, contents: bool = True) -> bytes:
    """blake2b of a nest of arrays: its structure, and each leaf's dtype, shape and (with
    ``contents``) its values (object arrays — strings — element by element)."""
    digest = hashlib.blake2b(digest_size=32)
    leaves = tf.nest.flatten(structure)
    digest.update(repr(tf.nest.map_structure(lambda _: 0, structure) if leaves else structure).encode())
    for leaf in leaves:
        if leaf is None:
            digest.update(b"|None")
            continue
        array = np.asarray(leaf)
        digest.update(f"|{array.dtype.str}{array.shape}|".encode())
        if not contents:
            continue
        if array.dtype == object:
            for element in array.ravel():
                text = repr(element).encode()
                digest.update(len(text).to_bytes(8, "little") + text)
        else:
            digest.update(np.ascontiguousarray(array).tobytes())
    return digest.digest()


def _layer_key(layer, memo: "_KeyMemo") -> tuple:
    policy = getattr(layer, "dtype_policy", None)
    return (_Identity(layer), _Identity(type(layer)), _function_key(getattr(layer, "call", None)),
            getattr(policy, "name", repr(policy)), bool(getattr(layer, "trainable", True)),
            _attributes(layer, 0, memo), _user_methods(type(layer)))


def _user_methods(cls) -> tuple:
    """The functions of the user's classes in ``cls``'s MRO (a helper method ``call`` uses,
    replaced on the class, changes the key); library classes are taken as they are."""
    return tuple((_Identity(base), tuple((name, _function_key(value)) for name, value in vars(base).items()
                                         if isinstance(value, _FUNCTIONS)))
                 for base in cls.__mro__ if base.__module__.partition(".")[0] not in _LIBRARIES)


def _attributes(obj, depth: int, memo: "_KeyMemo | None") -> tuple:
    """(name, key) of the instance attributes that configure ``obj`` (module docstring)."""
    attributes = getattr(obj, "__dict__", {})
    snapshot = None if memo is None else memo.reusable(obj, depth, attributes)
    if snapshot is None:
        snapshot = _Attributes(attributes, depth)
    if memo is not None:
        memo.keep(obj, depth, snapshot)
    items = []
    for name, value, key in zip(snapshot.names, snapshot.members.values, snapshot.members.keys):
        key = _value_key(value, depth, memo) if key is _UNSTABLE else key
        if key is not _SKIP:
            items.append((name, key))
    return tuple(items)


_IDENTITY_KEYED = (*_SCALARS, *_FUNCTIONS, type, keras.layers.Layer, keras.Variable, tf.Variable, set, frozenset)
_UNSTABLE = object()  # a value whose key must be computed again at every walk


def _node(value, depth: int) -> tuple:
    """(value, type, key, members): ``value``'s key as ``_value_key(value, depth)`` computes it
    when that is a function of the identities and types of the value and of the elements it
    holds (``members``: a ``_Members`` of a list's, tuple's or dict's elements), else
    ``_UNSTABLE``. Scalars are immutable; functions, bound methods and classes are keyed by
    identity; layers, variables, sets and other objects at depth 0 are skipped. Unstable:
    partials and static/class methods (their contents can be rebound), objects keyed by their
    attributes (depth > 0), proxies (their ``__class__`` is their target's), and containers
    of those."""
    kind = type(value)
    if getattr(value, "__class__", None) is not kind or isinstance(value, (functools.partial, staticmethod,
                                                                            classmethod)):
        return value, kind, _UNSTABLE, None
    if isinstance(value, _IDENTITY_KEYED):
        return value, kind, _value_key(value, depth, None), None
    if not isinstance(value, (list, tuple, dict)):
        return value, kind, (_UNSTABLE if depth > 0 else _SKIP), None
    members = _Members(_elements(value), depth)
    if any(key is _UNSTABLE for key in members.keys):
        return value, kind, _UNSTABLE, None
    key = _value_key(value, depth, None)
    if key is _SKIP and _SKIP in _leaf_keys(members):
        members.nested = ()  # a layer (variable, ...) held directly skips the container, whatever else it holds
    return value, kind, key, members


def _leaf_keys(members: "_Members") -> list:
    """The keys of the members that are not containers."""
    containers = {index for index, _ in members.nested}
    return [key for index, key in enumerate(members.keys) if index not in containers]


def _elements(container) -> tuple:
    """A list's or tuple's elements; a dict's keys, then its values."""
    return (*container.keys(), *container.values()) if isinstance(container, dict) else tuple(container)


class _Members:
    """Values held by a container or an object, with their types and keys (``_node``),
    compared by identity at C speed; ``nested`` are the members that are containers."""

    __slots__ = ("values", "kinds", "keys", "nested")

    def __init__(self, values: tuple, depth: int):
        nodes = [_node(value, depth) for value in values]
        self.values = values
        self.kinds = tuple(map(type, values))
        self.keys = tuple(node[2] for node in nodes)
        self.nested = tuple((index, node) for index, node in enumerate(nodes) if node[3] is not None)

    def unchanged(self, values: tuple) -> bool:
        """Whether ``values`` are the same objects, of the same types, holding the same elements.

        Args:
          values: the values now, in the order they were taken.

        Returns:
          True if every member's key is unchanged.
        """
        return (len(values) == len(self.values) and all(map(operator.is_, values, self.values))
                and all(map(operator.is_, map(type, values), self.kinds))
                and all(_unchanged(node, values[index]) for index, node in self.nested))


def _unchanged(node: tuple, now) -> bool:
    """Whether ``now`` is the value ``node`` was taken of, holding the same elements (by
    identity and type, recursively): then ``node``'s key is ``now``'s."""
    value, kind, _, members = node
    if now is not value or type(now) is not kind:
        return False
    return members is None or members.unchanged(_elements(now))


class _Attributes:
    """The configuring attributes of one object (its ``__dict__`` less ``_TRANSIENT``), sorted by name."""

    __slots__ = ("names", "members")

    def __init__(self, attributes: dict, depth: int):
        self.names = tuple(sorted(name for name in attributes if name not in _TRANSIENT))
        self.members = _Members(tuple(attributes[name] for name in self.names), depth)

    def unchanged(self, attributes: dict) -> bool:
        """Whether ``attributes`` (the object's ``__dict__`` now) hold the same names and values.

        Args:
          attributes: the object's ``__dict__``.

        Returns:
          True if no configuring attribute was added, removed, rebound or changed in place.
        """
        if len(attributes) - len(_TRANSIENT.intersection(attributes)) != len(self.names):
            return False
        try:
            values = tuple(map(attributes.__getitem__, self.names))
        except KeyError:
            return False
        return self.members.unchanged(values)


class _KeyMemo:
    """A model's attribute keys from its last key walk, reused for an object whose
    ``__dict__`` holds the same names bound to the same objects of the same types, holding the
    same elements (``_node``, ``_unchanged``); values whose key may change while they stay the
    same object (objects keyed by their attributes, partials, proxies) are keyed again. The
    snapshots hold their values strongly, so an address is never reused while compared; the
    memo lives on the model (``MEMO_ATTRIBUTE``, a plain object no saver walks) and keeps only
    the objects of the latest walk."""

    __slots__ = ("_last", "_next")

    def __init__(self):
        self._last, self._next = {}, {}

    @staticmethod
    def of(model) -> "_KeyMemo":
        """The memo of ``model``, created on first use.

        Args:
          model: the model whose key is computed.

        Returns:
          Its ``_KeyMemo``.
        """
        memo = model.__dict__.get(MEMO_ATTRIBUTE)
        if memo is None:
            memo = _KeyMemo()
            object.__setattr__(model, MEMO_ATTRIBUTE, memo)  # untracked by Keras: never saved
        return memo

    def reusable(self, obj, depth: int, attributes: dict):
        """The snapshot of ``obj``'s last walk if its configuring attributes are unchanged
        (``_Attributes.unchanged``), else None.

        Args:
          obj: the object whose attributes are keyed.
          depth: the depth it is keyed at.
          attributes: its ``__dict__`` now.

        Returns:
          The ``_Attributes`` snapshot, or None.
        """
        entry = self._last.get((id(obj), depth))
        if entry is None or entry[0] is not obj or not entry[1].unchanged(attributes):
            return None
        return entry[1]

    def keep(self, obj, depth: int, snapshot: "_Attributes") -> None:
        """Keeps ``snapshot`` as ``obj``'s for the next walk.

        Args:
          obj: the object keyed.
          depth: the depth it was keyed at.
          snapshot: what ``_attributes`` computed.
        """
        self._next[(id(obj), depth)] = (obj, snapshot)

    def finish(self) -> None:
        """Ends a walk: its snapshots replace the previous walk's (objects no longer in the
        model are released)."""
        self._last, self._next = self._next, {}


def _value_key(value, depth: int, memo: "_KeyMemo | None"):
    """A comparable stand-in for ``value``: scalars as themselves, functions by identity,
    containers of those element by element, other objects (to ``depth``) by identity, class
    and attributes; layers and variables are keyed by the model's own entries (``_SKIP``)."""
    if isinstance(value, float):
        return ("float", value.hex())
    if isinstance(value, _SCALARS):
        return (type(value).__name__, value)
    if isinstance(value, _FUNCTIONS) or isinstance(value, type):
        return _function_key(value)
    if isinstance(value, (keras.layers.Layer, keras.Variable, tf.Variable, set, frozenset)):
        return _SKIP  # layers and variables: keyed on their own; sets: caches (a loss's probed shapes)
    if isinstance(value, (list, tuple)):
        keys = _element_keys(((None, v) for v in value), depth, memo)
        return _SKIP if keys is _SKIP else (type(value).__name__, tuple(key for _, key in keys))
    if isinstance(value, dict):
        if not all(isinstance(k, _SCALARS) for k in value):
            return _SKIP
        keys = _element_keys(((repr(k), v) for k, v in sorted(value.items(), key=lambda kv: repr(kv[0]))), depth,
                             memo)
        return _SKIP if keys is _SKIP else ("dict", keys)
    if depth > 0:
        return ("object", _Identity(value), _Identity(type(value)), _attributes(value, depth - 1, memo))
    return _SKIP


def _element_keys(named_values, depth: int, memo: "_KeyMemo | None"):
    """((name, key), ...) of a container's elements, or ``_SKIP`` as soon as one is skipped
    (a container holding a layer or a variable is keyed by the model's own entries)."""
    keys = []
    for name, value in named_values:
        key = _value_key(value, depth, memo)
        if key is _SKIP:
            return _SKIP
        keys.append((name, key))
    return tuple(keys)


def _function_key(function):
    """A function by identity; a bound method by (function, the object it is bound to),
    since each attribute access builds a new method object."""
    if isinstance(function, types.MethodType):
        return ("method", _Identity(function.__func__), _Identity(function.__self__))
    if isinstance(function, (staticmethod, classmethod)):
        return ("method", _Identity(function.__func__))
    if isinstance(function, functools.partial):
        return ("partial", _function_key(function.func), _value_key(function.args, 0, None),
                _value_key(function.keywords, 0, None))
    return ("function", None if function is None else _Identity(function))
