#!/usr/bin/env bash
# The main job: install, then DP-SGD on MNIST with the recipe of examples/mnist_dpsgd.py's
# default flags (scattering features J = 2 + GroupNorm + small tanh CNN, momentum 0.9, C = 0.1,
# Poisson L = 1024, 40 epochs, sigma calibrated to epsilon <= 3 at delta = 1e-5, evaluated on
# the parameter average), printing epsilon and accuracy per epoch and, on the last line, the
# final test accuracy and epsilon. Measured 2026-12-01: 98.63 % at epsilon = 2.998 with a fresh
# key, 98.75 % with a fixed one (README, "Measured").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python examples/mnist_dpsgd.py "$@"
