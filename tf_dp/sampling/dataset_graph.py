"""One door for tf.data pipelines: an ALLOW-list of operations that keep one element per example.

DP-SGD's sensitivity C assumes each person contributes at most ONE clipped gradient to a released
sum (docs/algorithms.md §1), and Poisson sampling's rate q = L/N assumes N counts people. A
pipeline that presents one example twice (``repeat``, ``concatenate`` of itself, overlapping
``window``\\s), or that mixes examples into one row (MixUp after ``batch``, a batch-level ``map``
that concatenates two views, ``scan``), breaks both. Rather than recognise known-bad idioms, the
door accepts only pipelines built SOLELY from operations that provably keep one element per
example (docs/algorithms.md §1.4), and names every other operation it finds:

* per example (an unbatched dataset read as a source of N examples, and the part of a batched
  pipeline before its last ``batch()``): ``from_tensor_slices``, ``from_tensors``, ``range``,
  ``TFRecordDataset``/``TextLineDataset``/``FixedLengthRecordDataset`` of distinct file names, a
  ``zip`` of such sources taken row by row (each branch a source seen through order-keeping ops and
  deterministic maps, or one tensor repeated forever, ``from_tensors(c).repeat()``, which pairs
  ``c`` with every row as a map capturing ``c`` would: the shape of
  ``keras.utils.timeseries_dataset_from_array``), ``map``, ``filter``, ``shuffle``, ``take``,
  ``skip``, ``shard``, ``cache``, ``prefetch``, ``ignore_errors``, ``with_options``,
  ``assert_cardinality`` (``repeat(1)`` too);
* on whole batches (after the last ``batch``/``padded_batch``/``map_and_batch``, or every op of a
  pipeline of pre-batched slices): ``prefetch``, ``cache``, ``repeat``, ``shuffle``, ``take``,
  ``skip``, ``shard``, ``ignore_errors``, ``with_options``, ``assert_cardinality``. A ``map`` or
  ``filter`` on whole batches is refused: it can mix or copy examples across rows.

What no graph can show stays the caller's promise: that row i of the arrays (or record i of a
file) is a different person's example for every i, and that a ``map`` looking rows up in captured
data (``range(N).map(lambda i: x[i])``) reads each row once.

The verdict is read from the dataset's serialized graph (``read_graph``); a fast Python pass over
the dataset objects (``_python_accepts``, itself an allow-list of the same rules) skips the
serialization, which takes seconds for a large in-memory ``from_tensor_slices``. Anything the fast
pass does not accept goes to the graph, which has the last word.
"""

from __future__ import annotations

import re
from typing import Optional

import numpy as np
import tensorflow as tf
from google.protobuf.message import DecodeError

_DATASET_OP = re.compile(r"Dataset(V\d+)?$")
_VERSION = re.compile(r"(?<=Dataset)V\d+$")

# The kinds of allowed operation.
SOURCE = "source"            # element i is row i of its tensors (a leaf)
KEEPS = "keeps"              # every element once, in order, unchanged
SELECTS = "selects"          # each element at most once (reordered or dropped)
PER_ELEMENT = "per_element"  # one element in, at most one out: per example only, never on whole batches
BATCHES = "batches"          # ends the per-example part: above it, elements are batches
REPEATS = "repeats"          # on whole batches only (repeat(0) and repeat(1) anywhere)
ZIPS = "zips"                # bare sources zipped row by row: per example only
READS_FILES = "reads_files"  # each record of distinct files once

GRAPH_OPS = {  # graph op (without its version suffix) -> kind; every other op is refused
    "TensorSliceDataset": SOURCE, "TensorDataset": SOURCE, "RangeDataset": SOURCE,
    "PrefetchDataset": KEEPS, "CacheDataset": KEEPS, "OptionsDataset": KEEPS, "ModelDataset": KEEPS,
    "MaxIntraOpParallelismDataset": KEEPS, "PrivateThreadPoolDataset": KEEPS, "AssertCardinalityDataset": KEEPS,
    "ShuffleDataset": SELECTS, "TakeDataset": SELECTS, "SkipDataset": SELECTS, "ShardDataset": SELECTS,
    "IgnoreErrorsDataset": SELECTS,
    "MapDataset": PER_ELEMENT, "ParallelMapDataset": PER_ELEMENT, "FilterDataset": PER_ELEMENT,
    "BatchDataset": BATCHES, "PaddedBatchDataset": BATCHES, "ParallelBatchDataset": BATCHES,
    "MapAndBatchDataset": BATCHES,
    "RepeatDataset": REPEATS,
    "ZipDataset": ZIPS,
    # "FlatMapDataset": READS_FILES only when its function is one file reader of the element (_reads_files)
}
FILE_READERS = ("TFRecordDataset", "TextLineDataset", "FixedLengthRecordDataset")

