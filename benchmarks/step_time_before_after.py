"""Step time of two source trees of tf_dp, timed in alternating subprocess runs.

Two versions of the ``tf_dp`` package cannot be imported in one process, so each run is
``PYTHONPATH=<tree> python benchmarks/step_time.py --models=<m> ...`` (this tree's
step_time.py, which uses only the public ``DPModel`` / ``DPSGD`` / ``FIBER``), and the runs
alternate old, new, new, old, ... (ABBA, so a linear drift of the shared machine's load
cancels). Each run reports its DP-SGD and FIBER ratios to a non-private Keras step timed
in the same process (the ratio normalises machine load); the figure compared is the
median ratio per tree, and ``new / old`` is the regression (1.00 = none).

    python benchmarks/step_time_before_after.py --old_tree=/tmp/old_main
    python benchmarks/step_time_before_after.py --old_tree=/tmp/old_main --models=mlp --alternations=6
    python benchmarks/step_time_before_after.py --old_tree=/tmp/old_main --ops_only   # graphs only, no timing

It also counts the operations of each tree's traced DP-SGD and FIBER ``train_step`` graph
by type (``--count_ops``, default on): where two trees' graphs hold the same operations,
a timing difference between them is the machine's, not the code's.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/record.py, also when loaded by path
from record import write_json  # noqa: E402  (writes the command, commit, machine and date)

FLAGS = flags.FLAGS
flags.DEFINE_string("old_tree", None, "Root of the 'before' source tree (holds tf_dp/).", required=True)
flags.DEFINE_string("new_tree", os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    "Root of the 'after' source tree (default: this tree).")
flags.DEFINE_list("models", ["mlp", "cnn", "transformer"], "Models, as in step_time.py.")
flags.DEFINE_integer("alternations", 4, "ABBA pairs: each tree runs this many times per model.")
flags.DEFINE_integer("batch_size", 256, "Batch size.")
flags.DEFINE_integer("rounds", 3, "Alternating rounds inside one step_time.py run.")
flags.DEFINE_integer("steps", 20, "Steps per timing inside one step_time.py run.")
flags.DEFINE_bool("count_ops", True, "Also count each tree's traced train_step operations by type.")
flags.DEFINE_bool("ops_only", False, "Only count operations (no timing).")
flags.DEFINE_string("output", "benchmarks/results/step_time_before_after.json", "Where to write the JSON.")

STEP_TIME = os.path.join(os.path.dirname(os.path.abspath(__file__)), "step_time.py")
FIGURES = ("ratio", "fiber_ratio", "plain_ms", "dp_ms", "fiber_ms")


def _run(tree, model):
    """One step_time.py run of `model` importing tf_dp from `tree`; returns its result dict."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        output = f.name
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), TF_CPP_MIN_LOG_LEVEL="2")
    command = [sys.executable, STEP_TIME, f"--models={model}", f"--batch_size={FLAGS.batch_size}",
               f"--rounds={FLAGS.rounds}", f"--steps={FLAGS.steps}", f"--output={output}"]
    done = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"step_time.py failed in {tree}:\n{done.stderr[-3000:]}")
    with open(output) as f:
        result = json.load(f)["results"][0]
    os.remove(output)
    return {k: result[k] for k in FIGURES}


# Run in a child process (flags of step_time.py, tf_dp from the child's PYTHONPATH): the
# traced DPModel.train_step of DP-SGD and FIBER, its operations counted by type (no Const).
COUNT_OPS = """
import collections, json, sys
import keras, numpy as np, tensorflow as tf
import step_time, tf_dp
model_name = sys.argv[1]
step_time.FLAGS([sys.argv[0], "--batch_size=" + sys.argv[2]])
x, y = step_time._inputs(model_name), np.random.randint(0, 2, int(sys.argv[2]))
optimizers = {"dp_sgd": lambda: tf_dp.DPSGD(0.1, noise_multiplier=1.0, seed=2**40),
              "fiber": lambda: tf_dp.FIBER(1e-3, noise_multiplier=1.0, seed=2**40)}
counts = {}
for kind, make in optimizers.items():
    model = tf_dp.DPModel(*getattr(step_time, model_name)())
    model.compile(optimizer=make(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.train_on_batch(x, y, batch_size=len(y))  # builds the model and the optimizer
    graph = tf.function(model.train_step).get_concrete_function((tf.constant(x), tf.constant(y))).graph
    counts[kind] = dict(collections.Counter(op.type for op in graph.get_operations() if op.type != "Const"))
print(json.dumps(counts))
"""


