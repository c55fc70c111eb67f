#!/usr/bin/env bash
# DAPO on several GPU hosts without a scheduler: run this on every host with its own --rank.
#   bash launch/multinode_gpu.sh --coordinator 10.0.0.1:1234 --nodes 16 --rank 0 \
#       --config configs/dapo_qwen2_5_32b.py --workdir /shared/runs/dapo_32b [--dry-run] [-- --config.x=y]
set -euo pipefail
coord="" nodes="" rank="" config="" workdir="" dry=0 extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --coordinator) coord="$2"; shift 2 ;;
    --nodes) nodes="$2"; shift 2 ;;
    --rank) rank="$2"; shift 2 ;;
    --config) config="$2"; shift 2 ;;
    --workdir) workdir="$2"; shift 2 ;;
    --dry-run) dry=1; shift ;;
    --) shift; extra=("$@"); break ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
for v in coord nodes rank config workdir; do
  [ -n "${!v}" ] || { echo "--$v is required" >&2; exit 2; }
done
# dapo_jax.distributed reads these three variables and calls jax.distributed.initialize.
env_vars=(JAX_COORDINATOR_ADDRESS="$coord" JAX_NUM_PROCESSES="$nodes" JAX_PROCESS_ID="$rank")
cmd=(env "${env_vars[@]}" dapo-train --config "$config" --workdir "$workdir" "${extra[@]}")
if [ "$dry" = 1 ]; then printf '+'; printf ' %q' "${cmd[@]}"; echo; exit 0; fi
exec "${cmd[@]}"