PYTHON_CLASSES = {  # the fast pass: tf.data's Python classes of the same ops (anything else: read the graph)
    "_TensorSliceDataset": SOURCE, "_TensorDataset": SOURCE, "_RangeDataset": SOURCE,
    "_PrefetchDataset": KEEPS, "CacheDataset": KEEPS, "_CacheDataset": KEEPS, "_OptionsDataset": KEEPS,
    "_ModelDataset": KEEPS, "_MaxIntraOpParallelismDataset": KEEPS, "_PrivateThreadPoolDataset": KEEPS,
    "_AssertCardinalityDataset": KEEPS, "_RestructuredDataset": KEEPS,
    "_ShuffleDataset": SELECTS, "_TakeDataset": SELECTS, "_SkipDataset": SELECTS, "_ShardDataset": SELECTS,
    "_IgnoreErrorsDataset": SELECTS,
    "_MapDataset": PER_ELEMENT, "_ParallelMapDataset": PER_ELEMENT, "_FilterDataset": PER_ELEMENT,
    "_BatchDataset": BATCHES, "_PaddedBatchDataset": BATCHES, "_ParallelBatchDataset": BATCHES,
    "_MapAndBatchDataset": BATCHES,
    "_RepeatDataset": REPEATS,
    "_ZipDataset": ZIPS,
}

ALLOWED_PER_EXAMPLE = ("from_tensor_slices, from_tensors, range, TFRecordDataset/TextLineDataset/"
                       "FixedLengthRecordDataset of distinct files, a zip of such sources taken row by row, map, "
                       "filter, shuffle, "
                       "take, skip, shard, cache, prefetch, ignore_errors, with_options, assert_cardinality")
ALLOWED_ON_BATCHES = ("prefetch, cache, repeat, shuffle, take, skip, shard, ignore_errors, with_options, "
                      "assert_cardinality")

# What the user wrote, for the message (graph op without its version suffix -> Dataset method).
_METHODS = {
    "RepeatDataset": "repeat", "WindowDataset": "window", "UnbatchDataset": "unbatch", "FlatMapDataset": "flat_map",
    "InterleaveDataset": "interleave", "ParallelInterleaveDataset": "interleave",
    "LegacyParallelInterleaveDataset": "parallel_interleave", "ConcatenateDataset": "concatenate",
    "ZipDataset": "zip", "DirectedInterleaveDataset": "sample_from_datasets/choose_from_datasets",
    "RebatchDataset": "rebatch", "GroupByWindowDataset": "group_by_window/bucket_by_sequence_length",
    "GroupByReducerDataset": "group_by_reducer", "ScanDataset": "scan", "SnapshotDataset": "snapshot",
    "UniqueDataset": "unique", "RandomDataset": "Dataset.random", "ShuffleAndRepeatDataset": "shuffle_and_repeat",
    "TakeWhileDataset": "take_while", "MapDataset": "map", "ParallelMapDataset": "map", "FilterDataset": "filter",
    "BatchDataset": "batch", "PaddedBatchDataset": "padded_batch", "ParallelBatchDataset": "batch",
    "MapAndBatchDataset": "map_and_batch", "GeneratorDataset": "from_generator", "LoadDataset": "Dataset.load",
    "DenseToSparseBatchDataset": "sparse_batch", "SlidingWindowDataset": "sliding_window_batch",
    "DataServiceDataset": "distribute", "SamplingDataset": "sampling", "ListSnapshotChunksDataset": "snapshot",
}


