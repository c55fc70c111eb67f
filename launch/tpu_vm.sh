#!/usr/bin/env bash
# DAPO on a Cloud TPU VM slice: create, copy the code, install, run on every worker in tmux with a
# log per worker, checkpoints and metrics in a GCS workdir.
#   bash launch/tpu_vm.sh --name dapo-32b --zone us-east5-a --type v5p-128 \
#       --config configs/dapo_qwen2_5_32b.py --workdir gs://BUCKET/dapo_32b [--dry-run] [-- --config.x=y]
# --dry-run prints every command instead of running it. Check first that the config fits:
#   dapo-plan --config configs/dapo_qwen2_5_32b.py --target tpu:v5p:4x4x4
set -euo pipefail
name="" zone="" type="" config="" workdir="" version="v2-alpha-tpuv5" dry=0 extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --name) name="$2"; shift 2 ;;
    --zone) zone="$2"; shift 2 ;;
    --type) type="$2"; shift 2 ;;
    --config) config="$2"; shift 2 ;;
    --workdir) workdir="$2"; shift 2 ;;
    --version) version="$2"; shift 2 ;;
    --dry-run) dry=1; shift ;;
    --) shift; extra=("$@"); break ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
for v in name zone type config workdir; do
  [ -n "${!v}" ] || { echo "--$v is required" >&2; exit 2; }
done
run() { if [ "$dry" = 1 ]; then printf '+'; printf ' %q' "$@"; echo; else "$@"; fi; }
root="$(cd "$(dirname "$0")/.." && pwd)"
ssh_all=(gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" --worker=all --command)
run gcloud compute tpus tpu-vm create "$name" --zone "$zone" --accelerator-type "$type" \
  --version "$version"
run gcloud compute tpus tpu-vm scp --recurse "$root" "$name:~/dapo_jax" --zone "$zone" --worker=all
run "${ssh_all[@]}" "cd ~/dapo_jax && python3 -m pip install -q -e '.[tpu]'"
# jax.distributed.initialize() finds the other workers by itself on a TPU pod slice.
# pip's console scripts land in ~/.local/bin, which a non-login ssh command may not have.
cmd="cd ~/dapo_jax && export PATH=\$HOME/.local/bin:\$PATH && dapo-train --config $config --workdir $workdir ${extra[*]:-}"
run "${ssh_all[@]}" "tmux new-session -d -s dapo \"$cmd 2>&1 | tee ~/dapo_worker_\\\$(hostname).log\""
echo "Follow a worker: gcloud compute tpus tpu-vm ssh $name --zone $zone --worker=0 --command 'tail -f ~/dapo_worker_*.log'"
