# dapo-train --config configs/dapo_qwen2_5_32b.py --workdir gs://BUCKET/dapo_32b \
#     --config.model.checkpoint=/path/to/Qwen2.5-32B
"""DAPO on Qwen2.5-32B base: the paper's settings exactly (docs/algorithm.md section 8).

Variants reproduce the rows of the paper's Table 1 (AIME24 avg@32, each row adds one technique):
  :naive_grpo          30  symmetric clip 0.2, seq-mean-token-mean, no dynamic sampling, no shaping
  :overlong_filtering  36  + truncated responses masked out of the loss
  :clip_higher         38  + eps_high 0.28
  :soft_overlong       41  + soft overlong punishment (filtering off: the best runs did not use it)
  :token_level_loss    42  + token-mean aggregation
  :dapo (default)      50  + dynamic sampling

:dapo_overlap is :dapo with the rollout one step ahead of the update on chips of its own
(algorithm.max_staleness=1, token-TIS behaviour weights; docs/overlap.md), laid out for a
v5p-64 (32 chips): 16 roll out, 16 train. `dapo-plan` prices it in its overlap block; on its
closed form a 16/16 split of a v5p-64 is slower than the serial step (1.59 h vs 1.08 h with
the trainer packed, 2.90 h vs 2.15 h padded; docs/overlap.md), as both phases scale with their
chips: it pays where a phase does not
(long-tail decoding, host and reward time), which only a measured run shows.

:dapo_kv_int8 is :dapo with the rollout's KV cache in int8 (a scale per token and KV head:
about half the bytes a decode step reads, twice the tokens in the same pool) and token-TIS for
the sampler/trainer mismatch it adds (docs/kv_int8.md).
"""

from dapo_jax.config import default_config

TABLE1_ROWS = ("naive_grpo", "overlong_filtering", "clip_higher", "soft_overlong",
               "token_level_loss", "dapo")


def get_config(arg: str | None = None):
  c = default_config()  # already the paper's values; restated here so the file reads alone
  c.model.preset = "qwen2.5-32b"
  c.model.param_dtype = c.model.dtype = "bfloat16"
  c.model.remat = "full"
  c.tokenizer.kind = "auto"
  c.data.train, c.data.eval = "dapo_math_17k", "aime_2024"
  c.data.max_prompt_length = 2048
  c.rollout.n = 16
  c.rollout.temperature, c.rollout.top_p, c.rollout.top_k = 1.0, 1.0, 0
  c.rollout.max_response_length = 20480
  c.reward.overlong_buffer_len, c.reward.overlong_penalty_factor = 4096, 1.0
  c.algorithm.clip_ratio_low, c.algorithm.clip_ratio_high = 0.2, 0.28
  c.algorithm.clip_ratio_c = 10.0
  c.algorithm.loss_agg_mode = "token-mean"
  c.algorithm.dynamic_sampling = True
  c.algorithm.gen_batch_size, c.algorithm.max_num_gen_batches = 1536, 10
  c.optim.train_batch_size, c.optim.mini_batch_size, c.optim.ppo_epochs = 512, 32, 1
  c.optim.lr, c.optim.warmup_steps, c.optim.weight_decay, c.optim.grad_clip = 1e-6, 20, 0.1, 1.0
  c.eval.num_samples, c.eval.temperature, c.eval.top_p = 1, 1.0, 0.7  # avg@32 (32 copies/row)
  # Parameters and Adam state split 32 ways (fsdp 4 x tensor 8), more devices add data
  # parallelism: at fsdp 8 or more XLA keeps ~3x the activations per layer (docs/planning.md,
  # dapo-plan table). 32 devices at least.
  c.mesh = [("data", -1), ("fsdp", 4), ("tensor", 8)]
  # Several slices (multislice, e.g. 2 x v5p-128): how many slices each axis spans, so fsdp and
  # tensor stay on a slice's ICI links and only data parallelism crosses the DCN:
  #   --config.dcn_mesh=data=2   (config.mesh stays the whole mesh; docs/cloud.md)
  c.dcn_mesh = ""

  row = arg or "dapo"
  if row == "dapo_kv_int8":
    c = get_config("dapo")
    c.rollout.kv_cache_dtype = "int8"  # half the KV bytes a decode step reads (docs/kv_int8.md)
    c.algorithm.rollout_is = "token_truncated"  # the sampler/trainer mismatch it adds
    return c
  if row == "dapo_overlap":
    c = get_config("dapo")
    c.algorithm.max_staleness = 1
    c.algorithm.rollout_is = "token_truncated"  # verl's token-TIS, cap 2
    c.rollout_devices = 16
    c.mesh = [("data", -1), ("fsdp", 2), ("tensor", 8)]  # the 16 training chips
    c.rollout_mesh = [("data", -1), ("fsdp", 1), ("tensor", 8)]  # the 16 rollout chips
    return c
  if row not in TABLE1_ROWS:
    raise ValueError(f"Unknown variant {row!r}; Table 1 rows are {TABLE1_ROWS} (and "
                     "dapo_overlap, dapo_kv_int8).")
  upto = TABLE1_ROWS.index(row)
  # Start from naive GRPO and switch techniques on in the paper's order.
  c.algorithm.clip_ratio_high = 0.2
  c.algorithm.loss_agg_mode = "seq-mean-token-mean"
  c.algorithm.dynamic_sampling = False
  c.algorithm.gen_batch_size = c.optim.train_batch_size
  c.reward.overlong_buffer_enable = False
  c.algorithm.overlong_filter = upto >= 1 and upto < 3
  if upto >= 2:
    c.algorithm.clip_ratio_high = 0.28
  if upto >= 3:
    c.reward.overlong_buffer_enable = True
  if upto >= 4:
    c.algorithm.loss_agg_mode = "token-mean"
  if upto >= 5:
    c.algorithm.dynamic_sampling = True
    c.algorithm.gen_batch_size = 1536
  return c
