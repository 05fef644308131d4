"""Writes tests/file_seconds.txt (seconds per test file, longest first) from the output of a
full run with ``--durations=0``; tests/conftest.py hands the files out longest first.

    python -m pytest tests -n 2 --dist loadfile --durations=0 > run.log
    python tools/file_seconds.py run.log [older.log ...]   # a file missing from run.log: the next log's figure
"""

from __future__ import annotations

import collections
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
DURATION = re.compile(r"^\s*([0-9.]+)s (?:setup|call|teardown)\s+(\S+?\.py)::")
HEADER = """# Seconds each test file took (setup + call + teardown of its tests) in a full run on 2 cores,
# longest first; tests/conftest.py hands the files to the test processes in this order.
# Regenerate: python tools/file_seconds.py LOG [OLDER_LOG ...] (outputs of pytest --durations=0).
"""


def file_seconds(log: str) -> dict[str, float]:
    """{test file name: summed durations} from ``--durations=0`` lines of ``log``.

    Args:
      log: pytest's output.

    Returns:
      Seconds per file name (the name only: files keep their weight when they move).
    """
    totals = collections.Counter()
    for line in log.splitlines():
        match = DURATION.match(line)
        if match:
            totals[pathlib.Path(match.group(2)).name] += float(match.group(1))
    return dict(totals)


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: python tools/file_seconds.py LOG [OLDER_LOG ...] (outputs of pytest --durations=0)")
    totals = {}
    for log in argv[1:]:
        found = file_seconds(pathlib.Path(log).read_text())
        if not found:
            raise SystemExit(f"{log} has no --durations lines: run pytest with --durations=0")
        totals = {**found, **totals}
    rows = [f"{seconds:.1f} {name}\n" for name, seconds in sorted(totals.items(), key=lambda kv: -kv[1])]
    (ROOT / "tests" / "file_seconds.txt").write_text(HEADER + "".join(rows))


if __name__ == "__main__":
    main(sys.argv)
