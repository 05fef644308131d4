"""BUILD lists every module and every test: regenerate with tools/update_build.py."""

import pathlib
import re
import runpy

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_build_file_is_in_sync_with_the_tree():
    render = runpy.run_path(str(ROOT / "tools" / "update_build.py"))["render"]
    assert (ROOT / "BUILD").read_text() == render(), "BUILD is stale: run `python tools/update_build.py`."


def test_every_module_and_test_has_a_target():
    build = (ROOT / "BUILD").read_text()
    listed = set(re.findall(r'"((?:tf_dp|tests)/[^"]+\.py)"', build))
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "tf_dp").rglob("*.py")}
    tests = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")}
    assert modules | tests <= listed


def test_build_graph_has_no_cycles():
    """Bazel rejects dependency cycles between targets."""
    build = (ROOT / "BUILD").read_text()
    graph = {}
    for block in build.split("\n\n"):
        name = re.search(r'name = "([^"]+)"', block)
        if name:
            graph[name.group(1)] = re.findall(r'":([^"]+)"', block)
    done = set()

    def visit(node, path):
        assert node not in path, f"cycle: {' -> '.join(path + [node])}"
        if node in done:
            return
        for dep in graph.get(node, []):
            assert dep in graph, f"{node} depends on unknown target {dep}"
            visit(dep, path + [node])
        done.add(node)

    for node in graph:
        visit(node, [])
