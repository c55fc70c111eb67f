#!/usr/bin/env bash
# The test suite on CPU (8 simulated devices), in ./.venv. Usage: bash launch/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source launch/setup_env.sh test
python -m pytest -q tests "$@"
