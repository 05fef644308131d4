"""Duplication idioms in a tf.data pipeline and in a grain ``MapDataset``, read from its graph.

DP-SGD's sensitivity C assumes each person contributes at most ONE clipped gradient to a
released sum (docs/algorithms.md §1). A pipeline that presents one example twice in one batch
(``ds.repeat().batch(L)``, ``ds.shuffle(n).repeat().batch(L)``, ``ds.concatenate(ds).batch(L)``)
clips each copy separately: that example moves the sum by up to k·C while the step is accounted
at C. For a random-access source a repeat counts each person k times in N, and the sampling rate
q = L/N understates theirs. What can be detected is refused; what cannot (two different objects
holding the same people) is the caller's promise: each example at most once per batch, once per
source.

For a batched dataset an op applied to whole batches cannot put duplicates into one batch:
``ds.batch(L).repeat()`` keeps each batch duplicate-free (each step a Gaussian mechanism at
sensitivity C, accounted without amplification) and stays allowed. Any other repeat is refused,
also where the batching is hidden from the graph (``bucket_by_sequence_length``, a ``window``
batched inside ``flat_map``), and so is a repeat of pre-batched slices (its soundness cannot
be told from a graph that shows no batch op).
"""

from __future__ import annotations

import hashlib
import re
from typing import Iterable, Optional

import tensorflow as tf
from google.protobuf.message import DecodeError

_DATASET_OP = re.compile(r"Dataset(V\d+)?$")
_MULTI_INPUT = ("ConcatenateDataset", "ZipDataset", "DirectedInterleaveDataset")
_FLAT_MAPS = ("FlatMapDataset", "InterleaveDataset", "ParallelInterleaveDataset")
# Element-wise, order-preserving ops: a zip of two such branches of one source pairs example i with itself.
_ONE_TO_ONE = ("MapDataset", "ParallelMapDataset", "PrefetchDataset", "OptionsDataset", "ModelDataset",
               "MaxIntraOpParallelismDataset", "PrivateThreadPoolDataset", "CacheDataset", "AssertCardinalityDataset")

_DESCRIPTIVE_ATTRS = ("metadata", "output_shapes", "output_types", "Toutput_types")


class _Graph:
    """A dataset's serialized GraphDef: its nodes by name and its output node(s)."""

    def __init__(self, graph_def):
        self.nodes = {node.name: node for node in graph_def.node}
        self.outputs = [self.inputs(node) for node in graph_def.node if node.op == "_Retval"]
        self.outputs = [node for inputs in self.outputs for node in inputs]
        self.functions = [node for function in graph_def.library.function for node in function.node_def]
        self.library = {function.signature.name: function for function in graph_def.library.function}
        self._fingerprints: dict = {}

    def inputs(self, node, datasets_only: bool = True) -> list:
        names = (name.split(":")[0] for name in node.input if not name.startswith("^"))
        found = [self.nodes[name] for name in names if name in self.nodes]
        return [n for n in found if _DATASET_OP.search(n.op)] if datasets_only else found

    def upstream(self, frontier: Iterable) -> list:
        """Every dataset node reachable from ``frontier`` (included), each once."""
        seen, stack = {}, list(frontier)
        while stack:
            node = stack.pop()
            if node.name not in seen:
                seen[node.name] = node
                stack.extend(self.inputs(node))
        return list(seen.values())

    def on_batches(self, node) -> bool:
        """Whether every path from ``node``'s inputs to a source meets a batching op before any
        unbatch: then ``node`` (a repeat, say) handles whole batches, never single examples."""
        frontier = self.inputs(node)
        return bool(frontier) and all(self._meets_batch(n) for n in frontier)

    def ends_in_batch(self) -> bool:
        """Whether every path from the output back to a source meets a batching op before any
        unbatch: then the dataset's elements are batches."""
        return bool(self.outputs) and all(self._meets_batch(n) for n in self.outputs)

    def _meets_batch(self, node) -> bool:
        op = node.op.lower()
        if "unbatch" in op:
            return False
        if "batch" in op:
            return True
        upstream = self.inputs(node)
        return bool(upstream) and all(self._meets_batch(n) for n in upstream)

    def constant(self, node, position: int):
        """The value of ``node``'s input ``position`` if it is a Const, else None."""
        inputs = self.inputs(node, datasets_only=False)
        if position >= len(inputs) or inputs[position].op != "Const":
            return None
        return tf.make_ndarray(inputs[position].attr["value"].tensor)

    def fingerprint(self, node, skip: tuple = ()) -> str:
        """A hash of ``node``'s op, attributes and inputs (recursively; ``skip``ped ops are
        seen through): two copies of one pipeline (``ds`` twice, or rebuilt from the same
        arrays) hash alike. Display names and element specs (``_DESCRIPTIVE_ATTRS``) are left out."""
        key = (node.name, skip)
        if key not in self._fingerprints:
            self._fingerprints[key] = self._hash(node, skip)
        return self._fingerprints[key]

    def _hash(self, node, skip: tuple) -> str:
        if skip and node.op.startswith(skip):
            upstream = self.inputs(node)
            if len(upstream) == 1:
                return self.fingerprint(upstream[0], skip)
        digest = hashlib.sha256(node.op.encode())
        for key in sorted(node.attr):
            if key not in _DESCRIPTIVE_ATTRS:
                digest.update(key.encode() + node.attr[key].SerializeToString(deterministic=True))
        for upstream in self.inputs(node, datasets_only=False):
            digest.update(self.fingerprint(upstream, skip).encode())
        return digest.hexdigest()

    def sources(self, node) -> set:
        """Fingerprints of the source datasets (no dataset input) ``node`` reads from."""
        return {self.fingerprint(n) for n in self.upstream([node]) if not self.inputs(n)}


