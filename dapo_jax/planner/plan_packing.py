"""What packing (optim.packing, trainer/packing.py) makes of the trainer's programs, for
``dapo-plan``: the packed shapes of one mini-batch at the length mix the plan assumes, and the
attention work the packed kernel executes.

The mix: prompts of ``MEAN_PROMPT_TOKENS`` on average (measured: the AIME 2024 parquet rendered
as dapo-train renders it, Qwen2.5 vocabulary and chat template: mean 180, 129-278;
tests/test_plan_packing.py re-measures it where the parquet is at hand), spread uniformly over
+-30% and capped at ``data.max_prompt_length``; responses as the rollout estimate assumes
(`plan_estimates.MEAN_RESPONSE_FRACTION` of ``max_response_length`` on average, ``LIMIT_SHARE``
at the limit, the rest uniform below). A fixed seed draws one mini-batch of lengths, and the
trainer's own packer lays it out, so the plan's shapes are the ones a run of that mix compiles.

Attention: on TPU (splash) the packed kernel computes the blocks `segment_attention.block_map`
lists, about the sequences' own causal squares; cuDNN a packed row's causal half, XLA its whole
square, as those kernels do.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from dapo_jax.models import Qwen2Config, attention
from dapo_jax.models import segment_attention
from dapo_jax.planner import plan_estimates as est
from dapo_jax.spec.run_spec import RunSpec
from dapo_jax.trainer import packing

MEAN_PROMPT_TOKENS = 180
LIMIT_SHARE = 0.05
_SEED = 0


def sample_masks(spec: RunSpec, rows: int, seed: int = _SEED) -> np.ndarray:
  """[rows, P + R] attention masks of the plan's length mix (left-padded prompts, responses
  from column P)."""
  p, r = spec.data.max_prompt_length, spec.rollout.max_response_length
  rng = np.random.default_rng(seed)
  mean_p = min(MEAN_PROMPT_TOKENS, p)
  prompts = np.clip(np.round(rng.uniform(0.7, 1.3, rows) * mean_p), 1, p).astype(int)
  # The rest's mean so that the whole mix's is MEAN_RESPONSE_FRACTION x R.
  rest_mean = (est.MEAN_RESPONSE_FRACTION - LIMIT_SHARE) / (1 - LIMIT_SHARE) * r
  responses = np.clip(np.round(rng.uniform(1, 2 * rest_mean - 1, rows)), 1, r).astype(int)
  responses[rng.random(rows) < LIMIT_SHARE] = r
  mask = np.zeros((rows, p + r), bool)
  for i in range(rows):
    mask[i, p - prompts[i]:p + responses[i]] = True
  return mask


def num_batch_shards(spec: RunSpec, num_devices: int) -> int:
  sizes = est.mesh_sizes(spec.mesh, num_devices)
  return math.prod(sizes.get(a, 1) for a in est.BATCH_AXES)


def _shape(spec: RunSpec, num_shards: int, impl: str) -> dict[str, Any]:
  rows = spec.sizes.rows_per_update
  budget = spec.optim.max_tokens_per_row or spec.sizes.max_length
  mask = sample_masks(spec, rows)
  micro = min(spec.optim.micro_batch_size, rows)
  lay = packing.pack_layout(mask, budget, num_shards,
                            packing.rows_per_micro(micro, spec.sizes.max_length, budget,
                                                   num_shards))
  seg = lay.pack_tokens(np.zeros(mask.shape, np.int32), mask)["segment_ids"]
  block = (attention._splash_block(budget)  # pylint: disable=protected-access
           if impl == "splash" else None)
  if block:
    blocks = int(np.asarray(segment_attention.computed_blocks(seg, block)).sum())
    attention_pairs = blocks * block * block  # query-key pairs the kernel computes
  elif impl == "cudnn":  # the causal flag: each packed row's lower half
    attention_pairs = lay.num_packed_rows * budget * (budget + 1) // 2
  else:  # XLA: the packed rows' whole squares (masked scores cost as real ones)
    attention_pairs = lay.num_packed_rows * budget * budget
  lengths = mask.sum(1)
  return {"budget": budget, "num_shards": num_shards, "num_micro": lay.num_micro,
          "rows_per_cell": lay.rows_per_cell, "seqs_per_cell": lay.seqs_per_cell,
          "packed_rows": lay.num_packed_rows, "slots": lay.num_slots, "fill": lay.fill,
          "real_tokens": lay.real_tokens, "rows": rows,
          "positions_vs_padded": lay.num_packed_rows * budget / (rows * spec.sizes.max_length),
          "attention_impl": impl, "attention_block": block,
          "attention_pairs": attention_pairs,
          "attention_pairs_own_squares": int((lengths * (lengths + 1) // 2).sum()),
          "mean_prompt_tokens": MEAN_PROMPT_TOKENS, "limit_share": LIMIT_SHARE}


def packed_shape(spec: RunSpec, num_shards: int, impl: str) -> dict[str, Any] | None:
  """One mini-batch of the plan's mix packed for ``num_shards`` batch shards: the packer's
  micro-batches, rows and slots, fill, positions against the padded rows, and the query-key
  pairs the attention kernel ``impl`` computes ("splash": the blocks the packed kernel does not
  skip; "cudnn": the packed rows' causal halves; "xla": their whole squares). None when the run
  does not pack."""
  if not spec.optim.packing:
    return None
  return _shape(spec, num_shards, impl)


def attention_flops(mcfg: Qwen2Config, pairs: float) -> float:
  """Forward attention FLOPs of ``pairs`` query-key pairs over every layer and head: the two
  matmuls, 2 x 2 x head_dim each."""
  return 4.0 * mcfg.num_hidden_layers * mcfg.num_attention_heads * mcfg.dim_per_head * pairs
