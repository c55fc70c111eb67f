#!/usr/bin/env bash
# Lint, then the test suite on CPU (8 simulated devices), in ./.venv.
# Usage: bash launch/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source launch/setup_env.sh test
# ruff.toml holds the rules; a violation fails the run (and CI) before any test starts.
python -m ruff check dapo_jax tests bench configs colabs launch
python -m pytest -q tests "$@"
