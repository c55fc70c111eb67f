#!/usr/bin/env bash
# Runs on every TPU worker (launch/tpu_vm.sh sends it): makes VENV a Python 3.11+ environment
# with dapo_jax's dependencies, without copying any local environment.
#   bash launch/worker_env.sh VENV EXTRA SKIP_INSTALL
# VENV missing: a venv from the newest python3.11+ on the machine (with ensurepip), else from a
# CPython 3.11 that uv downloads (Cloud TPU images ship Ubuntu 22.04's Python 3.10). Then
# `pip install .[EXTRA]` (EXTRA "" = no extra), then requirements-no-deps.txt with --no-deps.
# SKIP_INSTALL=1: use VENV as it is (it must already hold the dependencies; the launch tests
# point it at their own environment).
set -euo pipefail
venv="${1:?usage: worker_env.sh VENV EXTRA SKIP_INSTALL}"
extra="${2-tpu}"
skip="${3:-0}"
root="$(cd "$(dirname "$0")/.." && pwd)"
is_311='import sys; sys.exit(sys.version_info < (3, 11))'

if [ "$skip" != 1 ] && [ ! -x "$venv/bin/python" ]; then
  py=""
  for cand in python3.13 python3.12 python3.11 python3; do
    if command -v "$cand" >/dev/null && "$cand" -c "$is_311; import ensurepip" 2>/dev/null; then
      py="$(command -v "$cand")"
      break
    fi
  done
  if [ -n "$py" ]; then
    echo "worker_env: creating $venv from $py"
    "$py" -m venv "$venv"
  else
    if ! command -v uv >/dev/null; then
      echo "worker_env: no python3.11+ here; installing uv to fetch one"
      curl -LsSf https://astral.sh/uv/install.sh | sh
      export PATH="$HOME/.local/bin:$PATH"
    fi
    uv venv --seed --python 3.11 "$venv"
  fi
fi
if ! "$venv/bin/python" -c "$is_311"; then
  echo "worker_env: $venv/bin/python is $("$venv/bin/python" -V 2>&1); dapo_jax needs 3.11+." \
       "Remove it (or pass another --venv) to have a new one made." >&2
  exit 1
fi
if [ "$skip" != 1 ]; then
  spec="$root"
  [ -z "$extra" ] || spec="${root}[$extra]"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "$spec"
  # JetStream without the TensorFlow its metadata asks for (setup.py says why).
  "$venv/bin/python" -m pip install -q --no-deps -r "$root/requirements-no-deps.txt"
fi
"$venv/bin/python" -c "import jax, flax, orbax.checkpoint; print('worker_env: python', \
  __import__('sys').version.split()[0], 'jax', jax.__version__)"