def _count_ops(tree, model):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(tree), os.path.dirname(STEP_TIME)]),
               TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, "-c", COUNT_OPS, model, str(FLAGS.batch_size)],
                          env=env, cwd=tree, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"counting ops failed in {tree}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ops_difference(old, new):
    """{optimizer: {"old_total", "new_total", "differing": {op type: [old, new]}}}."""
    result = {}
    for kind in old:
        types = sorted(set(old[kind]) | set(new[kind]))
        result[kind] = {"old_total": sum(old[kind].values()), "new_total": sum(new[kind].values()),
                        "differing": {t: [old[kind].get(t, 0), new[kind].get(t, 0)] for t in types
                                      if old[kind].get(t, 0) != new[kind].get(t, 0)}}
    return result


def _order(pair):
    """ABBA: old, new on even pairs, new, old on odd ones."""
    return ("old", "new") if pair % 2 == 0 else ("new", "old")


def _summary(runs):
    """Median of each figure per tree, and new / old of the medians."""
    medians = {tree: {k: statistics.median(r[k] for r in runs if r["tree"] == tree) for k in FIGURES}
               for tree in ("old", "new")}
    return {"old": medians["old"], "new": medians["new"],
            "dp_sgd_new_over_old": medians["new"]["ratio"] / medians["old"]["ratio"],
            "fiber_new_over_old": medians["new"]["fiber_ratio"] / medians["old"]["fiber_ratio"]}


def main(argv):
    del argv
    trees = {"old": FLAGS.old_tree, "new": FLAGS.new_tree}
    runs, summaries, ops = [], {}, {}
    if FLAGS.count_ops or FLAGS.ops_only:
        for model in FLAGS.models:
            ops[model] = _ops_difference(_count_ops(trees["old"], model), _count_ops(trees["new"], model))
            print(f"ops {model}: {json.dumps(ops[model])}", flush=True)
    if FLAGS.ops_only:
        _write(runs, summaries, ops)
        return
    print("| model | DP-SGD/plain old | new | new/old | FIBER/plain old | new | new/old |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for model in FLAGS.models:
        model_runs = []
        for pair in range(FLAGS.alternations):
            for tree in _order(pair):
                r = dict(_run(trees[tree], model), tree=tree, model=model, pair=pair)
                print(f"  {model} {tree}: DP-SGD {r['ratio']:.3f}x FIBER {r['fiber_ratio']:.3f}x "
                      f"(plain {r['plain_ms']:.1f} ms)", file=sys.stderr, flush=True)
                model_runs.append(r)
        s = summaries[model] = _summary(model_runs)
        runs += model_runs
        print(f"| {model} | {s['old']['ratio']:.3f} | {s['new']['ratio']:.3f} | {s['dp_sgd_new_over_old']:.3f} | "
              f"{s['old']['fiber_ratio']:.3f} | {s['new']['fiber_ratio']:.3f} | {s['fiber_new_over_old']:.3f} |",
              flush=True)
        _write(runs, summaries, ops)  # after each model: a long run killed midway keeps what it measured


def _write(runs, summaries, ops):
    write_json(FLAGS.output, {"date": time.strftime("%Y-%m-%d %H:%M"), "old_tree": FLAGS.old_tree,
                              "new_tree": FLAGS.new_tree, "batch_size": FLAGS.batch_size, "rounds": FLAGS.rounds,
                              "steps": FLAGS.steps, "alternations": FLAGS.alternations,
                              "load_average": os.getloadavg(), "summary": summaries, "operations": ops,
                              "runs": runs}, indent=2)


if __name__ == "__main__":
    app.run(main)