def _is_batch(op: str) -> bool:
    op = op.lower()
    return "batch" in op and "unbatch" not in op


def read_graph(dataset: tf.data.Dataset) -> Optional[_Graph]:
    """The dataset's graph, or None when tf.data cannot serialize it (an op error, e.g. a
    graph over protobuf's 2 GB limit) or the bytes do not parse; other errors propagate."""
    try:
        graph_def = tf.compat.v1.GraphDef()
        graph_def.ParseFromString(dataset._as_serialized_graph().numpy())
    except (tf.errors.OpError, DecodeError):  # an unreadable graph is no fact
        return None
    return _Graph(graph_def)


def dataset_ends_in_batch(dataset: tf.data.Dataset) -> bool:
    """True iff every path from the dataset's output back to a source meets a batching
    transformation before any unbatch (read from the dataset's serialized graph; False when
    it cannot be read, or a batch is hidden inside a function such as flat_map's)."""
    graph = read_graph(dataset)
    return graph is not None and graph.ends_in_batch()


def duplicating_idioms(dataset: tf.data.Dataset, batched: bool) -> list:
    """Descriptions of every idiom in ``dataset`` that can present one example more than
    once: in one batch (``batched``: every op not applied to whole batches), or anywhere
    (an unbatched dataset read as a source of N examples), and the unreadable graph."""
    if _plainly_duplicate_free(dataset, batched):
        return []  # no need to serialize the graph (seconds for a large in-memory dataset)
    graph = read_graph(dataset)
    if graph is None:
        return ["a pipeline whose graph tf.data cannot serialize (so duplicates cannot be ruled out)"]
    nodes = graph.upstream(graph.outputs)
    # In a batched dataset an op on whole batches (ds.batch(L).repeat()) cannot put an example twice into one
    # batch; any other (upstream of a batch, or of no batch op we can see: bucketing, window + flat_map) may.
    unbatched = {n.name for n in graph.upstream(u for u in nodes if "unbatch" in u.op.lower())}
    region = [n for n in nodes if not (batched and graph.on_batches(n) and n.name not in unbatched)]
    found = [_repeat_idiom(graph, node) for node in region if node.op.startswith("RepeatDataset")]
    found += [_shared_source_idiom(graph, node) for node in region if node.op.startswith(_MULTI_INPUT)]
    zips = [n for n in nodes if n.op.startswith("ZipDataset") and n not in region]
    found += [_shared_source_idiom(graph, node) for node in zips]  # misaligned zips mix examples after a batch too
    found += [_captured_dataset_idiom(graph, node) for node in region if node.op.startswith(_FLAT_MAPS)]
    if any(node.op.startswith("RepeatDataset") for node in graph.functions):
        found.append("a repeat() inside a flat_map/interleave function")
    found += [_expanding_flat_map_idiom(graph, node) for node in region if node.op.startswith(_FLAT_MAPS)]
    if batched:
        found += [_batches_merged_idiom(graph, node) for node in nodes if _is_batch(node.op)]
        if any("unbatch" in node.op.lower() for node in nodes):
            found.append("unbatch() in a batched pipeline (a map before it can turn one example into several rows)")
    return sorted({idiom for idiom in found if idiom})


