# dapo-train --config configs/qwen25_1_5b_lora.py --workdir /content/dapo_1_5b_lora \
#     --config.model.checkpoint=/path/to/Qwen2.5-1.5B
"""DAPO on Qwen2.5-1.5B with LoRA adapters (model.lora, docs/lora.md) on ONE 16 GiB accelerator
(a v5e chip, a Colab T4): rank-32 adapters on every projection, the base frozen in bf16, so
only ~18M adapter parameters carry an fp32 master copy and AdamW moments. The sequence budget is
cut to 1024 prompt + 3072 response tokens and the step to 32 prompts x 8 samples (the paper's
7B/32B runs use 2048 + 8192/20480 and 512 x 16), the continuous engine to 48 slots. dapo-plan's
figures for it (and why full fine-tuning does not fit): docs/lora.md, "What fits where"."""

from dapo_jax.config import default_config


def get_config(arg: str | None = None):
  del arg
  c = default_config()
  c.model.preset = "qwen2.5-1.5b"
  c.tokenizer.kind = "auto"
  c.model.lora.update(rank=32, alpha=64.0, targets=("q", "k", "v", "o", "gate", "up", "down"))
  c.data.max_prompt_length = 1024
  c.rollout.max_response_length = 3072
  c.reward.overlong_buffer_len = 1024
  c.rollout.n = 8
  c.rollout.max_concurrent_decodes = 48
  c.rollout.prompts_per_call = 6  # the static sampler (rollout.engine="static"): 48 rows a call
  c.algorithm.gen_batch_size = 48  # dynamic sampling draws more when groups are all right/wrong
  c.optim.train_batch_size, c.optim.mini_batch_size, c.optim.micro_batch_size = 32, 8, 1
  c.optim.lr = 1e-5  # LoRA RL reports ~10x the full fine-tuning rate (untested here at 1.5B)
  c.mesh = [("data", 1), ("fsdp", -1), ("tensor", 1)]
  return c
