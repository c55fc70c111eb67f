"""Closed-form sizes behind ``dapo-plan``: device capacities, KV cache, FLOPs, and the analytic
memory estimate used where no compiler for the target is at hand (GPU clusters).

FLOPs count a multiply-add as 2. Attention is counted over the full padded length, as the XLA
attention path computes it (masked scores cost the same as real ones).
"""

from __future__ import annotations

import math
from typing import Any

import ml_collections
import numpy as np

from dapo_jax.models import Qwen2Config

# v5p: the 95.74 GiB libtpu reports when it refuses a program; others are the nominal sizes.
TPU_HBM_GIB = {"v4": 32, "v5e": 16, "v5litepod": 16, "v5p": 95.74, "v6e": 32}
GPU_HBM_GB = {"a100": 80, "h100": 80, "h200": 141, "b200": 180}
# Share of GPU memory XLA's allocator may take (launch/slurm_gpu.sbatch sets 0.92).
GPU_MEM_FRACTION = 0.92
# Train-step temporaries per token, per layer and per hidden unit of one trajectory with
# rematerialisation on (gradient buffers excluded), by fsdp degree: fitted to libtpu's compiles
# of the Qwen2.5-32B step (Pallas splash attention, fp32 master weights, tensor 8, one
# trajectory per chip, 22528 tokens). fsdp 4: 4.0 on v5p:2x4x4 and 3.7 on v5p:4x4x4 with data 2;
# fsdp 8: 11.4 on v5p:4x4x4; fsdp 16: 12.0 on v5p:4x4x8. From fsdp 8 up, XLA's partitioner keeps
# about 1.27 GB per layer where fsdp 4 keeps 0.17 (`dapo-plan --layers 2` vs 4). A flash kernel
# keeps no [T, S] scores, so the rate is per token; cuDNN's flash attention on GPUs is assumed
# to behave alike until a GPU compile confirms it.
REMAT_BYTES_BY_FSDP = {4: 4.0, 8: 11.4, 16: 12.0}


def remat_bytes_per_token_layer_unit(fsdp: int) -> float:
  """The fitted rate of the nearest compiled fsdp degree (ties: the larger rate)."""
  near = lambda k: (abs(math.log2(k) - math.log2(max(fsdp, 1))), -REMAT_BYTES_BY_FSDP[k])
  return REMAT_BYTES_BY_FSDP[min(REMAT_BYTES_BY_FSDP, key=near)]

# Rollout temporaries besides the KV cache, as a share of it (the same compiles: 11.3 GiB over a
# 66 GiB cache at 96 sequences x 22528 slots per chip).
ROLLOUT_TEMP_OVER_KV = 0.18
BATCH_AXES = ("data", "fsdp")


