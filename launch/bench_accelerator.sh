#!/usr/bin/env bash
# The accelerator benchmark (bench/accelerator.py) on one GPU or TPU chip, stopped after 6 minutes.
# Uses the active Python (jax[cuda12] or jax[tpu]; torch + transformers for the PyTorch ratios).
#   bash launch/bench_accelerator.sh [--no_torch] [--train_presets qwen2.5-0.5b] [...]
#   bash launch/bench_accelerator.sh --dry_run     # CPU, tiny shapes: checks that it runs
set -euo pipefail
cd "$(dirname "$0")/.."
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-3}"
exec timeout 360 "${PYTHON:-python3}" bench/accelerator.py \
  --compile_cache "${XLA_CACHE_DIR:-$HOME/.cache/dapo_jax_xla}" "$@"