# Source and combining datasets that a flat_map/interleave function can use to yield an element
# (or its parts) more than once; a file reader (TFRecordDataset, ...) yields each record once.
_EXPANDING_OPS = ("TensorSliceDataset", "TensorDataset", "ConcatenateDataset", "ZipDataset", "RangeDataset")


def _expanding_flat_map_idiom(graph: _Graph, node) -> Optional[str]:
    """A flat_map/interleave whose function builds datasets from tensors (``from_tensor_slices``
    of a stacked element, ``from_tensors(e).concatenate(...)``): it can yield one example twice."""
    function = graph.library.get(node.attr["f"].func.name) if "f" in node.attr else None
    if function is not None and any(n.op.startswith(_EXPANDING_OPS) for n in function.node_def):
        return "flat_map/interleave whose function builds a dataset from tensors (it can yield an example twice)"
    return None


def _batches_merged_idiom(graph: _Graph, node) -> Optional[str]:
    """A batch/rebatch downstream of a repeat: ``ds.batch(L).repeat().rebatch(2L)`` merges
    copies of one batch into one (a repeat is allowed only on batches that stay batched)."""
    if any(n.op.startswith("RepeatDataset") for n in graph.upstream(graph.inputs(node))):
        return "a batch()/rebatch() after repeat() (it merges repeated batches into one)"
    return None


# Python dataset classes that present each input element at most once and build no dataset in a function.
_PLAIN = {"_TensorSliceDataset", "_TensorDataset", "_RangeDataset", "_MapDataset", "_ParallelMapDataset",
          "_FilterDataset", "_ShuffleDataset", "CacheDataset", "_CacheDataset", "_TakeDataset", "_SkipDataset",
          "_ShardDataset", "_PrefetchDataset", "_OptionsDataset", "_RestructuredDataset", "_ModelDataset",
          "_MaxIntraOpParallelismDataset", "_PrivateThreadPoolDataset", "_AssertCardinalityDataset",
          "_IgnoreErrorsDataset", "_BatchDataset", "_ParallelBatchDataset", "_PaddedBatchDataset"}
_PLAIN_BATCHES = {"_BatchDataset", "_ParallelBatchDataset", "_PaddedBatchDataset"}


def _plainly_duplicate_free(dataset, batched: bool) -> bool:
    """A fast, Python-level pass: True when every op of the pipeline is in ``_PLAIN``, or (for
    a batched dataset) is a repeat whose every input path meets a batch op; False means
    "read the serialized graph", not "duplicates"."""
    stack, seen = [dataset], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        name = type(node).__name__
        if name not in _PLAIN and not (batched and name == "_RepeatDataset" and _python_on_batches(node)):
            return False
        if name in _PLAIN_BATCHES and _python_repeat_upstream(node):
            return False  # a batch of repeated batches: the graph decides
        try:
            stack.extend(node._inputs())
        except (NotImplementedError, AttributeError, TypeError):  # an unknown dataset class: the graph decides
            return False
    return True


def _python_repeat_upstream(node) -> bool:
    try:
        inputs = node._inputs()
    except (NotImplementedError, AttributeError, TypeError):  # an unknown dataset class
        return True
    return any(type(n).__name__ == "_RepeatDataset" or _python_repeat_upstream(n) for n in inputs)


def _python_on_batches(node) -> bool:
    inputs = node._inputs()
    return bool(inputs) and all(type(n).__name__ in _PLAIN_BATCHES or _python_on_batches(n) for n in inputs)


def _repeat_idiom(graph: _Graph, node) -> Optional[str]:
    count = graph.constant(node, 1)
    if count is not None and int(count) in (0, 1):
        return None
    return "repeat()" if count is None or int(count) < 0 else f"repeat({int(count)})"


def _shared_source_idiom(graph: _Graph, node) -> Optional[str]:
    branches = graph.inputs(node)
    if node.op.startswith("DirectedInterleaveDataset"):
        branches = branches[1:]  # input 0 selects the branch
    sources = [graph.sources(branch) for branch in branches]
    shared = any(sources[i] & sources[j] for i in range(len(sources)) for j in range(i + 1, len(sources)))
    if not shared:
        return None
    if node.op.startswith("ZipDataset"):
        if _aligned(graph, branches):
            return None
        return "zip of branches of one dataset that do not pair each example with itself (skip, shuffle, ...)"
    if node.op.startswith("ConcatenateDataset"):
        return "concatenate of a dataset with itself (or with a copy of the same data)"
    return "sample_from_datasets/choose_from_datasets over the same dataset more than once"


