#!/usr/bin/env bash
# DAPO on a Cloud TPU VM slice: create the slice (or reuse it; a preempted one is recreated),
# copy the code, make a Python 3.11+ environment on every worker, start the same dapo-train on
# every worker. Checked locally first (dapo_jax/commands/launch_preflight.py). Options: --help.
#   bash launch/tpu_vm.sh --name dapo-32b --zone us-east5-a --type v5p-128 \
#       --config configs/dapo_qwen2_5_32b.py --workdir gs://BUCKET/dapo_32b [-- --config.x=y]
set -euo pipefail
usage() {
  cat <<'EOF_USAGE'
Usage: bash launch/tpu_vm.sh --name NAME --zone ZONE --type TYPE --config FILE[:VARIANT]
                             --workdir DIR [options] [-- --config.x=y ...]

Creates a Cloud TPU VM slice (or reuses a READY one; a PREEMPTED or STOPPED one is recreated),
copies this checkout to every worker, makes a Python 3.11+ environment there and starts the
same dapo-train on every worker. Checkpoints and metrics go to --workdir, so running the same
command again after a preemption resumes the run from its newest checkpoint.

Required:
  --name NAME        the TPU VM's name
  --zone ZONE        e.g. us-east5-a
  --type TYPE        accelerator type, e.g. v4-8, v5p-128, v5litepod-16, v6e-8
  --config FILE[:VARIANT]
                     a config file inside this checkout (it is copied to the workers with it)
  --workdir DIR      the run directory; gs://BUCKET/RUN on a slice of more than one host
Options:
  --version V        runtime image (default per generation: v6e v2-alpha-tpuv6e, v5p
                     v2-alpha-tpuv5, v5litepod v2-alpha-tpuv5-lite, v4 tpu-ubuntu2204-base)
  --spot             a Spot slice (preemptible: run the same command again to resume)
  --venv DIR         Python environment on the workers (default $HOME/dapo_venv there)
  --extra E          pip extra installed there (default tpu)
  --skip-install     use --venv on the workers as it is
  --foreground       wait for the run (default: a detached tmux session per worker)
  --dry-run          run the local checks, then print the commands instead of running them
  --skip-preflight   skip the local checks
  -h, --help         this text

Config overrides go last, after --, as dapo-train takes them:
  ... --workdir gs://BUCKET/run -- --config.optim.lr=1e-6 --config.num_steps=200

Before any gcloud call, a local Python with dapo_jax checks the launch: the accelerator type
is known, the config file is in this checkout and loads with the overrides and passes the
config's checks for the slice's device count, and a multi-host slice has a gs:// workdir.
That Python is $DAPO_PYTHON, else the active virtualenv's, else ./.venv's, else python3.

Example:
  bash launch/tpu_vm.sh --name dapo-32b --zone us-east5-a --type v5p-128 \
      --config configs/dapo_qwen2_5_32b.py --workdir gs://BUCKET/dapo_32b -- --config.seed=1
Check first that the config fits: dapo-plan --config configs/dapo_qwen2_5_32b.py \
  --target tpu:v5p:4x4x4
EOF_USAGE
}
name="" zone="" type="" config="" workdir="" version="" venv="" pip_extra="tpu"
skip_install=0 foreground=0 spot=0 dry=0 preflight=1 extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --name|--zone|--type|--config|--workdir|--version|--venv|--extra)
      [ $# -ge 2 ] || { echo "tpu_vm.sh: $1 needs a value (see --help)" >&2; exit 2; } ;;
  esac
  case "$1" in
    --config.*)  # a dapo-train override: a common slip is to write it among these options
      echo "tpu_vm.sh: config overrides go after --: bash launch/tpu_vm.sh ... -- $1" >&2
      exit 2 ;;
    --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}"; continue ;;  # --opt=value as --opt value
    --name) name="$2"; shift 2 ;;
    --zone) zone="$2"; shift 2 ;;
    --type) type="$2"; shift 2 ;;
    --config) config="$2"; shift 2 ;;
    --workdir) workdir="$2"; shift 2 ;;
    --version) version="$2"; shift 2 ;;
    --venv) venv="$2"; shift 2 ;;
    --extra) pip_extra="$2"; shift 2 ;;
    --skip-install) skip_install=1; shift ;;
    --foreground) foreground=1; shift ;;
    --spot) spot=1; shift ;;
    --dry-run) dry=1; shift ;;
    --skip-preflight) preflight=0; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "tpu_vm.sh: unknown argument $1 (see bash launch/tpu_vm.sh --help)" >&2; exit 2 ;;
  esac
done
for v in name zone type config workdir; do
  [ -n "${!v}" ] || { echo "tpu_vm.sh: --$v is required (see --help)" >&2; exit 2; }
done
root="$(cd "$(dirname "$0")/.." && pwd -P)"

# 0. Local checks, before anything is created or billed.
if [ "$preflight" = 1 ]; then
  # shellcheck source=launch/preflight.sh
  source "$root/launch/preflight.sh"
  dapo_preflight "$root" --type "$type" --tree "$root" --config "$config" \
    --workdir "$workdir" -- ${extra[@]+"${extra[@]}"} || exit 2
