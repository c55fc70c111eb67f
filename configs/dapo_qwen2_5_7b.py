# dapo-train --config configs/dapo_qwen2_5_7b.py --workdir gs://BUCKET/dapo_7b \
#     --config.model.checkpoint=/path/to/Qwen2.5-7B
"""DAPO on Qwen2.5-7B base: the verl smoke-scale settings (response 2048, buffer 512)."""

from dapo_jax.config import default_config


def get_config(arg: str | None = None):
  del arg
  c = default_config()
  c.model.preset = "qwen2.5-7b"
  c.rollout.max_response_length = 2048
  c.reward.overlong_buffer_len = 512
  c.data.max_prompt_length = 1024
  c.optim.train_batch_size, c.optim.mini_batch_size = 512, 32
  c.algorithm.gen_batch_size = 1536
  c.mesh = [("data", 1), ("fsdp", -1), ("tensor", 4)]
  return c
