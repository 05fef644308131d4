import os
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seeded():
    keras.utils.set_random_seed(1234)
    yield


SLOW_TESTS = Path(__file__).with_name("slow_tests.txt")
FILE_SECONDS = Path(__file__).with_name("file_seconds.txt")


def pytest_configure(config):
    """Under pytest-xdist's ``--dist loadfile`` the files are handed out in collection order
    (see ``longest_files_first``), not re-sorted by their number of tests."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """Marks `slow` the tests listed in slow_tests.txt (those that took > 20 s in a full run on 2
    cores; regenerate it from `--durations=0`): `bash scripts/test.sh --fast` leaves them out.
    Then puts the longest files first (``longest_files_first``)."""
    if SLOW_TESTS.exists():
        slow = {line.strip() for line in SLOW_TESTS.read_text().splitlines()
                if line.strip() and not line.startswith("#")}
        for item in items:
            if item.nodeid in slow or item.nodeid.split("[")[0] in slow:
                item.add_marker(pytest.mark.slow)
    longest_files_first(items, file_seconds())


def file_seconds() -> dict:
    """{test file name: seconds its tests took in a full run}, read from file_seconds.txt
    (lines ``seconds file_name``; regenerate with tools/file_seconds.py)."""
    if not FILE_SECONDS.exists():
        return {}
    rows = [line.split() for line in FILE_SECONDS.read_text().splitlines() if line.strip() and line[0] != "#"]
    return {name: float(seconds) for seconds, name in rows}


def longest_files_first(items: list, seconds: dict) -> None:
    """Reorders ``items`` in place so that whole files come longest first, each file's tests in
    their own order. With ``--dist loadfile`` the two processes take the next file as they get
    free: longest first (LPT scheduling) leaves only short files for the end, where one process
    would otherwise run a long file alone. A file not in ``seconds`` (new or renamed) counts as
    the median file."""
    known = sorted(seconds.values())
    typical = known[len(known) // 2] if known else 0.0
    files = list(dict.fromkeys(item.path for item in items))
    rank = {path: i for i, path in enumerate(sorted(files, key=lambda path: -seconds.get(path.name, typical)))}
    position = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (rank[item.path], position[id(item)]))