def _aligned(graph: _Graph, branches: list) -> bool:
    """Branches that differ only by element-wise maps (no shuffle): example i pairs with itself."""
    if any(n.op.startswith("ShuffleDataset") for n in graph.upstream(branches)):
        return False
    return len({graph.fingerprint(branch, skip=_ONE_TO_ONE) for branch in branches}) == 1


def _captured_dataset_idiom(graph: _Graph, node) -> Optional[str]:
    """A flat_map/interleave whose function yields the same dataset for every outer element:
    one it captured, or one it builds from constants (``lambda _: from_tensor_slices(x)``)."""
    if len(graph.inputs(node)) > 1 or _builds_a_constant_dataset(graph, node):
        return "flat_map/interleave returning a captured dataset (each outer element yields all of it)"
    return None


def _builds_a_constant_dataset(graph: _Graph, node) -> bool:
    """Whether ``node``'s function holds a source dataset that depends on no outer element."""
    function = graph.library.get(node.attr["f"].func.name) if "f" in node.attr else None
    if function is None:
        return False
    captured = len(node.attr["Targuments"].list.type) if "Targuments" in node.attr else 0
    arguments = [arg.name for arg in function.signature.input_arg]
    element = set(arguments[:len(arguments) - captured])
    body = {n.name: n for n in function.node_def}

    def depends(name: str, seen: set) -> bool:
        name = name.lstrip("^").split(":")[0]
        if name in element:
            return True
        if name in seen or name not in body:
            return False
        seen.add(name)
        return any(depends(i, seen) for i in body[name].input if not i.startswith("^"))

    sources = [n for n in function.node_def if _DATASET_OP.search(n.op)
               and not any(i.split(":")[0] in body and _DATASET_OP.search(body[i.split(":")[0]].op) for i in n.input)]
    return any(not depends(n.name, set()) for n in sources)


# ---------------------------------------------------------------------- grain MapDataset
def grain_duplicating_idioms(dataset) -> list:
    """Duplication idioms of a grain ``MapDataset`` chain (walked through ``parents``): a
    repeat, a concatenate/mix of the same source, or more elements than distinct records."""
    nodes, stack, seen = [], [dataset], set()
    while stack:
        node = stack.pop()
        if id(node) not in seen:
            seen.add(id(node))
            nodes.append(node)
            stack.extend(_grain_parents(node))
    found = []
    for node in nodes:
        name = type(node).__name__
        parents = _grain_parents(node)
        if "Repeat" in name and parents and _length(node) != _length(parents[0]):
            found.append("a grain .repeat()")
        if len(parents) > 1:
            leaves = [_grain_leaves(parent) for parent in parents]
            if any(leaves[i] & leaves[j] for i in range(len(leaves)) for j in range(i + 1, len(leaves))):
                found.append(f"a grain {name} of the same source more than once")
    records = sum(_length(leaf) or 0 for leaf in {id(l): l for l in _grain_leaf_nodes(dataset)}.values())
    length = _length(dataset)
    if length is not None and records and length > records:
        found.append(f"a grain dataset of {length} elements over {records} distinct records")
    return sorted(set(found))


def is_grain_dataset(value) -> bool:
    return any(cls.__module__.startswith("grain") for cls in type(value).__mro__) and hasattr(value, "parents")


def _grain_parents(node) -> list:
    parents = getattr(node, "parents", None)
    return list(parents) if isinstance(parents, (list, tuple)) else []


def _grain_leaf_nodes(node) -> list:
    parents = _grain_parents(node)
    return [node] if not parents else [leaf for parent in parents for leaf in _grain_leaf_nodes(parent)]


def _grain_leaves(node) -> set:
    """Identities of the records a grain chain reads: its sources' underlying objects."""
    return {id(getattr(leaf, "_source", leaf)) for leaf in _grain_leaf_nodes(node)}


def _length(node) -> Optional[int]:
    try:
        return len(node)
    except Exception:  # noqa: BLE001 — an unsized grain dataset
        return None