class _Graph:
    """A dataset's serialized GraphDef: its nodes by name and its output node(s)."""

    def __init__(self, graph_def):
        self.nodes = {node.name: node for node in graph_def.node}
        self.outputs = [self.inputs(node) for node in graph_def.node if node.op == "_Retval"]
        self.outputs = [node for inputs in self.outputs for node in inputs]
        self.library = {function.signature.name: function for function in graph_def.library.function}
        self.deterministic = True  # the dataset's options: maps keep their order unless set False

    def inputs(self, node, datasets_only: bool = True) -> list:
        names = (name.split(":")[0] for name in node.input if not name.startswith("^"))
        found = [self.nodes[name] for name in names if name in self.nodes]
        return [n for n in found if _DATASET_OP.search(n.op)] if datasets_only else found

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
        tensor = inputs[position].attr["value"].tensor
        if tensor.dtype == tf.string.as_datatype_enum:  # strings may be packed in tensor_content
            return tf.io.parse_tensor(tensor.SerializeToString(), tf.string).numpy()
        return tf.make_ndarray(tensor)

    def function_of(self, node):
        """The function (FunctionDef) a flat_map/interleave-like ``node`` applies, or None."""
        return self.library.get(node.attr["f"].func.name) if "f" in node.attr else None


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


# ---------------------------------------------------------------------- the door
def refused_operations(dataset: tf.data.Dataset, batched: bool) -> list:
    """Every operation of ``dataset`` outside the allow-list, each named as the user wrote it
    (its Dataset method, and the graph op in brackets); empty when the pipeline is accepted.

    Args:
      dataset: the tf.data pipeline fit was given.
      batched: its elements are batches (trained as explicit batches): the ops after its last
        batch op act on whole batches. Otherwise every element is one example.

    Returns:
      A list of descriptions, outermost operation first (a pipeline whose graph tf.data cannot
      serialize is one entry: nothing in it can be checked)."""
    if _python_accepts(dataset, batched):
        return []  # no need to serialize the graph (seconds for a large in-memory dataset)
    return refused_by_graph(dataset, batched)


def refused_by_graph(dataset: tf.data.Dataset, batched: bool) -> list:
    """``refused_operations`` read from the serialized graph alone (no fast pass)."""
    graph = read_graph(dataset)
    if graph is None or not graph.outputs:
        return ["a pipeline whose graph tf.data cannot serialize (none of its operations can be checked)"]
    graph.deterministic = dataset.options().deterministic is not False
    found, seen = [], set()
    for output in graph.outputs:
        found += _graph_refusals(graph, output, batched, seen)
    return list(dict.fromkeys(found))


def _problem(kind: Optional[str], on_batches: Optional[bool]) -> Optional[str]:
    """Why an op of ``kind`` is refused where it stands (None: allowed there). ``on_batches``:
    True where elements are batches, False where they are examples, None below a refused op
    (elements of unknown meaning: read as examples, a batch op not held against them)."""
    if kind is None:
        return "not on the allow-list"
    if kind == PER_ELEMENT and on_batches:
        return "applied to whole batches (it can mix or copy examples across rows)"
    if kind == BATCHES and on_batches is False:
        return "whose batches are not the elements trained on"
    if kind == REPEATS and not on_batches:
        return "not on whole batches (it can present one example several times)"
    if kind == ZIPS and on_batches:
        return "of batched datasets"
    return None


def _mode_below(kind: Optional[str], problem: Optional[str], on_batches: Optional[bool]) -> Optional[bool]:
    """What the elements of an op's inputs are: examples below a batch op, unknown below a refused op."""
    if problem:
        return None
    return False if kind == BATCHES else on_batches


def _base(op: str) -> str:
    return _VERSION.sub("", op)


def _python_accepts(dataset, batched: bool) -> bool:
    """The fast pass: True when every dataset object of the pipeline is one of tf.data's own
    classes in ``PYTHON_CLASSES``, allowed where it stands; False means "read the graph"."""
    stack, seen = [(dataset, batched)], set()
    while stack:
        node, on_batches = stack.pop()
        if (id(node), on_batches) in seen:
            continue
        seen.add((id(node), on_batches))
        kind = PYTHON_CLASSES.get(type(node).__name__)
        if not type(node).__module__.startswith("tensorflow.") or _problem(kind, on_batches):
            return False
        try:
            inputs = list(node._inputs())
        except (NotImplementedError, AttributeError, TypeError):  # an unknown dataset class: the graph decides
            return False
        if kind == ZIPS and not all(_python_bare_source(branch) for branch in inputs):
            return False
        if kind == PER_ELEMENT and _python_captures_variables(node):
            return False  # a function holding variables: the graph tells whether it carries state
        stack.extend((n, _mode_below(kind, None, on_batches)) for n in inputs)
    return True


