"""docs/results.md is generated from benchmarks/results/ (tools/results_page.py), every result
file records its command, commit, machine and date (benchmarks/record.py), every result file is
on the page, and nothing refers to a result file that is gone."""

import json
import pathlib
import re
import runpy
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
FIELDS = {"command", "commit", "machine", "date"}


@pytest.fixture(scope="module")
def page():
    return runpy.run_path(str(ROOT / "tools" / "results_page.py"))


@pytest.fixture(scope="module")
def record():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        yield runpy.run_path(str(ROOT / "benchmarks" / "record.py"))
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def result_files():
    return sorted(p for p in RESULTS.rglob("*") if p.suffix in (".json", ".jsonl"))


def test_committed_results_page_is_what_the_command_writes(page):
    assert (ROOT / "docs" / "results.md").read_text() == page["render"](), (
        "docs/results.md is stale: run `python tools/results_page.py`")


def test_check_flag_fails_on_a_stale_page(page, tmp_path, monkeypatch):
    stale = tmp_path / "results.md"
    stale.write_text("# Results\n\nan old figure\n")
    main = page["main"]
    monkeypatch.setitem(main.__globals__, "PAGE", stale)
    assert main(["--check"]) == 1
    assert stale.read_text() == "# Results\n\nan old figure\n"  # --check writes nothing
    stale.write_text(page["render"]())
    assert main(["--check"]) == 0


def _records(path: pathlib.Path) -> list[dict]:
    if path.suffix == ".jsonl":
        return [json.loads(line).get("record", {}) for line in path.read_text().splitlines() if line.strip()]
    data = json.loads(path.read_text())
    if "record" in data:
        return [data["record"]]
    return [row.get("record", {}) for row in data["runs"]]


@pytest.mark.parametrize("path", result_files(), ids=lambda p: str(p.relative_to(RESULTS)))
def test_every_result_records_command_commit_machine_and_date(path):
    for entry in _records(path):
        assert FIELDS <= set(entry), f"{path.name}: record lacks {FIELDS - set(entry)}"
        assert re.fullmatch(r"[0-9a-f]{40}( \(uncommitted changes\))?", entry["commit"]), entry["commit"]
        assert re.match(r"\d{4}-\d{2}-\d{2}", entry["date"]), entry["date"]
        assert not re.search(r"seed[\w-]*[= ]+\d", entry["command"]), "a seed must never be recorded"


def test_every_result_file_is_on_the_results_page(page):
    used = set()
    template = (ROOT / "tools" / "results_template.md").read_text()
    for name in re.findall(r"^<!-- table: (\w+) -->$", template, re.MULTILINE):
        used |= set(page["TABLES"][name]()[1])
    present = {str(p.relative_to(RESULTS)) for p in result_files()}
    assert present - used == set(), "result files on no table: show them or `git rm` them if superseded"


def test_no_document_or_test_names_a_result_file_that_is_gone():
    texts = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").rglob("*.md"),
             *(ROOT / "tools").glob("*.md"), *(ROOT / "tests").rglob("*.py")]  # (scripts name where they write)
    missing = set()
    for path in texts:
        for name in re.findall(r"benchmarks/results/([\w./-]+\.(?:jsonl?|md|png|log))", path.read_text()):
            if not (RESULTS / name).exists():
                missing.add(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, sorted(missing)


def test_record_leaves_every_seed_out(record):
    command = record["command"](["benchmarks/x.py", "--noise_seed=982451653", "--seed", "7", "--epochs=2"])
    assert "982451653" not in command and " 7" not in command
    assert command.endswith("--noise_seed=NOT_RECORDED --seed NOT_RECORDED --epochs=2")


def test_write_json_and_append_jsonl_add_the_record(record, tmp_path):
    record["write_json"](str(tmp_path / "a" / "r.json"), {"ms": 1.5})
    written = json.loads((tmp_path / "a" / "r.json").read_text())
    assert written["ms"] == 1.5 and FIELDS <= set(written["record"])
    for value in (1, 2):
        record["append_jsonl"](str(tmp_path / "r.jsonl"), {"run": value})
    lines = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [row["run"] for row in lines] == [1, 2] and all(FIELDS <= set(row["record"]) for row in lines)
