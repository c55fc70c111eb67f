# dapo-train --config configs/dapo_qwen2_5_math_7b.py --workdir gs://BUCKET/dapo_math_7b \
#     --config.model.checkpoint=/path/to/Qwen2.5-Math-7B
"""DAPO on Qwen2.5-Math-7B: 8,192 response tokens with a 4,096 buffer, no dynamic sampling
(the published verl baseline setting, AIME24 36.3). The Math model's context is 4,096 by its
config; rope_theta 10k. Use `--config.algorithm.dynamic_sampling=True` for the full recipe."""

from dapo_jax.config import default_config


def get_config(arg: str | None = None):
  del arg
  c = default_config()
  c.model.preset = "qwen2.5-math-7b"
  c.model.overrides = dict(max_position_embeddings=10240)  # prompt 2048 + response 8192
  c.tokenizer.kind = "auto"
  c.rollout.max_response_length = 8192
  c.reward.overlong_buffer_len = 4096
  c.data.max_prompt_length = 2048
  c.algorithm.dynamic_sampling = False
  c.algorithm.gen_batch_size = c.optim.train_batch_size
  c.mesh = [("data", 1), ("fsdp", -1), ("tensor", 4)]
  return c
