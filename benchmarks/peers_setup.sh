#!/usr/bin/env bash
# Creates the peer virtualenvs used by benchmarks/peers.py. Nothing is installed into the
# interpreter that runs tf_dp: each peer lives in its own venv under $PEERS_VENV_ROOT (/tmp).
#
#   bash benchmarks/peers_setup.sh            # all three peers
#   bash benchmarks/peers_setup.sh tfp        # tensorflow-privacy only
#   bash benchmarks/peers_setup.sh opacus     # Opacus only
#   bash benchmarks/peers_setup.sh jaxp       # jax_privacy (Keras 3 on JAX, CPU) only
# A venv root inside the repository is ignored by git (.gitignore: venv_*/).
set -euo pipefail
ROOT="${PEERS_VENV_ROOT:-/tmp}"
PY="${PEERS_PYTHON:-python3.11}"
which "$PY" >/dev/null 2>&1 || PY=python3
targets=("${@:-tfp opacus jaxp}")
targets=(${targets[@]})

setup_tfp() {
  # tensorflow-privacy 0.9.0 (last release) needs Python <3.12, numpy ~=1.21, tfp ~=0.22
  # (which pairs with TF 2.15) and, under TF >= 2.16, legacy Keras. TF 2.15's Linux wheel is
  # CPU-only unless the [and-cuda] extra is asked for, so `tensorflow` is already the CPU build.
  local v="$ROOT/venv_tfp"
  "$PY" -m venv "$v"
  "$v/bin/pip" install -q --upgrade pip
  "$v/bin/pip" install -q \
    "tensorflow-privacy==0.9.0" "tensorflow==2.15.1" "tf-keras==2.15.1" \
    "tensorflow-probability==0.22.1" "numpy<2" "absl-py"
  "$v/bin/pip" freeze > "$v/freeze.txt"
}

setup_opacus() {
  # torch==2.13.0: pip takes the CPU wheel lying on this machine's disk (see the env notes);
  # installing it first keeps opacus from pulling a CUDA build.
  local v="$ROOT/venv_opacus"
  "$PY" -m venv "$v"
  "$v/bin/pip" install -q --upgrade pip
  "$v/bin/pip" install -q "torch==2.13.0"
  "$v/bin/pip" install -q "opacus" "torch==2.13.0" "numpy" "absl-py"
  "$v/bin/pip" freeze > "$v/freeze.txt"
}

setup_jaxp() {
  # jax_privacy 2.0's keras_api needs Keras 3 on the JAX backend; PyPI's jax/jaxlib wheels run on
  # the CPU (jax[cpu] pulls no CUDA plugin). peers.py sets KERAS_BACKEND=jax in the worker.
  local v="$ROOT/venv_jaxp"
  "$PY" -m venv "$v"
  "$v/bin/pip" install -q --upgrade pip
  "$v/bin/pip" install -q "jax_privacy>=2.0,<3" "jax[cpu]" "keras>=3" "numpy" "absl-py"
  "$v/bin/pip" freeze > "$v/freeze.txt"
}

for t in "${targets[@]}"; do
  case "$t" in
    tfp) setup_tfp ;;
    opacus) setup_opacus ;;
    jaxp) setup_jaxp ;;
    *) echo "unknown target $t (tfp|opacus|jaxp)" >&2; exit 2 ;;
  esac
done