def _python_captures_variables(node) -> bool:
    """Whether a map/filter's traced function captures a resource (a variable), or cannot be read."""
    wrapped = getattr(node, "_map_func", None) or getattr(node, "_predicate", None)
    try:
        captured = wrapped.function.captured_inputs
    except AttributeError:
        return True
    return any(t.dtype == tf.resource for t in captured)


def _python_bare_source(node) -> bool:
    kind = PYTHON_CLASSES.get(type(node).__name__)
    if kind == SOURCE:
        return True
    if kind != KEEPS or not type(node).__module__.startswith("tensorflow."):
        return False
    inputs = list(node._inputs())
    return len(inputs) == 1 and _python_bare_source(inputs[0])


def _graph_refusals(graph: _Graph, node, on_batches: Optional[bool], seen: set) -> list:
    """The refused ops at and upstream of ``node`` (``on_batches``: its elements are batches)."""
    if (node.name, on_batches) in seen:
        return []
    seen.add((node.name, on_batches))
    base, inputs = _base(node.op), graph.inputs(node)
    kind = READS_FILES if _reads_files(graph, node) else GRAPH_OPS.get(base)
    problem = _problem(kind, on_batches)
    if kind == REPEATS and problem and _repeat_count(graph, node) in (0, 1):
        problem = None
    if kind == ZIPS and not problem:
        if _row_wise(graph, node) != ROW:
            problem = ("of branches that are not sources taken row by row (a filter, shuffle or non-deterministic "
                       "map before the zip can pair row i with row j: zip the sources first, then map)")
        else:  # a constant broadcast to every row (from_tensors(c).repeat()) is read like a captured tensor
            inputs = [branch for branch in inputs if _row_wise(graph, branch) != CONSTANT]
    if kind == PER_ELEMENT and not problem and _carries_state(graph, node):
        problem = ("whose function writes a tf.Variable from the element it reads (state carried from one element "
                   "into the next mixes examples: compute each element from itself alone)")
    if kind == READS_FILES:
        problem, inputs = _file_names_problem(graph, inputs[0]), []  # the file names' branch is checked there
    found = [_describe(graph, node, base, problem)] if problem else []
    for upstream in inputs:
        found += _graph_refusals(graph, upstream, _mode_below(kind, problem, on_batches), seen)
    return found


def _is_state_write(op: str) -> bool:
    return (op.startswith("Assign") and op.endswith("VariableOp")) or op.startswith(
        ("ResourceScatter", "ResourceStridedSliceAssign", "ResourceApply"))


def _carries_state(graph: _Graph, node) -> bool:
    """Whether a map/filter's function writes a variable with a value computed from its element
    (``prev.assign(x)``: a ``scan`` in disguise). Writes independent of the element — a random
    layer's seed counter — keep each element a function of itself and stay allowed."""
    function = graph.library.get(next((node.attr[a].func.name for a in ("f", "predicate") if a in node.attr), ""))
    if function is None:
        return False
    captured = len(node.attr["Targuments"].list.type) if "Targuments" in node.attr else 0
    arguments = [arg.name for arg in function.signature.input_arg]
    return _writes_from(graph, function, set(arguments[:len(arguments) - captured]), depth=0)


def _writes_from(graph: _Graph, function, element: set, depth: int) -> bool:
    """Whether ``function`` writes a variable with a value depending on the ``element`` arguments,
    through the calls it makes (a call it cannot read counts as a write)."""
    body = {n.name: n for n in function.node_def}
    memo: dict = {}

    def depends(name: str) -> bool:
        name = name.lstrip("^").split(":")[0]
        if name in element:
            return True
        if name not in body:
            return False
        if name not in memo:
            memo[name] = False  # cycles (none in a FunctionDef) end here
            memo[name] = any(depends(i) for i in body[name].input if not i.startswith("^"))
        return memo[name]

    for n in function.node_def:
        data = [i for i in n.input if not i.startswith("^")]
        if _is_state_write(n.op) and any(depends(i) for i in data[1:]):
            return True
        callee = n.attr["f"].func.name if "f" in n.attr else ""
        if callee and any(depends(i) for i in data):
            inner = graph.library.get(callee)
            if inner is None or depth > 8:
                return True
            names = [arg.name for arg in inner.signature.input_arg]
            if _writes_from(graph, inner, {names[k] for k, i in enumerate(data) if k < len(names) and depends(i)},
                            depth + 1):
                return True
    return False


