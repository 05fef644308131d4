"""A generic guard against layers and losses that mix examples (catches custom layers).

Per-example clipping bounds example i's influence by C only if row i's output, loss and
gradient depend on row i alone: ℓ_j(X) = ℓ_j(X') and ∇θ ℓ_j(X) = ∇θ ℓ_j(X') for every
j ≠ k whenever X' is X with row k changed, REMOVED or added (add/remove adjacency changes
the batch size B; docs/algorithms.md §1). ``validate`` refuses the Keras layers known to
break this (BatchNormalization, MixUp, ...); this guard tests the property itself on the
first ``GUARD_ROWS`` real examples W (the head of the data, the first batch of a batched
dataset or of ``train_on_batch``) before DP steps run: on every ``fit``, and again whenever
the DP step is traced (``reprobe_on_trace``, from the step's Python body: a trace re-reads
Python globals and attributes no key holds); ``train_on_batch`` reuses a passed verdict while
its key (``tf_dp.models.probe_key``: model, loss, the rows' shapes, the phase last opened) is
unchanged:

  * changed rows (same B, bit-identical): for each bit t of the row index, the rows S whose
    bit t is 1 (then 0) are replaced by other real examples; every row outside S keeps its
    outputs and loss bit for bit, and ∇θ Σ_{j∉S} v_j ℓ_j (fixed weights v_j > 0) is
    unchanged. Any pair of rows is separated by some S, so a row that reads any other row
    of W — e.g. only when that row holds a magic value present in W — is caught;
  * padding rows: the odd rows replaced by zeros (a Poisson chunk's padding), same check;
  * batch size (relative tolerance ``SIZE_TOLERANCE``: summation order may change with B):
    W[:m − 1], and W followed by m further head rows (B = 2m), give the
    kept rows the same outputs, losses and ∇θ Σ v_j ℓ_j (catches x·B, counts of rows).

Randomness: both forward passes run in ``training=True`` mode inside a
``keras.StatelessScope`` that maps every model variable to its current value and every
seed-generator state to a fixed value, so Dropout/RandomFlip/... draw the same per-row
randomness for X and X' (Keras' stateless draws of a shorter batch are a prefix of the
longer one's), and no state (seeds, moving statistics) is updated by the guard. The
changed-row probes use ``RANDOM_DRAWS`` seed values in turn, so a layer that mixes rows at
random (a MixUp-like permutation that can leave rows in place) is caught too. If the model
is still not reproducible (randomness outside Keras seed generators, e.g. an unseeded
tf.random op), the comparison falls back to ``training=False`` with a warning (a layer
mixing rows only in training would then pass); if even that is not reproducible the guard
warns that it could not check. A training-mode call must also update no non-trainable
state (a running mean of private rows would be released un-noised), nor add a loss
(``add_loss``: the DP step clips and noises the compiled per-example loss only, so the term
would be dropped). In a model with float16/bfloat16 layers the batch-size probes run with
every layer computing in float32 (``_computing_in_float32``); the same-size probes compare the
model's own dtypes bit for bit. On a failure the probe
is re-run recording every layer's inputs, outputs and their gradients, and the error names
the innermost layer whose output (or input gradient) moves while its inputs (or output
gradient) do not.

Limits — a test, not a proof: a layer that mixes rows only for a value that appears in no
probed row (an example beyond the first ``GUARD_ROWS``), only at batch sizes the probe
does not try (B > ``GUARD_ROWS`` + ``DONOR_SEARCH``, or exactly the training size), or by
an amount below ``SIZE_TOLERANCE`` when B changes, passes it. So does a change between two
probes of a value the step reads as it runs: a variable read by a layer's control flow set by
a callback mid-``fit``, moved by training, or set between ``train_on_batch`` calls of one
phase; with ``run_eagerly=True`` (no trace) a Python global changed mid-``fit``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import warnings
import weakref
from typing import Callable, Optional

import keras
import numpy as np
import tensorflow as tf

from tf_dp.clipping.layer_per_example import calls_wrapped
from tf_dp.clipping.per_example import total_embedding_lookups
from tf_dp.models.losses import without_unused_targets
from tf_dp.models.objective import probe_targets
from tf_dp.models.probe_key import verdict_key
from tf_dp.sampling.sources import num_rows

GUARD_ROWS = 16  # the real examples probed together (W)
DONOR_SEARCH = 51  # further head rows: replacements for W's rows, and W + 16 of them (a larger batch)
RANDOM_DRAWS = 3
GRADIENT_BITS = 1  # changed-row probes whose gradients are compared: those of the index's lowest bits
SIZE_TOLERANCE = 1e-4  # relative, for values compared across batch sizes (float32; looser for 16-bit floats)

VERDICTS_KEPT = 8  # passed keys remembered per model (train_on_batch alternating between batches)

_checked: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model → its passed verdict keys
_latest: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model → the rows of its last check (_ProbedRows)
_traced: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model → the trace last probed (weakref)


@dataclasses.dataclass
class _Probe:
    """One variant X' of W: ``kept[j]`` = row of X' that holds W's row ``compared[j]``;
    ``weighted``: whether ∇θ Σ v_j ℓ_j over the compared rows is compared too."""
    what: str
    batch: tuple
    compared: np.ndarray
    kept: np.ndarray
    draw: int
    same_size: bool
    weighted: bool = True


def check_rows_independent(model, per_example_loss: Optional[Callable], x, y=None, rows: int = GUARD_ROWS,
                           key_contents: bool = True) -> None:
    """Raises ValueError if changing, removing or adding examples of a small batch changes
    another example's output, loss or gradient, or if the training forward pass adds a loss
    (``add_loss``), which the DP step would drop (see module docstring).

    ``fit`` (``key_contents=True``) probes on every call: what the step computes may depend
    on values no key holds (a variable read by a layer's control flow, a Python global read
    at trace time). ``train_on_batch`` (``key_contents=False``) reuses a passed verdict while
    its key is unchanged — the model's layers and variables, the loss, m, the probed rows'
    structure, dtypes and shapes, and the phase last opened (``tf_dp.models.probe_key``) — so a
    loop over batches pays a lookup per call; a re-traced step is probed again at trace
    time (``reprobe_on_trace``).

    Args:
      model: the Keras model (built here on a few rows if needed).
      per_example_loss: ℓ(y, ŷ) → one loss per example, or None (outputs only).
      x, y: the training arrays (or tensors), or a batched tf.data.Dataset of (x, y), whose
        first batch is used; their first ``rows`` are probed, the next ``DONOR_SEARCH`` are
        the replacements and the larger batch.
      rows: m, the size of the probed batch W.
      key_contents: True for ``fit`` (probe on every call; a verdict is keyed on the rows'
        values too); False for ``train_on_batch`` (reuse by key; rows keyed by structure,
        dtypes and shapes only, new values alone do not re-probe).
    """
    head = _probed_head(per_example_loss, x, y, rows)
    if head is None:  # fewer than 2 rows: nothing to compare
        return
    with _refusing_a_fixed_batch_size(model, head):
        if not model.built:
            model(_take(head, np.arange(min(3, num_rows(head[0]))))[0], training=False)
        _latest[model] = _ProbedRows(head, rows, key_contents)  # what a re-traced step is probed on
        if not key_contents and _verdict_key(model, per_example_loss, _latest[model]) in _checked.get(model, []):
            return
        _probe(model, per_example_loss, _latest[model])


def reprobe_on_trace(model, per_example_loss: Optional[Callable]) -> None:
    """Probes ``model`` again while its DP step is being traced (called from the step's
    Python body, which runs only at trace time: nothing is added to the compiled step).

    A re-trace re-reads whatever the step's Python code reads — a Python global, an
    attribute no key holds — so the verdict of the last probe may not describe the new
    graph. The probe runs eagerly (``tf.init_scope``) on the rows of the model's last
    ``check_rows_independent`` call, once per trace (the replicas of a tf.distribute step
    share one); a refusal raises from the trace, before the step runs. Eager execution
    (``run_eagerly=True``) has no trace: nothing is done. A model never probed (a step
    outside ``fit``/``train_on_batch``) has no rows to probe on: nothing is done either.

    Args:
      model: the DP model whose step is traced.
      per_example_loss: the loss the step clips (the model's compiled per-example loss).
    """
    if tf.executing_eagerly():
        return
    probed = _latest.get(model)
    trace = _outermost_graph()
    seen = _traced.get(model)
    if probed is None or (seen is not None and seen() is trace):
        return
    with tf.init_scope():
        _probe(model, per_example_loss, probed)
    _traced[model] = weakref.ref(trace)


@dataclasses.dataclass(frozen=True)
class _ProbedRows:
    """The rows a probe read (numpy (x, y), W and its donors), m, and how its verdict is keyed."""
    head: tuple
    rows: int
    key_contents: bool
    variants: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)  # _check's probes, built once


def _probe(model, per_example_loss, probed: _ProbedRows) -> None:
    """Runs the probe on ``probed`` (refusing by ValueError) and records a passed verdict."""
    with total_embedding_lookups(model):  # ids out of range look up zeros, as in the DP step
        checked = _check(model, per_example_loss, *probed.head, probed.rows, variants=probed.variants)
    if checked:  # the key after the probe: the loss resolves by shapes on first use
        verdicts = [*_checked.get(model, []), _verdict_key(model, per_example_loss, probed)][-VERDICTS_KEPT:]
        _checked[model] = verdicts


def _verdict_key(model, per_example_loss, probed: _ProbedRows) -> tuple:
    return verdict_key(model, per_example_loss, probed.head, probed.rows, probed.key_contents)


def _outermost_graph():
    """The graph of the outermost function being traced (replicas and nested functions of
    one trace share it)."""
    graph = tf.compat.v1.get_default_graph()
    while hasattr(getattr(graph, "outer_graph", None), "outer_graph"):  # a function graph inside another
        graph = graph.outer_graph
    return graph


def _probed_head(per_example_loss, x, y, rows: int):
    """(x, y) as numpy, the rows the probe reads (W and its donors), or None if < 2 rows."""
    if isinstance(x, tf.data.Dataset):
        x, y = _first_batch(x)
        y = without_unused_targets(per_example_loss, y)  # (y0, None) for loss=[fn, None]
    x, y = _as_numpy(x), None if y is None else _as_numpy(y)
    y = probe_targets(per_example_loss, x, y)  # a model's own compute_loss reads x too (custom_step)
    count = min(num_rows(x), rows + DONOR_SEARCH)
    if count < 2:
        return None
    return _take((x, y), np.arange(count))


def _check(model, per_example_loss, x, y, rows: int, variants: Optional[dict] = None) -> bool:
    """The probes of the module docstring on the head rows ``x, y``; False if the model is
    not reproducible (nothing could be checked). ``variants``: where the probes' batches,
    a function of the rows alone, are kept between probes of the same rows (fit's probe and
    the trace's)."""
    count = num_rows(x)
    batch = _take((x, y), np.arange(min(rows, count)))
    probes = _variants((x, y), num_rows(batch[0]), {} if variants is None else variants)
    sized = [p for p in probes if not p.same_size] if _sixteen_bit_layers(model) else []  # run in float32
    probes = [p for p in probes if not any(p is q for q in sized)]
    gradients = per_example_loss is not None and y is not None and bool(model.trainable_variables)
    # Without Keras seed generators every draw pins the same state: W's pass serves all draws.
    shared = not _seed_states(model)
    first_probes = probes if shared else [p for p in probes if p.draw == 0]
    first = _base(model, per_example_loss, batch, first_probes, True, 0, gradients, check_state=True)
    training = _reproducible_mode(model, per_example_loss, batch, first[0])
    if training is False:
        warnings.warn("tf_dp could check only inference mode (training=False) for layers that mix rows: the model's "
                      "training-mode outputs differ between two identical calls even with Keras' random seeds fixed "
                      "(randomness outside keras.random, e.g. tf.random.shuffle). A layer that mixes rows only in "
                      "training (MixUp-like) would not be caught: draw randomness with keras.random and a "
                      "SeedGenerator.",
                      stacklevel=3)
        for probe in probes:
            probe.draw = 0
        first = None
    if training is None:
        warnings.warn("tf_dp could not check that the model's rows are independent: its outputs differ between two "
                      "identical calls even with Keras' random seeds fixed.", stacklevel=3)
        return False
    for draw in sorted({p.draw for p in probes}):
        chosen = [p for p in probes if p.draw == draw]
        if first is not None and (draw == 0 or shared):
            base = _chosen_base(first, first_probes, chosen)
        else:
            base = _base(model, per_example_loss, batch, chosen, training, draw, gradients)
        _require_rows_unmoved(model, per_example_loss, batch, chosen, training, draw, base)
    if sized:
        with _computing_in_float32(model):
            base = _base(model, per_example_loss, batch, sized, training, 0, gradients)
            _require_rows_unmoved(model, per_example_loss, batch, sized, training, 0, base)
    return True


def _variants(head, m: int, kept: dict) -> list:
    """Fresh copies of ``_probes(head, m, RANDOM_DRAWS)``, built once per ``kept`` dict (a
    probe's ``draw`` may be reset by ``_check``; the batches are only read)."""
    if m not in kept:
        kept[m] = _probes(head, m, RANDOM_DRAWS)
    return [dataclasses.replace(probe) for probe in kept[m]]


def _chosen_base(base: tuple, among: list, chosen: list) -> tuple:
    """The part of ``base`` (values, per-probe weights and gradients of W's pass for the probes
    ``among``) that belongs to the probes ``chosen`` (a subset of ``among``)."""
    values, weights, gradients = base
    index = [next(i for i, p in enumerate(among) if p is probe) for probe in chosen]
    return values, [weights[i] for i in index], [gradients[i] for i in index]


# ------------------------------------------------------- 16-bit compute dtypes
_SIXTEEN_BIT = frozenset({"float16", "bfloat16"})


def _sixteen_bit_layers(model) -> list:
    """The layers of ``model`` (itself included) that compute in float16 or bfloat16."""
    return [layer for layer in model._flatten_layers(include_self=True)
            if str(getattr(layer, "compute_dtype", None)) in _SIXTEEN_BIT]


@contextlib.contextmanager
def _computing_in_float32(model):
    """Every 16-bit layer of ``model`` computes in float32 (variables unchanged) inside the
    block; the layers' own policies are restored after it, also when it raises.

    The batch-size probes compare rows across batch sizes, where kernels may sum in another
    order: in bfloat16 (8 significant bits) that moves a weight gradient by ~2⁻⁸ relative,
    more than any tolerance that still catches a small dependence on B. What they test —
    whether a row reads the batch's size — does not depend on the float width, so they run
    in float32 with float32's tolerance; the same-size probes, bit for bit, run in the
    model's own dtypes."""
    swapped = [(layer, layer._dtype_policy) for layer in _sixteen_bit_layers(model)
               if isinstance(layer._dtype_policy, keras.DTypePolicy)
               and getattr(layer._dtype_policy, "quantization_mode", None) is None]
    try:
        for layer, _ in swapped:
            layer._dtype_policy = keras.DTypePolicy("float32")
        yield
    finally:
        for layer, policy in swapped:
            layer._dtype_policy = policy


# ------------------------------------------------------------------ the probes
def _probes(head, m: int, draws: int) -> list:
    """The variants of W = head[:m] (module docstring), changed-row probes cycling over draws."""
    x, y = head
    count = num_rows(x)
    batch = _take(head, np.arange(m))
    everyone = np.arange(m)
    probes = []
    for bit in range(max(1, math.ceil(math.log2(m)))):
        for value in (1, 0):
            changed = everyone[(everyone >> bit) % 2 == value]
            kept = np.setdiff1d(everyone, changed)
            if len(changed) and len(kept):
                donors = {k: _donor(head, k, count, m, offset=bit) for k in changed}
                variant = batch
                for k, donor in donors.items():
                    if donor is not None:
                        variant = _replace_row(variant, k, _take(head, np.array([donor])))
                probes.append(_Probe(f"changing examples {_rows_text(changed)}", variant, kept, kept,
                                     len(probes) % draws, same_size=True, weighted=bit < GRADIENT_BITS))
    odd = everyone[1::2]
    zeros = tf.nest.map_structure(_padding_row, batch)
    padded = batch
    for k in odd:
        padded = _replace_row(padded, k, zeros)
    even = everyone[::2]
    probes.append(_Probe(f"replacing examples {_rows_text(odd)} by padding rows of zeros", padded, even, even, 0,
                         same_size=True, weighted=False))
    if m > 1:
        size = m - 1
        prefix = np.arange(size)
        probes.append(_Probe(f"removing examples {_rows_text(np.arange(size, m))} (batch size {m} → {size})",
                             _take(batch, prefix), prefix, prefix, 0, same_size=False))
    larger = min(count, 2 * m)
    if larger > m:
        probes.append(_Probe(f"adding {larger - m} examples (batch size {m} → {larger})",
                             _take(head, np.arange(larger)), everyone, everyone, 0, same_size=False, weighted=False))
    return probes


def _rows_text(rows: np.ndarray) -> str:
    rows = [int(r) for r in rows]
    return ", ".join(map(str, rows)) if len(rows) <= 4 else f"{rows[0]}, {rows[1]}, …, {rows[-1]} ({len(rows)} rows)"


def _row_weights(rows: int) -> np.ndarray:
    """v_j ∈ [0.5, 1.5], fixed per row of W: Σ_j v_j ∇ℓ_j rarely cancels a mixed term."""
    return 0.5 + np.random.default_rng(12345).uniform(size=rows)


def _base(model, per_example_loss, batch, probes: list, training: bool, draw: int, gradients: bool,
          check_state: bool = False) -> tuple:
    """(values, per-probe weights of W's rows, per-probe ∇θ Σ_compared v ℓ) of W itself;
    ``check_state``: also refuse non-trainable state the (training-mode) pass updates and
    losses it adds (``add_loss``)."""
    v = _row_weights(_max_rows(batch, probes))
    rows = num_rows(batch[0])
    weights = [_weights_on(p.compared, v[p.compared], rows) if gradients and p.weighted else None for p in probes]
    scopes = [] if check_state else None
    values, base_gradients = _evaluate(model, per_example_loss, batch, training, draw, weights, scopes)
    if check_state:
        _require_no_added_losses(model, scopes[0][0])
        _require_no_state_updates(model, scopes[0])
    return values, weights, base_gradients


def _max_rows(batch, probes: list) -> int:
    return max([num_rows(batch[0]), *(num_rows(p.batch[0]) for p in probes)])


def _require_rows_unmoved(model, per_example_loss, batch, probes: list, training: bool, draw: int, base) -> None:
    """For each probe: f(X')_kept = f(X)_compared (outputs, ℓ, and ∇θ Σ_compared v ℓ), same randomness."""
    v = _row_weights(_max_rows(batch, probes))
    values, base_weights, base_gradients = base
    for probe, base_weight, before_gradient in zip(probes, base_weights, base_gradients):
        weights = _weights_on(probe.kept, v[probe.compared], num_rows(probe.batch[0])) \
            if before_gradient is not None else None
        after, (after_gradient,) = _evaluate(model, per_example_loss, probe.batch, training, draw, [weights])
        moved = _moved(values, after, probe) or _gradient_moved(before_gradient, after_gradient, probe)
        if moved:
            layer = _culprit(model, per_example_loss, batch, probe, training, draw, base_weight, weights)
            _raise_mixing(probe, moved, layer, training)


def _weights_on(rows: np.ndarray, values: np.ndarray, size: int) -> np.ndarray:
    weights = np.zeros(size, np.float32)
    weights[rows] = values
    return weights


def _moved(base: list, after: list, probe: _Probe) -> Optional[str]:
    """'the output of example j' for the first compared row whose values moved, else None."""
    for (what, before), (_, now) in zip(base, after):
        same = _rows_equal(before[probe.compared], now[probe.kept], exact=probe.same_size)
        if not same.all():
            return f"the {what} of example {int(probe.compared[np.flatnonzero(~same)[0]])}"
    return None


def _gradient_moved(before: Optional[np.ndarray], after: Optional[np.ndarray], probe: _Probe) -> Optional[str]:
    """‖g' − g‖ ≤ tol·‖g‖ for g = ∇θ Σ_compared v_j ℓ_j (tolerance: the backward sums rows
    in another order when B changes, or adds exact zeros); skipped if either is not finite."""
    if before is None or after is None or not (np.isfinite(before).all() and np.isfinite(after).all()):
        return None
    if np.linalg.norm(after - before) <= SIZE_TOLERANCE * np.linalg.norm(before) + 1e-30:
        return None
    return f"the gradient of the other examples' losses (rows {_rows_text(probe.compared)})"


def _rows_equal(before: np.ndarray, after: np.ndarray, exact: bool) -> np.ndarray:
    """Per row: all values equal (NaN = NaN), or within the size tolerance of the row's scale."""
    before, after = before.reshape(len(before), -1), after.reshape(len(after), -1)
    same = _same(before, after)
    if exact or not np.issubdtype(before.dtype, np.inexact):
        return same.all(axis=1)
    tolerance = max(SIZE_TOLERANCE, 32 * float(np.finfo(before.dtype).eps))
    b, a = before.astype(np.float64), after.astype(np.float64)
    finite = np.isfinite(b) & np.isfinite(a)
    scale = np.max(np.where(finite, np.abs(b), 0.0), axis=1, keepdims=True) if b.size else 0.0
    close = finite & (np.abs(a - b) <= tolerance * (np.abs(b) + scale))
    return (same | close).all(axis=1)


def _raise_mixing(probe: _Probe, moved: str, layer: Optional[str], training: bool):
    where = f" The first layer where it happens: {layer}." if layer else ""
    raise ValueError(
        f"The model mixes examples: {probe.what} of a batch changed {moved} (training={training}).{where} "
        "Per-example clipping bounds one example's influence only if each example's output, loss and gradient "
        "depend on that example alone — not on the other rows nor on how many rows the batch has. Remove or replace "
        "the layer (or loss) that combines rows of the batch or reads its size — batch statistics "
        "(BatchNormalization → GroupNormalization/LayerNormalization), x - mean(x, axis=0), tf.shape(x)[0], "
        "MixUp/CutMix, attention or pooling across the batch axis, tf.roll/gather along it — or make it act on each "
        "example separately."
    )


# ------------------------------------------------------------ naming the layer
@contextlib.contextmanager
def _recording(model, tape):
    """Records (layer, inputs, output) of every layer call inside ``model``, in completion
    order; the floating inputs are watched by ``tape`` (so input gradients exist)."""
    records = []

    def recorded(layer, original):
        def call(*args, **kwargs):
            inputs = [t for t in tf.nest.flatten((args, kwargs)) if tf.is_tensor(t)]
            tape.watch([t for t in inputs if t.dtype.is_floating])
            output = original(*args, **kwargs)
            records.append((layer, inputs, [t for t in tf.nest.flatten(output) if tf.is_tensor(t)]))
            return output
        return call

    with calls_wrapped(model, lambda layer: layer is not model, recorded):
        yield records


def _layer_trace(model, per_example_loss, batch, training, draw, weights):
    """Per layer call: (layer, input values, output values, input gradients, output gradients)
    of Σ weights_j ℓ_j, rows first (gradients None without a loss)."""
    x, y = batch
    with tf.GradientTape(persistent=True) as tape, _recording(model, tape) as records:
        with keras.StatelessScope(state_mapping=_pinned_state(model, draw)):
            outputs = model(x, training=training)
            total = None
            if weights is not None:
                total = _weighted_loss(per_example_loss, y, outputs, weights)
        trace = []
        for layer, inputs, outs in records:
            input_grads = output_grads = None
            if total is not None:
                input_grads = _gradients(tape, total, inputs)
                output_grads = _gradients(tape, total, outs)
            trace.append((layer, [np.asarray(t) for t in inputs], [np.asarray(t) for t in outs], input_grads,
                          output_grads))
        del tape
    return trace


def _gradients(tape, total, tensors) -> list:
    float_tensors = [t if t.dtype.is_floating else None for t in tensors]
    watched = [t for t in float_tensors if t is not None]
    grads = iter(tape.gradient(total, watched, unconnected_gradients=tf.UnconnectedGradients.ZERO) if watched else [])
    return [None if t is None else np.asarray(next(grads)) for t in float_tensors]


def _culprit(model, per_example_loss, batch, probe: _Probe, training, draw, base_weights, weights) -> Optional[str]:
    """The innermost layer whose compared rows' outputs move while its inputs do not, whose
    input gradient moves while its output gradient does not, or that sends gradient into a
    row of weight 0 while none arrives at its output; 'the loss' if only ℓ moves."""
    try:
        before = _layer_trace(model, per_example_loss, batch, training, draw, base_weights)
        after = _layer_trace(model, per_example_loss, probe.batch, training, draw, weights)
    except Exception:  # noqa: BLE001 - naming the layer is a courtesy; the refusal stands
        return None
    suspects = [layer for (layer, *b), (_, *a) in zip(before, after) if _layer_moves(b, a, probe, base_weights)]
    if suspects:
        innermost = min(suspects, key=lambda layer: len(list(layer._flatten_layers())))
        return f"'{innermost.name}' ({type(innermost).__name__})"
    if before and all(_leaves_match(b[1], a[1], probe) for b, a in zip(before, after)):
        return "the loss (no layer's output moved)"
    return None


def _layer_moves(before, after, probe: _Probe, base_weights) -> bool:
    inputs, outputs, input_grads, output_grads = before
    inputs_after, outputs_after, input_grads_after, output_grads_after = after
    if _leaves_match(inputs, inputs_after, probe) and not _leaves_match(outputs, outputs_after, probe):
        return True
    if input_grads is None or input_grads_after is None:
        return False
    if _leaves_match(output_grads, output_grads_after, probe, tolerant=True) and not _leaves_match(
            input_grads, input_grads_after, probe, tolerant=True):
        return True
    if base_weights is not None:  # rows of weight 0 must receive no gradient
        silent = np.flatnonzero(base_weights == 0)
        if len(silent) and _all_zero(output_grads, silent) and not _all_zero(input_grads, silent):
            return True
    return False


def _leaves_match(before: list, after: list, probe: _Probe, tolerant: bool = False) -> bool:
    """Every leaf with a batch axis agrees on the compared rows (others are skipped)."""
    rows = _num_rows_or_none
    for b, a in zip(before, after):
        if b is None or a is None or rows(b) is None or rows(a) is None:
            continue
        if rows(b) <= int(probe.compared.max()) or rows(a) <= int(probe.kept.max()):
            continue
        if not _rows_equal(b[probe.compared], a[probe.kept], exact=probe.same_size and not tolerant).all():
            return False
    return True


def _num_rows_or_none(a: np.ndarray) -> Optional[int]:
    return int(a.shape[0]) if a.ndim else None


def _all_zero(leaves: list, rows: np.ndarray) -> bool:
    return all(g is None or _num_rows_or_none(g) is None or g.shape[0] <= rows.max() or not np.any(g[rows])
               for g in leaves)


def _first_batch(dataset: tf.data.Dataset):
    element = next(iter(dataset.take(1)))
    x, y, _ = keras.utils.unpack_x_y_sample_weight(element)
    return x, y


def _as_numpy(structure):
    return tf.nest.map_structure(np.asarray, structure)


def _take(structure, indices: np.ndarray):
    return tf.nest.map_structure(lambda a: None if a is None else a[indices], structure)


def _row_values(model, per_example_loss, batch, training: bool, draw: int = 0) -> list[tuple[str, np.ndarray]]:
    """(name, values) of every output leaf and of ℓ, batch axis first (see ``_evaluate``)."""
    return _evaluate(model, per_example_loss, batch, training, draw, [])[0]


def _evaluate(model, per_example_loss, batch, training: bool, draw: int, weightings: list, scopes=None):
    """One forward pass under a StatelessScope pinning all model variables to their current
    values, the seed states shifted by ``draw`` (identical randomness for equal ``draw``, no
    state updated). Returns the (name, values) of every output leaf and of ℓ, and for each
    weight vector w in ``weightings`` (or None) the flat float64 ∇θ Σ_j w_j ℓ_j (None if an
    op has no gradient). ``scopes``: a list that receives the StatelessScope (its updates and,
    then collected, the losses layers added)."""
    x, y = batch
    with_loss = per_example_loss is not None and y is not None
    watched = {id(v): tf.convert_to_tensor(v.value) for v in model.trainable_variables} \
        if with_loss and any(w is not None for w in weightings) else {}
    mapping = [(v, watched.get(id(v), value)) for v, value in _pinned_state(model, draw)]
    tape = tf.GradientTape(persistent=True, watch_accessed_variables=False) if watched else contextlib.nullcontext()
    with tape:
        if watched:
            tape.watch(list(watched.values()))
        with keras.StatelessScope(state_mapping=mapping, collect_losses=scopes is not None) as scope:
            outputs = model(x, training=training)
            values = [("output", np.asarray(o)) for o in tf.nest.flatten(outputs)]
            totals = [None] * len(weightings)
            if with_loss:
                losses = per_example_loss(tf.nest.map_structure(tf.convert_to_tensor, y), outputs)
                values.append(("loss", np.asarray(losses)))
                totals = [None if w is None else _weighted_sum(losses, w) for w in weightings]
    if scopes is not None:
        scopes.append((scope, mapping))
    gradients = [None if total is None else _parameter_gradient(tape, total, list(watched.values()))
                 for total in totals]
    del tape
    return values, gradients


def _parameter_gradient(tape, total, parameters: list) -> Optional[np.ndarray]:
    try:
        return _flat(tape.gradient(total, parameters, unconnected_gradients=tf.UnconnectedGradients.ZERO))
    except LookupError:  # an op without a registered gradient: values only
        return None


def _weighted_loss(per_example_loss, y, outputs, weights: np.ndarray):
    return _weighted_sum(per_example_loss(tf.nest.map_structure(tf.convert_to_tensor, y), outputs), weights)


def _weighted_sum(losses, weights: np.ndarray):
    """Σ_j w_j ℓ_j (a loss with more values per example: summed over them)."""
    losses = tf.cast(losses, tf.float32)
    losses = tf.reshape(losses, [tf.shape(losses)[0], -1])
    return tf.reduce_sum(losses * tf.constant(weights, tf.float32)[:, None])


def _flat(gradients) -> np.ndarray:
    dense = [tf.convert_to_tensor(g) for g in gradients]  # an embedding table's IndexedSlices too
    return np.concatenate([np.ravel(np.asarray(g, np.float64)) for g in dense]) if dense else np.zeros(0)


def _require_no_state_updates(model, scope_and_mapping) -> None:
    """Refuses non-trainable variables that a training-mode call updates (running means,
    counters, caches): such state is an exact, un-noised function of the private batches,
    saved with the model and outside ε. ``scope_and_mapping``: the pinned pass's scope."""
    scope, pinned = scope_and_mapping
    seeds = _seed_states(model)
    updated = [v.path for v, value in pinned
               if id(v) not in seeds and not v.trainable
               and not np.array_equal(np.asarray(scope.get_current_value(v)), np.asarray(value))]
    if updated:
        raise ValueError(
            f"This model updates non-trainable state from the training batch ({', '.join(updated)}): that state is "
            "an exact function of private examples, released with the model without noise. Remove the update (or "
            "make the layer stateless), as for BatchNormalization's moving statistics.")


def _require_no_added_losses(model, scope) -> None:
    """Refuses layers that call ``add_loss`` in the training forward pass: the DP step
    clips and noises the per-example loss only, so such a term would be dropped (a loss on
    batch data would be an unclipped, un-noised function of private rows if it were kept).
    ``scope``: the training-mode pass's StatelessScope, which collected the added losses."""
    if not scope.losses:
        return
    added = {id(loss) for loss in scope.losses}
    layers = [layer for layer in model._flatten_layers(include_self=True)
              if added & set(getattr(layer, "_loss_ids", ()))]
    names = ", ".join(f"'{layer.name}' ({type(layer).__name__})" for layer in layers) or "a layer of the model"
    raise ValueError(
        f"{names} calls add_loss() in the training forward pass. The DP step clips and noises each example's loss "
        "from compile(loss=...) only, so an added loss would be silently dropped (and a loss computed from the "
        "batch would be neither clipped nor noised). Fix: remove the add_loss call — for a penalty on weights use "
        "a weight regularizer (kernel_regularizer=..., applied after the noise); for a per-example term, return it "
        "as an extra model output and add it to that example's loss.")


def _seed_states(model) -> set:
    return {id(generator.state) for layer in model._flatten_layers(include_self=True)
            for generator in getattr(layer, "_seed_generators", [])}


def _pinned_state(model, draw: int) -> list:
    seeds = _seed_states(model)
    return [(v, v.value + tf.cast(draw, v.dtype) if id(v) in seeds else v.value) for v in model.variables]


def _reproducible_mode(model, per_example_loss, batch, first: list) -> Optional[bool]:
    """training=True if a second pinned training-mode call agrees bit for bit with ``first``,
    else training=False if two inference calls agree, else None."""
    for training in (True, False):
        if training is False:
            first = _row_values(model, per_example_loss, batch, training)
        second = _row_values(model, per_example_loss, batch, training)
        if all(_same(a, b).all() for (_, a), (_, b) in zip(first, second)):
            return training
    return None


def _same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise a == b, NaN equal to NaN."""
    equal = a == b
    if np.issubdtype(a.dtype, np.inexact):
        equal |= np.isnan(a) & np.isnan(b)
    return equal


def _donor(head, k: int, count: int, m: int, offset: int = 0) -> Optional[int]:
    """The index of an example whose x or y differs from example k's: first among the head
    rows after W (from a position that varies with k and ``offset``), then among W's rows
    after k; None if every example equals it."""
    row = _take(head, np.array([k]))
    pool = list(range(m, count))
    if pool:
        start = (k + 7 * offset) % len(pool)
        pool = pool[start:] + pool[:start]
    candidates = pool + [(k + 1 + i) % m for i in range(m - 1)]
    for index in candidates:
        other = _take(head, np.array([index]))
        leaves = zip(tf.nest.flatten(row), tf.nest.flatten(other))
        if any(a is not None and not np.array_equal(a, b) for a, b in leaves):
            return index
    return None


def _replace_row(batch, k: int, donor):
    def replace(rows, new_row):
        if rows is None:
            return None
        changed = rows.copy()
        changed[k] = new_row[0]
        return changed

    return tf.nest.map_structure(replace, batch, donor)


def _padding_row(column):
    """One padding row of ``column`` as a Poisson chunk pads it: zeros, or empty strings for text."""
    if column is None:
        return None
    column = np.asarray(column)
    if column.dtype == object or column.dtype.kind in "SU":
        return np.full(column[:1].shape, "" if column.dtype.kind == "U" else b"", dtype=column.dtype)
    return np.zeros_like(column[:1])


@contextlib.contextmanager
def _refusing_a_fixed_batch_size(model, head):
    """Re-raises an error of the probes' forward passes as a refusal naming the model's
    fixed batch size, when the model runs on one batch size only (e.g. keras.io's switch
    transformer reshapes to a hard-coded batch_size): DP batches vary in size. Any other
    error propagates unchanged."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - re-raised as is unless the batch size is fixed
        fixed = _fixed_batch_size(model, head[0])
        if fixed is None:
            raise
        summary = _error_summary(error)
        raise ValueError(
            f"{model.name} runs only on batches of exactly {fixed} examples: its graph fixes the batch size (e.g. "
            f"a reshape to a hard-coded batch_size, or keras.Input(batch_size={fixed})). DP training cannot keep "
            f"it: Poisson batches have a random size, padded to a physical width, and tf_dp's row-independence "
            f"check runs the model on batches of {GUARD_ROWS} and of other sizes (it failed: {summary}). Fix: write "
            "the model for any batch size — take it from the tensor (keras.ops.shape(x)[0]) or reshape with -1 "
            "(keras.ops.reshape(x, (-1, embed_dim)) rather than (batch_size * num_tokens, embed_dim)) — and give "
            "keras.Input no batch_size.") from error


def _fixed_batch_size(model, x, largest: int = GUARD_ROWS + DONOR_SEARCH) -> Optional[int]:
    """The one batch size ``model`` runs on: the static batch dimension of its symbolic
    inputs or outputs, else the only size in 1..``largest`` at which it runs on rows of
    ``x``; None if there is none (or several)."""
    symbolic = [tensor.shape[0] for tensor in tf.nest.flatten([getattr(model, "inputs", None) or [],
                                                                getattr(model, "outputs", None) or []])
                if getattr(tensor, "shape", None) is not None and len(tensor.shape)]
    static = {size for size in symbolic if size is not None}
    if len(static) == 1:
        return static.pop()
    runs = []
    for size in range(1, min(largest, num_rows(x)) + 1):
        if _runs_on(model, _take(x, np.arange(size))):
            runs.append(size)
            if len(runs) > 1:  # two sizes run: the batch size is not fixed (a model that mixes rows, say)
                return None
    return runs[0] if runs else None


def _runs_on(model, x) -> bool:
    try:
        model(x, training=False)
    except Exception:  # noqa: BLE001 - any failure means "not on this batch size"
        return False
    return True


def _error_summary(error: Exception) -> str:
    """The first line of ``error`` that says what failed, without TF's markup."""
    text = re.sub(r"\x1b\[[0-9;]*m|\{\{[^}]*\}\}|\s*\[Op:[^\]]*\]", "", str(error))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return next((line for line in lines if "shape" in line.lower()), lines[0] if lines else type(error).__name__)

