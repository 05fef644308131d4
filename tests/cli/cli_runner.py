"""Runs several `tf-dp` commands in one Python process (one TensorFlow start-up for all of them).

Each command runs as ``python -m tf_dp.cli ARGS`` runs it: ``sys.argv`` set, then
``tf_dp.cli.run()`` (absl's ``app.run``), its exit code taken from ``SystemExit``, its printed
output and error text captured; absl's flags are reset between commands.
"""

import json
import pathlib
import subprocess
import sys
import types

ROOT = pathlib.Path(__file__).resolve().parents[2]
DRIVER = """
import contextlib, io, json, sys
from tf_dp import cli
sys.modules["__main__"].__doc__ = cli.__doc__  # as under -m tf_dp.cli: absl's usage text is __main__'s docstring
results = []
for args in json.loads(sys.argv[1]):
    sys.argv = ["tf-dp", *args]
    stdout, stderr, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = cli.run() or 0
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    cli.FLAGS.unparse_flags()
    results.append({"returncode": code, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()})
print("RESULTS " + json.dumps(results))
"""


def run_cli_commands(commands: list, timeout: float = 600) -> list:
    """[`tf-dp ARGS` for ARGS in ``commands``] as namespaces with returncode, stdout and stderr."""
    run = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(commands)], capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    return [types.SimpleNamespace(**result) for result in json.loads(run.stdout.split("RESULTS ")[-1])]
