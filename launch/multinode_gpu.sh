#!/usr/bin/env bash
# DAPO on several GPU hosts without a scheduler: run this on every host with its own --rank.
#   bash launch/multinode_gpu.sh --coordinator 10.0.0.1:1234 --nodes 16 --rank 0 \
#       --config configs/dapo_qwen2_5_32b.py --workdir /shared/runs/dapo_32b [--dry-run] [-- --config.x=y]
# Rollout on hosts of its own (docs/overlap.md): each side is a job of its own, run as above with
# its own --coordinator, --nodes and --rank, plus --role train|rollout and the same --peer.
set -euo pipefail
usage() {
  cat <<'EOF_USAGE'
Usage: bash launch/multinode_gpu.sh --coordinator HOST:PORT --nodes N --rank R
                                    --config FILE[:VARIANT] --workdir DIR [--dry-run]
                                    [--role train|rollout --peer HOST:PORT,...|auto]
                                    [-- --config.x=y ...]

Starts dapo-train on this host as process R of N; run it on every host, each with its own
--rank. The processes find each other through the coordinator (rank 0's HOST:PORT).

  --coordinator HOST:PORT  rank 0's address, reachable from every host
  --nodes N                the number of hosts
  --rank R                 this host's rank, 0 .. N-1
  --config FILE[:VARIANT]  a config file (the same on every host)
  --workdir DIR            the run directory, shared by every host (a shared file system or gs://)
  --dry-run                check the config locally (it loads with the overrides and passes the
                           config's checks), then print the command instead of running it
  --gpu MODEL              h100, h200 or a100 (default: nvidia-smi's): before training, the
                           compiled plan for N nodes of --gpus-per-node GPUs must fit, else one
                           line and exit 2 (a dry run checks it only with --gpu)
  --gpus-per-node G        GPUs on each host (default 8)
  --skip-plan              do not compile the plan first
  --role train|rollout     this side of a run whose rollout has hosts of its own: run the script
                           on every host of each side, each side with its own --coordinator,
                           --nodes (the same on both) and --rank; the config needs
                           algorithm.max_staleness >= 1 and rollout_devices = 0. The compiled
                           plan check is skipped (dapo-plan prices the split: docs/planning.md)
  --peer HOST:PORT,...     with --role: where each training host listens, one per training
                           rank in rank order (the same list on every host of both sides);
                           auto: each training host picks a free port and writes its address
                           to the workdir, where its rollout host reads it
  -h, --help               this text
Config overrides go last, after --, as dapo-train takes them:
  ... --workdir /shared/runs/x -- --config.optim.lr=1e-6
EOF_USAGE
}
coordinator="" nodes="" rank="" config="" workdir="" dry=0 extra=() gpu="" gpus=8 plan=1
role="" peer=""
while [ $# -gt 0 ]; do
  case "$1" in
    --coordinator|--nodes|--rank|--config|--workdir|--gpu|--gpus-per-node|--role|--peer)
      [ $# -ge 2 ] || { echo "multinode_gpu.sh: $1 needs a value (see --help)" >&2; exit 2; } ;;
  esac
  case "$1" in
    --config.*)  # a dapo-train override among these options
      echo "multinode_gpu.sh: config overrides go after --:" \
           "bash launch/multinode_gpu.sh ... -- $1" >&2
      exit 2 ;;
    --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}"; continue ;;  # --opt=value as --opt value
    --coordinator) coordinator="$2"; shift 2 ;;
    --nodes) nodes="$2"; shift 2 ;;
    --rank) rank="$2"; shift 2 ;;
    --config) config="$2"; shift 2 ;;
    --workdir) workdir="$2"; shift 2 ;;
    --dry-run) dry=1; shift ;;
    --gpu) gpu="$2"; shift 2 ;;
    --gpus-per-node) gpus="$2"; shift 2 ;;
    --skip-plan) plan=0; shift ;;
    --role) role="$2"; shift 2 ;;
    --peer) peer="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "multinode_gpu.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
for v in coordinator nodes rank config workdir; do
  [ -n "${!v}" ] || { echo "multinode_gpu.sh: --$v is required (see --help)" >&2; exit 2; }