def _describe(graph: _Graph, node, base: str, problem: str) -> str:
    if base == "FlatMapDataset" and _generator(graph, node):
        return ("from_generator() (a Python generator: tf_dp cannot check that it yields each example once; "
                "pass arrays or a random-access source)")
    if _reads_files(graph, node):
        reader = next(n.op for n in graph.function_of(node).node_def if _DATASET_OP.search(n.op))
        return f"{_base(reader)} ({reader} {problem})"
    method = _METHODS.get(base)
    name = f"{method}()" if method else node.op
    if base == "RepeatDataset" and (_repeat_count(graph, node) or -1) >= 0:
        name = f"repeat({_repeat_count(graph, node)})"
    where = "" if problem == "not on the allow-list" else f", {problem}"
    return f"{name} ({node.op}{where})"


def _repeat_count(graph: _Graph, node) -> Optional[int]:
    count = graph.constant(node, 1)
    return None if count is None else int(count)


ROW, CONSTANT = "row", "constant"


def _row_wise(graph: _Graph, node) -> Optional[str]:
    """ROW if element i of ``node`` is computed from row i of its sources alone (sources seen
    through ops that keep every element in order, deterministic maps that carry no state, and
    zips of such branches with at least one ROW branch); CONSTANT for one tensor repeated
    forever (``from_tensors(c).repeat()``, which a zip pairs with every row, as a map would
    capture ``c``: keras.utils.timeseries_dataset_from_array's shape); else None."""
    kind, upstream = GRAPH_OPS.get(_base(node.op)), graph.inputs(node)
    if kind == SOURCE:
        return ROW
    if kind == REPEATS and len(upstream) == 1 and _repeat_count(graph, node) == -1:
        return CONSTANT if _single_tensor(graph, upstream[0]) else None
    if kind == ZIPS:
        branches = [_row_wise(graph, branch) for branch in upstream]
        return ROW if ROW in branches and all(b in (ROW, CONSTANT) for b in branches) else None
    ordered_map = _base(node.op) in ("MapDataset", "ParallelMapDataset") and _deterministic(graph, node) \
        and not _carries_state(graph, node)
    if (kind == KEEPS or ordered_map) and len(upstream) == 1:
        return _row_wise(graph, upstream[0])
    return None


def _single_tensor(graph: _Graph, node) -> bool:
    """``from_tensors(c)`` (one element), seen through ops that keep it."""
    kind, upstream = GRAPH_OPS.get(_base(node.op)), graph.inputs(node)
    if _base(node.op) == "TensorDataset":
        return True
    return kind == KEEPS and len(upstream) == 1 and _single_tensor(graph, upstream[0])


def _deterministic(graph: _Graph, node) -> bool:
    """A map keeps its elements' order: not ``deterministic=False``, nor by the dataset's options."""
    setting = node.attr["deterministic"].s.decode() if "deterministic" in node.attr else "default"
    return setting == "true" or (setting == "default" and graph.deterministic)


def _reads_files(graph: _Graph, node) -> bool:
    """A flat_map whose function is one file reader of its element (TFRecordDataset(files) and
    its kin): each record of each file once."""
    function = graph.function_of(node) if _base(node.op) == "FlatMapDataset" else None
    if function is None or len(function.signature.input_arg) != 1 or node.attr["Targuments"].list.type:
        return False
    datasets = [n for n in function.node_def if _DATASET_OP.search(n.op)]
    argument = function.signature.input_arg[0].name
    return (len(datasets) == 1 and _base(datasets[0].op) in FILE_READERS
            and datasets[0].input[0].split(":")[0] == argument)


def _file_names_problem(graph: _Graph, node) -> Optional[str]:
    """None if the file names a reader reads are distinct constants (seen through ops that
    keep or select names), else why not."""
    kind = GRAPH_OPS.get(_base(node.op))
    upstream = graph.inputs(node)
    if kind in (KEEPS, SELECTS) and len(upstream) == 1:
        return _file_names_problem(graph, upstream[0])
    names = graph.constant(node, 0) if kind == SOURCE and _base(node.op) == "TensorSliceDataset" else None
    if names is None:
        return "of file names tf_dp cannot check for repeats (pass a list of distinct file names)"
    names = np.asarray(names).reshape(-1)
    if len(set(names.tolist())) < len(names):
        return "reading the same file more than once"
    return None