def mesh_sizes(axes, num_devices: int) -> dict[str, int]:
  """``[(name, size)]`` with one -1 resolved against ``num_devices``."""
  known = math.prod(int(s) for _, s in axes if int(s) != -1)
  return {str(n): (num_devices // known if int(s) == -1 else int(s)) for n, s in axes}


def _split(n: int, ways: int) -> int:
  """Per-device share of a dimension of size ``n`` split ``ways`` ways (whole if indivisible)."""
  return n // ways if ways > 1 and n % ways == 0 else n


def _mesh_shape(mesh) -> dict[str, int]:
  return dict(mesh.shape) if hasattr(mesh, "shape") else dict(mesh)


def kv_cache_bytes_per_device(mcfg: Qwen2Config, mesh, rows: int, slots: int) -> int:
  """The decode loop's K and V for ``rows`` sequences of ``slots`` tokens, on one device
  (rows over the data axes, KV heads over ``tensor``)."""
  shape = _mesh_shape(mesh)
  batch_ways = math.prod(shape.get(a, 1) for a in BATCH_AXES)
  kv_heads = _split(mcfg.num_key_value_heads, shape.get("tensor", 1))
  return (_split(rows, batch_ways) * mcfg.num_hidden_layers * 2 * kv_heads * mcfg.dim_per_head
          * slots * np.dtype(mcfg.dtype).itemsize)


def _matmul_params(mcfg: Qwen2Config) -> int:
  """Parameters that take part in a matmul per token (the embedding lookup is free)."""
  embed = mcfg.vocab_size * mcfg.hidden_size
  return mcfg.num_params() if mcfg.tie_word_embeddings else mcfg.num_params() - embed


def _attn_flops_per_token(mcfg: Qwen2Config, context: float) -> float:
  return 4.0 * mcfg.num_hidden_layers * mcfg.num_attention_heads * mcfg.dim_per_head * context


def step_flops(config: ml_collections.ConfigDict, mcfg: Qwen2Config) -> dict[str, float]:
  """FLOPs of one RL step over all devices: one generation batch (dynamic sampling may draw
  more), the old-log-prob forward and the updates (x4/3 with full rematerialisation)."""
  n_mm = _matmul_params(mcfg)
  p, r = config.data.max_prompt_length, config.rollout.max_response_length
  t = p + r
  prompts, g = config.algorithm.gen_batch_size, config.rollout.n
  rollout = (prompts * p * (2 * n_mm + _attn_flops_per_token(mcfg, p))
             + prompts * g * r * (2 * n_mm + _attn_flops_per_token(mcfg, p + r / 2)))
  rows = config.optim.train_batch_size * g
  fwd = rows * t * (2 * n_mm + _attn_flops_per_token(mcfg, t))
  remat = 4 / 3 if config.model.remat != "none" else 1.0
  train = 3 * fwd * remat * config.optim.ppo_epochs
  logprob = 0.0 if config.rollout.use_sampler_logprobs else fwd
  return {"rollout": rollout, "logprob": logprob, "train": train,
          "total": rollout + logprob + train}


def layout_warnings(config: ml_collections.ConfigDict, mcfg: Qwen2Config,
                    num_devices: int) -> list[str]:
  """Layout choices that silently waste devices (replicated work) or memory."""
  out = []
  for field in ("mesh", "rollout_mesh"):
    axes = config[field] or config.mesh
    known = math.prod(int(s) for _, s in axes if int(s) != -1)
    if num_devices % known:
      out.append(f"config.{field}={list(axes)} does not divide {num_devices} devices.")
      return out
  train, roll = mesh_sizes(config.mesh, num_devices), mesh_sizes(
      config.rollout_mesh or config.mesh, num_devices)
  ways = math.prod(train.get(a, 1) for a in BATCH_AXES)
  micro = min(config.optim.micro_batch_size, config.optim.mini_batch_size * config.rollout.n)
  if micro % ways:
    out.append(f"micro-batch of {micro} trajectories does not split over the {ways} batch "
               f"shards (data x fsdp): every shard computes all of it. Use a multiple of {ways}.")
  rways = math.prod(roll.get(a, 1) for a in BATCH_AXES)
  prompts = config.rollout.prompts_per_call or config.algorithm.gen_batch_size
  if prompts % rways:
    out.append(f"{prompts} prompts per rollout call do not split over the {rways} rollout "
               f"batch shards: set rollout.prompts_per_call to a multiple of {rways}.")
  for name, mesh in (("training", train), ("rollout", roll)):
    tp = mesh.get("tensor", 1)
    for what, n in (("attention heads", mcfg.num_attention_heads),
                    ("KV heads", mcfg.num_key_value_heads)):
      if tp > 1 and n % tp:
        out.append(f"{name} tensor={tp} does not divide the {n} {what}: they stay replicated.")
  return out


def analytic_memory(config: ml_collections.ConfigDict, mcfg: Qwen2Config,
                    num_devices: int, master_dtype: str = "float32") -> dict[str, Any]:
  """Per-device bytes in the shape ``plan.make_plan`` reports for compiled targets.

  Parameters, optimizer state and KV cache are exact up to indivisible dimensions. Train-step
  temporaries with rematerialisation use the per-token rate fitted to TPU compiles
  (``REMAT_BYTES_BY_FSDP``); without it, every layer's activations.
  """
  train, roll = mesh_sizes(config.mesh, num_devices), mesh_sizes(
      config.rollout_mesh or config.mesh, num_devices)
  tp, rtp = train.get("tensor", 1), roll.get("tensor", 1)
  pb, ab = np.dtype(mcfg.param_dtype).itemsize, np.dtype(mcfg.dtype).itemsize
  # The trained copy is held in the master dtype (fp32 for a bf16 model), as the trainer does.
  mb = max(pb, np.dtype(master_dtype).itemsize) if master_dtype else pb
  n = mcfg.num_params()
  params = n * mb // (train.get("fsdp", 1) * tp)
  opt_state = 2 * params  # Adam's two moments, in the master dtype
  p, r = config.data.max_prompt_length, config.rollout.max_response_length
  t = p + r
  ways = math.prod(train.get(a, 1) for a in BATCH_AXES)
  rows = config.optim.mini_batch_size * config.rollout.n
  micro = _split(min(config.optim.micro_batch_size, rows), ways)
  d, f, layers = mcfg.hidden_size, mcfg.intermediate_size, mcfg.num_hidden_layers
  if config.model.remat != "none":
    saved = micro * t * layers * d * remat_bytes_per_token_layer_unit(train.get("fsdp", 1))
  else:  # every layer keeps its activations, attention scores included (fp32)
    heads = _split(mcfg.num_attention_heads, tp)
    saved = layers * micro * (t * (6 * d + 3 * _split(f, tp)) * ab + 3 * heads * t * t * 4)
  # fp32 gradient accumulators + the forward's copy in the model's dtype
  grads = n * 4 // (train.get("fsdp", 1) * tp) + n * pb // (train.get("fsdp", 1) * tp)
  batch = _split(rows, ways) * (t * 5 + r * 5 + 5)
  activations = int(saved) + grads
  train_parts = {"params": params, "opt_state": opt_state, "batch": batch,
                 "activations_and_temp": activations}
  rparams = n * pb // rtp
  src = n * pb // (train.get("fsdp", 1) * tp)
  prompts = config.rollout.prompts_per_call or config.algorithm.gen_batch_size
  kv = kv_cache_bytes_per_device(mcfg, roll, prompts * config.rollout.n, t)
  rrows = _split(prompts * config.rollout.n, math.prod(roll.get(a, 1) for a in BATCH_AXES))
  outputs = rrows * (r * 9 + p * 5 + 9)
  other = int(ROLLOUT_TEMP_OVER_KV * kv) + rrows * _split(mcfg.vocab_size, rtp) * 4 * 3
  return {
      "train": {"parts": train_parts, "peak": sum(train_parts.values()),
                "state_bytes": params + opt_state,
                "num_micro_batches": max(1, rows // config.optim.micro_batch_size)},
      "rollout": {"parts": {"params": rparams, "kv_cache_estimate": kv, "other_temp": other,
                            "outputs": outputs},
                  "peak": rparams + kv + other + outputs, "prompts_per_call": prompts,
                  # The compiled TPU reshard stages one destination-sized buffer.
                  # Its source is the training shard cast to the model's dtype.
                  "reshard": {"src": src, "dst": rparams, "temp": rparams,
                              "peak": src + 2 * rparams}}}
