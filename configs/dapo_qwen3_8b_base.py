# dapo-train --config configs/dapo_qwen3_8b_base.py --workdir gs://BUCKET/dapo_qwen3_8b \
#     --config.model.checkpoint=/path/to/Qwen3-8B-Base
"""DAPO on Qwen3-8B-Base: the paper's Qwen2.5-32B recipe (docs/algorithm.md section 8), field by
field, on the dense Qwen3 decoder (QK-norm, no q/k/v bias, head_dim 128, untied, rope 1e6).

Prompts go through the checkpoint's own chat template (tokenizer.kind "auto") with the
generation prompt and no `enable_thinking`: Qwen3's thinking mode, the model opens its own
<think> block. The thinking is kept in the trained response (it is the policy's output and
counts toward max_response_length and the overlong buffer); the verifier reads the answer after
the last </think> (rewards/math_dapo.answer_region; tokenizers/chat_templates.py).
"""

from dapo_jax.config import default_config


def get_config(arg: str | None = None):
  del arg
  c = default_config()  # already the paper's values; restated here so the file reads alone
  c.model.preset = "qwen3-8b"  # the architecture when no checkpoint is given (random init)
  c.model.param_dtype = c.model.dtype = "bfloat16"
  c.model.remat = "full"
  c.tokenizer.kind = "auto"  # Qwen3-8B-Base's tokenizer.json and chat template
  c.data.train, c.data.eval = "dapo_math_17k", "aime_2024"
  c.data.max_prompt_length = 2048
  c.rollout.n = 16  # G responses per prompt
  c.rollout.temperature, c.rollout.top_p, c.rollout.top_k = 1.0, 1.0, 0
  c.rollout.max_response_length = 20480  # thinking included
  c.rollout.stop_tokens = "checkpoint_and_chat"  # <|endoftext|> (151643) and <|im_end|>
  c.reward.overlong_buffer_enable = True
  c.reward.overlong_buffer_len, c.reward.overlong_penalty_factor = 4096, 1.0
  c.reward.verifier = "strict"  # DAPO-Math-17k's "Answer:" line
  c.algorithm.clip_ratio_low, c.algorithm.clip_ratio_high = 0.2, 0.28  # clip-higher
  c.algorithm.clip_ratio_c = 10.0
  c.algorithm.loss_agg_mode = "token-mean"  # token-level loss
  c.algorithm.dynamic_sampling = True
  c.algorithm.overlong_filter = False
  c.algorithm.use_kl_loss = False
  c.algorithm.gen_batch_size, c.algorithm.max_num_gen_batches = 1536, 10  # 3 x train batch
  c.optim.train_batch_size, c.optim.mini_batch_size, c.optim.ppo_epochs = 512, 32, 1
  c.optim.lr, c.optim.warmup_steps, c.optim.weight_decay, c.optim.grad_clip = 1e-6, 20, 0.1, 1.0
  c.optim.b1, c.optim.b2, c.optim.eps = 0.9, 0.999, 1e-8
  c.eval.num_samples, c.eval.temperature, c.eval.top_p = 1, 1.0, 0.7  # avg@32 (32 copies/row)
  # 8.2B parameters: Adam state and parameters split over fsdp and 4-way tensor parallelism
  # (32 query / 8 kv heads); more devices add fsdp (v5p-8: 4 chips, tensor 4; 1x8 H100: fsdp 2).
  # dapo-plan on tpu:v5p:2x2x1 (compiled, prompts_per_call=4): rollout phase 89.85 GiB of 95.7
  # a chip, fits (docs/planning.md; 1x8 H100 is estimated analytically there).
  c.mesh = [("data", 1), ("fsdp", -1), ("tensor", 4)]
  return c
