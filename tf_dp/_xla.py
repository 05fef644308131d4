"""Whether the graph being traced is compiled by XLA (some kernels are chosen by it)."""

from __future__ import annotations


def compiling_with_xla() -> bool:
    """True inside ``tf.function(jit_compile=True)`` (or a model compiled with ``jit_compile``)."""
    try:
        from tensorflow.python.framework import ops
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # private TF modules moved: assume XLA, take the routes that are safe under it
        return True
    return control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph())
