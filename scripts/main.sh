#!/usr/bin/env bash
# The main job: install, then DP-SGD on MNIST with the recipe of examples/mnist_dpsgd.py's
# default flags (tanh tutorial CNN, momentum 0.9, C = 0.1, Poisson L = 512, 60 epochs, sigma
# calibrated to epsilon <= 3 at delta = 1e-5, evaluated on the parameter average), printing
# epsilon and accuracy per epoch and, on the last line, the final test accuracy and epsilon.
# Measured 2026-11-30: test accuracy 98.11 % at epsilon = 3.000, 97.88 % on a fresh-key rerun
# (README, "Measured"; ~9 min on a quiet 2-core machine by estimate, 23-30 min on the shared
# one it was measured on).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python examples/mnist_dpsgd.py "$@"
