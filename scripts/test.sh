#!/usr/bin/env bash
# Install, then run the test suite (what CI runs); then the kernel-route tests again with oneDNN
# switched the other way (TensorFlow leaves it off on AMD, AVX2-only Intel, ARM and macOS CPUs,
# where some kernels, e.g. a grouped convolution's filter gradient, do not exist).
#
#   bash scripts/test.sh           the full suite (CI; 12.5–13.7 min for 1,175 tests + ~1–2 min oneDNN rerun on 2 idle cores here, 2026-12-02;
#                                  CI's machine took 1,834 s for 1,641 passed + 6 skipped on 2026-12-03; target ≤ 10 min on 2 idle cores)
#   bash scripts/test.sh --fast    the fast tier for development (tests not marked `slow`; target ≤ 3 min)
# Further arguments go to pytest, e.g. bash scripts/test.sh --fast -k ledger
set -euo pipefail
cd "$(dirname "$0")/.."
tier=()
if [ "${1:-}" = "--fast" ]; then tier=(-m "not slow"); shift; fi
bash scripts/install.sh --tests
processes="${TF_DP_TEST_PROCESSES:-2}"
# Lint first (ruff, config in pyproject.toml; `set -e` stops the script on findings).
echo "test.sh: lint (ruff)"
ruff check tf_dp tests examples benchmarks tools
# Two processes, one test file each at a time (module fixtures stay in one process): most of a
# test is single-threaded tracing, so two files overlap well on 2 cores. The files are handed out
# longest first (tests/file_seconds.txt, tests/conftest.py), so no long file is left to run alone
# at the end. The summary line gives the counts; --durations lists the slowest tests.
echo "test.sh: the suite ${tier[*]:+(fast tier) }on $processes processes"
python -m pytest tests -n "$processes" --dist loadfile --durations=15 "${tier[@]}" "$@"
# test_kernel_routes.py's route checks already run each oneDNN setting in a subprocess of its own
# (TF_ENABLE_ONEDNN_OPTS set there): only its in-process kernel probe depends on this switch.
# The engine and the rule files (tests/clipping/rules/, one per rule); of test_recurrent.py only the
# recurrent layers inside a compiled train step (its XLA cases take minutes).
clipping_tests=(tests/clipping/test_engine.py tests/clipping/test_clipping_float_safety.py
                $(ls tests/clipping/rules/test_*.py | grep -v '/test_recurrent\.py$')
                tests/clipping/rules/test_recurrent.py::test_recurrent_layers_clip_exactly_in_graph_mode
                tests/clipping/test_kernel_routes.py::test_grouped_kernel_probe_is_cached_and_agrees_with_the_kernel)
for extra in tests/clipping/test_batch_free_inputs.py; do [ -f "$extra" ] && clipping_tests+=("$extra"); done
onednn_now=$(python -c "from tensorflow.python.util import _pywrap_util_port as p; print(int(p.IsMklEnabled()))" 2>/dev/null | tail -n 1)
if [ "$onednn_now" = "1" ]; then other=0; else other=1; fi
echo "test.sh: kernel-route tests again with TF_ENABLE_ONEDNN_OPTS=$other (oneDNN was $onednn_now)"
TF_ENABLE_ONEDNN_OPTS=$other python -m pytest "${clipping_tests[@]}" -n "$processes" --dist loadfile --durations=5 "${tier[@]}" "$@"