fi
# The workers run from the copy of the tree: the config's path relative to it.
config_file="${config%%:*}"
if [ -f "$config_file" ]; then
  config_abs="$(cd "$(dirname "$config_file")" && pwd -P)/$(basename "$config_file")"
  case "$config_abs" in "$root"/*) config="${config_abs#"$root"/}${config#"$config_file"}" ;; esac
fi
# Runtime images per generation (cloud.google.com/tpu/docs/runtimes). Ubuntu 22.04 ones ship
# Python 3.10; worker_env.sh brings 3.11+ itself, so any of them works.
if [ -z "$version" ]; then
  case "$type" in
    v6e-*) version="v2-alpha-tpuv6e" ;;
    v5p-*) version="v2-alpha-tpuv5" ;;
    v5litepod-*|v5e-*) version="v2-alpha-tpuv5-lite" ;;
    v4-*|v3-*|v2-*) version="tpu-ubuntu2204-base" ;;
    *) echo "no default runtime image for --type $type; pass --version" >&2; exit 2 ;;
  esac
fi
run() { if [ "$dry" = 1 ]; then printf '+'; printf ' %q' "$@"; echo; else "$@"; fi; }
tpu=(gcloud compute tpus tpu-vm)
ssh_all=("${tpu[@]}" ssh "$name" --zone "$zone" --worker=all --command)

# 1. The slice: reuse a running one; a preempted (or stopped) one cannot restart, so recreate it.
state=""
describe=("${tpu[@]}" describe "$name" --zone "$zone" --format='value(state)')
if [ "$dry" = 0 ]; then
  state="$("${describe[@]}" 2>/dev/null)" || state=""
else
  printf '# first, to reuse a READY slice:'; printf ' %q' "${describe[@]}"; echo
fi
case "$state" in
  READY|CREATING|STARTING|RESTARTING) echo "TPU $name is $state: reusing it." ;;
  *)
    if [ -n "$state" ]; then
      echo "TPU $name is $state: deleting and recreating it."
      run "${tpu[@]}" delete "$name" --zone "$zone" --quiet
    fi
    create=("${tpu[@]}" create "$name" --zone "$zone" --accelerator-type "$type"
            --version "$version")
    [ "$spot" = 0 ] || create+=(--spot)
    run "${create[@]}" ;;
esac

# 2. The code: the tree as a tarball (no .git, .venv, workdirs), plus dapo_run.sh: the command
# every worker runs. jax.distributed finds the other workers through the metadata server
# (dapo_jax.infra.distributed.maybe_initialize); the trainer resumes from --workdir by itself.
venv_arg="\$HOME/dapo_venv"  # expanded on the worker
[ -z "$venv" ] || venv_arg="$(printf '%q' "$venv")"
stage="$(mktemp -d -t dapo_launch_XXXXXX)"
trap 'rm -rf "$stage"' EXIT
cat >"$stage/dapo_run.sh" <<EOF
#!/usr/bin/env bash
# Written by launch/tpu_vm.sh: the command every worker runs; its log is ~/dapo_train.log.
cd "\$HOME/dapo_jax"
export PYTHONPATH="\$HOME/dapo_jax\${PYTHONPATH:+:\$PYTHONPATH}"
$venv_arg/bin/python -m dapo_jax.main$(printf ' %q' --config "$config" --workdir "$workdir" \
  "${extra[@]}") 2>&1 | tee -a "\$HOME/dapo_train.log"
exit "\${PIPESTATUS[0]}"
EOF
if [ "$dry" = 1 ]; then echo "# dapo_run.sh:"; sed 's/^/#   /' "$stage/dapo_run.sh"; fi
run tar -czf "$stage/dapo_jax.tar.gz" --exclude=.git --exclude=.venv --exclude=workdirs \
  --exclude=__pycache__ --exclude='*.egg-info' -C "$root" . -C "$stage" dapo_run.sh
run "${tpu[@]}" scp "$stage/dapo_jax.tar.gz" "$name:dapo_jax.tar.gz" --zone "$zone" --worker=all
run "${ssh_all[@]}" "tmux kill-session -t dapo 2>/dev/null; rm -rf ~/dapo_jax && mkdir ~/dapo_jax &&
  tar -xzf ~/dapo_jax.tar.gz -C ~/dapo_jax"

# 3. Python 3.11+ with the dependencies on every worker (never a copy of a local env).
run "${ssh_all[@]}" \
  "bash ~/dapo_jax/launch/worker_env.sh $venv_arg $(printf '%q' "$pip_extra") $skip_install"

# 4. The same command on every worker.
if [ "$foreground" = 1 ]; then
  run "${ssh_all[@]}" "bash ~/dapo_jax/dapo_run.sh"
else
  run "${ssh_all[@]}" "tmux kill-session -t dapo 2>/dev/null;
    tmux new-session -d -s dapo 'bash ~/dapo_jax/dapo_run.sh'"
  echo "Follow a worker: gcloud compute tpus tpu-vm ssh $name --zone $zone --worker=0" \
       "--command 'tail -f ~/dapo_train.log'"
fi
