#!/usr/bin/env bash
# The main job: install, then DP-SGD on MNIST (60 epochs, sigma = 1.1, Poisson L = 256),
# printing epsilon and accuracy per epoch and the final test accuracy and epsilon.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python examples/mnist_dpsgd.py "$@"
