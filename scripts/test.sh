#!/usr/bin/env bash
# Install, then run the test suite; then the clipping tests again with oneDNN switched the
# other way (TensorFlow leaves it off on AMD, AVX2-only Intel, ARM and macOS CPUs, where
# some kernels, e.g. a grouped convolution's filter gradient, do not exist).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# Two processes, one test file each at a time (module fixtures stay in one process): most of
# a test is single-threaded tracing, so two files overlap well on 2 cores.
python -m pytest tests -n "${TF_DP_TEST_PROCESSES:-2}" --dist loadfile "$@"
clipping_tests=(tests/test_clipping.py tests/test_clipping_float_safety.py tests/test_kernel_routes.py tests/test_recurrent_in_graph.py)
onednn_now=$(python -c "from tensorflow.python.util import _pywrap_util_port as p; print(int(p.IsMklEnabled()))" 2>/dev/null | tail -n 1)
if [ "$onednn_now" = "1" ]; then other=0; else other=1; fi
TF_ENABLE_ONEDNN_OPTS=$other python -m pytest "${clipping_tests[@]}" -q -n "${TF_DP_TEST_PROCESSES:-2}" --dist loadfile
