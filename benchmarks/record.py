"""Provenance of a benchmark result: the command, the commit, the machine and the date.

Every benchmark script writes its JSON through :func:`write_json` (one object) or
:func:`append_jsonl` (one line per run), which add a ``"record"`` entry::

    {"command": "python benchmarks/step_time.py --batch_size=256",
     "commit": "f10e440…" (+ " (uncommitted changes)" when the tree differs from it),
     "machine": "2 CPUs, AMD EPYC 7B13, Linux 6.1, Python 3.12, TensorFlow 2.21.0",
     "date": "2026-12-03 13:40 UTC"}

``tools/results_page.py`` turns these files into docs/results.md. The command never carries a
seed: the value of every flag whose name contains "seed" is replaced by ``NOT_RECORDED``
(a known noise seed voids the guarantee of the run it seeded).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIDDEN = "NOT_RECORDED"
_SEED_FLAG = re.compile(r"^(--?[\w.-]*seed[\w.-]*)(=.*)?$", re.IGNORECASE)


def command(argv: list[str] | None = None) -> str:
    """The command line that ran, relative to the repository root, seeds left out.

    Args:
      argv: the arguments (default ``sys.argv``); ``argv[0]`` is the script.

    Returns:
      ``"python <script> <flags>"`` with the value of every seed flag replaced.
    """
    argv = list(sys.argv if argv is None else argv)
    script = os.path.relpath(os.path.abspath(argv[0]), ROOT) if argv else "?"
    words, hide_next = [], False
    for word in argv[1:]:
        if hide_next:
            words.append(HIDDEN)
            hide_next = False
            continue
        match = _SEED_FLAG.match(word)
        if match and match.group(2):
            word = f"{match.group(1)}={HIDDEN}"
        elif match:
            hide_next = True
        words.append(word)
    return shlex.join(["python", script, *words])


def commit() -> str:
    """The checkout's commit, marked when the working tree has uncommitted changes.

    Returns:
      The 40-digit commit id (or ``"unknown"`` outside a git checkout).
    """
    def git(*args):
        return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, check=False)

    head = git("rev-parse", "HEAD")
    if head.returncode != 0:
        return "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    return head.stdout.strip() + (" (uncommitted changes)" if dirty else "")


def machine() -> str:
    """The CPUs, operating system and Python/TensorFlow versions of this machine.

    Returns:
      One line, e.g. ``"2 CPUs, AMD EPYC 7B13, Linux 6.1, Python 3.12, TensorFlow 2.21.0"``.
    """
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        model = names[0] if names else model
    except OSError:
        pass
    parts = [f"{os.cpu_count()} CPUs", model, f"{platform.system()} {platform.release().split('-')[0]}",
             f"Python {platform.python_version()}"]
    if "tensorflow" in sys.modules:
        parts.append(f"TensorFlow {sys.modules['tensorflow'].__version__}")
    return ", ".join(parts)


def record(argv: list[str] | None = None) -> dict:
    """The provenance entry a result file carries under ``"record"``.

    Args:
      argv: the command's arguments (default ``sys.argv``).

    Returns:
      ``{"command", "commit", "machine", "date"}`` (date in UTC).
    """
    return {"command": command(argv), "commit": commit(), "machine": machine(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def write_json(path: str, payload: dict, indent: int = 1) -> None:
    """Writes ``payload`` and its ``"record"`` to ``path`` (replacing the file).

    Args:
      path: the JSON file (its directory is created).
      payload: the figures (a dict; its own ``"record"`` key, if any, is replaced).
      indent: JSON indentation.
    """
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({**payload, "record": record()}, f, indent=indent)
        f.write("\n")


def append_jsonl(path: str, row: dict) -> dict:
    """Appends ``row`` and its ``"record"`` as one line of the JSON-lines file ``path``.

    Args:
      path: the JSON-lines file (created with its directory if absent).
      row: the figures of one run.

    Returns:
      The row as written (with its record).
    """
    row = {**row, "record": record()}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    return row
