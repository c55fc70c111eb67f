# dapo-train --config configs/smoke_qwen2_5_0_5b.py --workdir /tmp/dapo_smoke \
#     --config.model.checkpoint=/path/to/Qwen2.5-0.5B
"""A GPU/TPU smoke run on Qwen2.5-0.5B shapes: minutes, not days. Without a checkpoint the
weights are random (throughput and memory checks); with one it trains on DAPO-Math-17k."""

from dapo_jax.config import default_config


def get_config(arg: str | None = None):
  del arg
  c = default_config()
  c.model.preset = "qwen2.5-0.5b"
  c.num_steps = 5
  c.data.max_prompt_length = 512
  c.rollout.n = 8
  c.rollout.max_response_length = 1024
  c.reward.overlong_buffer_len = 256
  c.optim.train_batch_size, c.optim.mini_batch_size, c.optim.micro_batch_size = 16, 8, 8
  c.algorithm.gen_batch_size = 32
  c.eval.every, c.eval.max_examples, c.eval.batch_size = 5, 64, 64
  c.checkpoint.save_every = 5
  return c