done
case "$role" in
  "") [ -z "$peer" ] || { echo "multinode_gpu.sh: --peer goes with --role train|rollout" >&2
                          exit 2; } ;;
  train|rollout)
    [ -n "$peer" ] || { echo "multinode_gpu.sh: --role $role needs --peer HOST:PORT,... (one" \
                             "per training rank)" >&2; exit 2; }
    n_peers=$(awk -F, '{print NF}' <<< "$peer")
    [ "$peer" = auto ] || [ "$n_peers" = "$nodes" ] || {
      echo "multinode_gpu.sh: --peer names $n_peers address(es) for --nodes $nodes: one per" \
           "training rank (or auto)" >&2; exit 2; }
    plan=0 ;;
  *) echo "multinode_gpu.sh: --role $role: choose train or rollout" >&2; exit 2 ;;
esac
[ -f "${config%%:*}" ] || { echo "multinode_gpu.sh: --config ${config%%:*}: no such file" \
                                 "(relative paths start at $PWD)" >&2; exit 2; }
# The flags dapo-plan's GPU rows assume (dapo_jax/planner/gpu_targets.py; NCCL: its defaults).
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
# Only where the platform is a GPU: JAX_PLATFORMS names one, or is unset on a host whose
# nvidia-smi lists a GPU. A CPU run (JAX_PLATFORMS=cpu, or no GPU here) gets no GPU-only flag.
on_gpu=0
case ",${JAX_PLATFORMS:-}," in
  *,cuda,*|*,gpu,*|*,rocm,*) on_gpu=1 ;;
  ,,) if nvidia-smi -L 2> /dev/null | grep -q '^GPU '; then on_gpu=1; fi ;;
esac
case "$on_gpu ${XLA_FLAGS:-} " in
  0\ *|*" --xla_gpu_enable_latency_hiding_scheduler="*) ;;  # not a GPU, or the user's own value
  *) export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_enable_latency_hiding_scheduler=true" ;;
esac
if [ -z "$gpu" ] && [ "$dry" = 0 ] && command -v nvidia-smi > /dev/null 2>&1; then
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)" in
    *H200*) gpu=h200 ;; *H100*) gpu=h100 ;; *A100*80GB*) gpu=a100 ;;
  esac
fi
plan_args=()
if [ "$plan" = 1 ] && [ -n "$gpu" ]; then
  plan_args=(--num-devices "$((nodes * gpus))" --plan-target "gpu:$gpu:${nodes}x$gpus")
elif [ "$plan" = 1 ] && [ "$dry" = 0 ]; then
  echo "multinode_gpu.sh: no compiled plan (GPU model unknown: pass --gpu h100|h200|a100)" >&2
fi
# dapo_jax.infra.distributed reads these three variables and calls jax.distributed.initialize.
env_vars=(JAX_COORDINATOR_ADDRESS="$coordinator" JAX_NUM_PROCESSES="$nodes"
          JAX_PROCESS_ID="$rank")
role_args=()
[ -z "$role" ] || role_args=(--role="$role" --peer="$peer")
cmd=(env "${env_vars[@]}" dapo-train --config "$config" --workdir "$workdir"
     ${role_args[@]+"${role_args[@]}"} ${extra[@]+"${extra[@]}"})
if [ "$dry" = 1 ]; then
  # A real run checks the same itself on start; the dry run checks before any host starts.
  root="$(cd "$(dirname "$0")/.." && pwd -P)"
  # shellcheck source=launch/preflight.sh
  source "$root/launch/preflight.sh"
  dapo_preflight "$root" --config "$config" ${plan_args[@]+"${plan_args[@]}"} \
    -- ${extra[@]+"${extra[@]}"} || exit 2
  printf '+'; printf ' %q' "${cmd[@]}"; echo; exit 0
fi
if [ ${#plan_args[@]} -gt 0 ]; then  # every host checks the same plan before it trains
  py="${DAPO_PYTHON:-$(dirname "$(command -v dapo-train)")/python}"
  JAX_PLATFORMS=cpu "$py" -m dapo_jax.commands.launch_preflight --config "$config" \
    "${plan_args[@]}" -- ${extra[@]+"${extra[@]}"} || exit 2
fi
exec "${cmd[@]}"
