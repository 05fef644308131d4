"""The README's Python code blocks run, so they cannot rot."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_readme_python_blocks_execute():
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert blocks, "README has no python blocks"
    for block in blocks:
        namespace = {}
        exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102
        model = namespace.get("model")
        if model is not None and hasattr(model, "get_epsilon"):
            assert 0 < model.get_epsilon() < 10
