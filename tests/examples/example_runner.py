"""Runs example (or benchmark) scripts one after the other in this one process (one TensorFlow
start-up for all).

    python tests/examples/example_runner.py '[["mnist_dpsgd", "--epochs=1", ...], ...]'

Each run imports examples/NAME.py (or benchmarks/NAME.py), parses its flags (absl) and calls its
main, as ``python examples/NAME.py FLAGS`` does through ``app.run(main)``; the flags the example defined
and its module are removed afterwards, so the next run (the same example or another) starts
from its defaults. Prints ``MARKER I`` before run I and ``FAILED_MARKER I`` with the traceback
after it if it raised (``split_runs`` cuts the output at the markers).
"""

import json
import pathlib
import sys
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[2]
MARKER = "=== example run"
FAILED_MARKER = "!!! example run failed"


def run(name: str, flag_values: list) -> None:
    """Runs examples/``name``.py's main with ``flag_values``, then forgets its flags and module."""
    import importlib

    from absl import flags

    known = set(flags.FLAGS)
    try:
        module = importlib.import_module(name)
        flags.FLAGS([name, *flag_values])
        module.main([name])
    finally:
        for flag in set(flags.FLAGS) - known:
            delattr(flags.FLAGS, flag)
        sys.modules.pop(name, None)


def split_runs(stdout: str, count: int) -> list:
    """The printed output of each of ``count`` runs; a failed run's carries FAILED_MARKER."""
    chunks = stdout.split(MARKER + " ")[1:]
    assert len(chunks) == count, stdout[-3000:]
    return [chunk.split("\n", 1)[1] if "\n" in chunk else "" for chunk in chunks]


def main(runs: list) -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "benchmarks")]  # this tree's
    # The flags of absl's logging, TensorFlow and tf_dp are defined once, before any run: only
    # the example's own flags are removed after it.
    import absl.logging  # noqa: F401

    import tf_dp  # noqa: F401

    for index, (name, *flag_values) in enumerate(runs):
        print(f"{MARKER} {index}", flush=True)
        try:
            run(name, flag_values)
        except Exception:  # reported to the test of this run; the next runs still run
            print(f"{FAILED_MARKER} {index}\n{traceback.format_exc()}", flush=True)
        sys.stdout.flush()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