def _generator(graph: _Graph, node) -> bool:
    function = graph.function_of(node)
    return function is not None and any(_base(n.op) == "GeneratorDataset" for n in function.node_def)


# ---------------------------------------------------------------------- Keras' dataset utilities
TIMESERIES = "keras.utils.timeseries_dataset_from_array"
_DECODERS = {  # an op of a map's function -> the Keras utility whose pipeline reads files with it
    "DecodeWav": "keras.utils.audio_dataset_from_directory",
    **{op: "keras.utils.image_dataset_from_directory"
       for op in ("DecodeImage", "DecodePng", "DecodeJpeg", "DecodeBmp", "DecodeGif")},
}


def keras_utility(dataset: tf.data.Dataset) -> Optional[str]:
    """The Keras dataset utility whose pipeline shape ``dataset`` has, or None: windows read
    from one array (``timeseries_dataset_from_array``: a range zipped with one tensor repeated),
    or files read from a list of paths (``audio_``/``image_``/``text_dataset_from_directory``,
    told apart by the decoder their map applies). Read from the Python dataset objects (no
    serialization). For messages only: no verdict depends on it.

    Args:
      dataset: a tf.data pipeline.

    Returns:
      The utility's name (e.g. "keras.utils.image_dataset_from_directory"), or None.
    """
    nodes = _reachable(dataset, _python_inputs)
    names = [[type(n).__name__ for n in _python_inputs(node)] for node in nodes
             if type(node).__name__ == "_ZipDataset"]
    if any("_RangeDataset" in branches and "_RepeatDataset" in branches for branches in names):
        return TIMESERIES
    ops = {op for node in nodes for op in _map_ops(node)}
    found = sorted({utility for op, utility in _DECODERS.items() if op in ops})
    if found:
        return found[0]
    return "keras.utils.text_dataset_from_directory" if "ReadFile" in ops else None


def _reachable(root, parents) -> list:
    """``root`` and every node reachable through ``parents(node)``, each once."""
    nodes, stack, seen = [], [root], set()
    while stack:
        node = stack.pop()
        if id(node) not in seen:
            seen.add(id(node))
            nodes.append(node)
            stack.extend(parents(node))
    return nodes


def _python_inputs(node) -> list:
    try:
        return list(node._inputs())
    except (NotImplementedError, AttributeError, TypeError):
        return []


def _map_ops(node) -> set:
    """The op types of a map's traced function (empty for any other dataset)."""
    wrapped = getattr(node, "_map_func", None)
    try:
        return {op.type for op in wrapped.function.graph.get_operations()}
    except AttributeError:
        return set()


def keras_utility_note(dataset: tf.data.Dataset, batched: bool) -> str:
    """A sentence naming the Keras utility ``dataset`` comes from and what to pass it instead
    (``batch_size=None``, for Poisson sampling), with the privacy unit of overlapping windows;
    "" for a pipeline of no known utility.

    Args:
      dataset: the tf.data pipeline fit was given.
      batched: its elements are batches.

    Returns:
      The sentence (with a leading space), or "".
    """
    utility = keras_utility(dataset)
    if utility is None:
        return ""
    note = (f" This pipeline is {utility}'s: call it with batch_size=None and give fit batch_size=L, so that its "
            "examples are Poisson-sampled (amplified ε)." if batched
            else f" This pipeline is {utility}'s: each of its elements is one example.")
    if utility == TIMESERIES:
        note += (" Its examples are WINDOWS: the privacy unit is one window, and a raw record shared by k "
                 "overlapping windows (k = ⌈sequence_length·sampling_rate / sequence_stride⌉) is protected only at "
                 "group size k (group privacy; docs/algorithms.md §1.4); sequence_stride ≥ "
                 "sequence_length·sampling_rate makes the windows disjoint (k = 1).")
    return note


# ---------------------------------------------------------------------- grain MapDataset
def grain_duplicating_idioms(dataset) -> list:
    """Duplication idioms of a grain ``MapDataset`` chain (walked through ``parents``): a
    repeat, a concatenate/mix of the same source, or more elements than distinct records."""
    nodes = _reachable(dataset, _grain_parents)
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
