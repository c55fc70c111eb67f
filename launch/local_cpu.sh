#!/usr/bin/env bash
# The main job on a machine without an accelerator: the tiny CPU DAPO run (configs/tiny_cpu.py).
# Creates ./.venv on first use. Extra arguments go to dapo-train, e.g. --config.seed=1.
#   bash launch/local_cpu.sh [--workdir DIR] [--config.x=y ...]
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source launch/setup_env.sh runtime
workdir="workdirs/tiny_cpu"
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --workdir) workdir="$2"; shift 2 ;;
    --workdir=*) workdir="${1#*=}"; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
export JAX_PLATFORMS=cpu
exec dapo-train --config configs/tiny_cpu.py --workdir "$workdir" "${args[@]}"
