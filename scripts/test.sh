#!/usr/bin/env bash
# Install, then run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python -m pytest tests "$@"
