# dapo-train --config configs/qwen25_math_7b_lora.py --workdir gs://BUCKET/dapo_math_7b_lora \
#     --config.model.checkpoint=/path/to/Qwen2.5-Math-7B
"""DAPO on Qwen2.5-Math-7B with LoRA adapters (model.lora, docs/lora.md) on one small slice
(v5e-8 or v4-8): configs/dapo_qwen2_5_math_7b.py with rank-32 adapters on every projection
(q k v o gate up down) and the base frozen in bf16. Only the adapters (~80M parameters) carry an
fp32 master copy and AdamW moments, instead of 7.6B parameters' 12 bytes each. The learning rate
is 10x the full fine-tuning one (LoRA RL reports ~10x; untested here at 7B). dapo-plan on
tpu:v5e:2x4 (compiled): train step 6.58 GiB, rollout phase 13.25 GiB per chip with 64 continuous
slots: fits in 16 GiB; full fine-tuning does not (analytic train step 20.2 GiB). docs/lora.md
has the rows for v5e-8 and v4-8."""

from dapo_jax.config import sibling_config


def get_config(arg: str | None = None):
  del arg
  c = sibling_config(__file__, "dapo_qwen2_5_math_7b")
  c.model.lora.update(rank=32, alpha=64.0, targets=("q", "k", "v", "o", "gate", "up", "down"))
  c.optim.lr = 1e-5
  # One v5e-8 / v4-8 slice: the frozen base split over 8 chips (fsdp 2 x tensor 4).
  c.mesh = [("data", 1), ("fsdp", -1), ("tensor", 4)]
  # The rollout's KV cache at 10240 tokens: 147 MB per sequence per chip (4 KV heads over
  # tensor 4), so 64 slots (32 per data shard) and 4-prompt static calls (64 rows).
  c.rollout.max_concurrent_decodes = 64
  c.rollout.prompts_per_call = 4
  return c
