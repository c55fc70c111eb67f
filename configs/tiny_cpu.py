# bash launch/local_cpu.sh   (= dapo-train --config configs/tiny_cpu.py --workdir workdirs/tiny_cpu)
"""The CPU main job: a tiny Qwen2-architecture policy learns arithmetic with DAPO.

A char-level tokenizer, a ~1M-parameter Qwen2 decoder, a short supervised warm start on worked
solutions (partial accuracy), then DAPO with every mechanism visibly engaged: dynamic sampling
drops all-correct / all-wrong groups, decoupled clipping fires, and the overlong buffer
(responses past max_response_length - buffer) shapes rewards. Variants for the project's own
Table 1: `configs/tiny_cpu.py:naive_grpo`, `:no_dynamic_sampling`, `:no_token_mean`,
`:no_clip_higher`, `:no_overlong_shaping`.

`:overlap` rolls out on a second (simulated) CPU device one step ahead of the update
(docs/overlap.md):

    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \
        .venv/bin/dapo-train --config configs/tiny_cpu.py:overlap --workdir workdirs/overlap

`:kv_int8` samples from an int8 KV cache (a scale per token and KV head) and corrects the
sampler/trainer mismatch it adds with token-TIS (docs/kv_int8.md).

`:multi_epoch` trains on 256 problems instead of 5000, so each comes back every ~3 steps (~50
times in 160 steps), as DAPO-Math-17k's ~100 copies of each problem do; add
`--config.algorithm.skip_filter=True` to skip prompts from their own history (docs/skip_filter.md):

    JAX_PLATFORMS=cpu .venv/bin/dapo-train --config configs/tiny_cpu.py:multi_epoch \
        --config.algorithm.skip_filter=True --workdir workdirs/multi_epoch_skip
"""

from dapo_jax.config import default_config


def get_config(arg: str | None = None):
  c = default_config()
  c.seed = 0
  c.num_steps = 160

  c.model.preset = "test"
  c.model.overrides = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=128)
  c.model.param_dtype = c.model.dtype = "float32"
  c.model.remat = "none"
  c.model.attention_impl = "xla"
  # Unrolled: on this CPU the scanned 4-layer update ran 1.11x slower and compiled no faster
  # (`python bench/scan_layers.py`, docs/scale.md "Scanned layers").
  c.model.scan_layers = False
  c.tokenizer.kind = "char"

  c.data.train = c.data.eval = "arithmetic"
  # A 3-operand prompt renders to 25 tokens with the chat template (2 operands: 23); at 24
  # left truncation cut the opening <|im_start|> from 4,726 of the 5,000 (issue 41).
  c.data.max_prompt_length = 25
  c.data.arithmetic.update(num_train=5000, num_eval=128, min_digits=1, max_digits=1,
                           min_operands=2, max_operands=3, ops="+-*")

  c.rollout.n = 8
  # Worked 3-operand solutions take 25-26 tokens: past 32 - 8 = 24 they are in the buffer.
  c.rollout.max_response_length = 32
  c.reward.overlong_buffer_len = 8
  c.reward.num_workers = 1

  c.algorithm.gen_batch_size = 32
  c.algorithm.max_num_gen_batches = 20
  c.optim.train_batch_size = 16
  c.optim.mini_batch_size = 4  # 4 updates per step
  c.optim.micro_batch_size = 64
  # Responses here fill about 24 of 32 positions: packing pays little (docs/performance.md).
  c.optim.packing = False
  c.optim.lr = 1e-4  # 5e-4 collapsed the policy within 40 steps (measured)
  c.optim.warmup_steps = 2
  c.optim.weight_decay = 0.0

  # 600 warm-start steps leave the policy at 36% held-out with whole prompts (45-56% when
  # 3-operand prompts were cut to 24 tokens; 300 steps: 18%, where half the groups are
  # all-wrong and DAPO gains ~11 points in 160 steps; measured, docs/fidelity.md).
  c.sft.update(steps=600, batch_size=64, lr=3e-3, warmup_steps=20)
  c.eval.update(every=20, num_samples=4, temperature=1.0, top_p=0.7, batch_size=128)
  c.checkpoint.update(save_every=10, max_to_keep=2, async_save=True)
  c.mesh = [("data", 1), ("fsdp", -1), ("tensor", 1)]

  variant = arg or "dapo"
  if variant == "naive_grpo":  # the paper's Table 1 first row, on this task
    c.algorithm.update(clip_ratio_high=0.2, loss_agg_mode="seq-mean-token-mean",
                       dynamic_sampling=False)
    c.algorithm.gen_batch_size = c.optim.train_batch_size
    c.reward.overlong_buffer_enable = False
  elif variant == "no_dynamic_sampling":
    c.algorithm.dynamic_sampling = False
    c.algorithm.gen_batch_size = c.optim.train_batch_size
  elif variant == "no_token_mean":
    c.algorithm.loss_agg_mode = "seq-mean-token-mean"
  elif variant == "no_clip_higher":
    c.algorithm.clip_ratio_high = 0.2
  elif variant == "no_overlong_shaping":
    c.reward.overlong_buffer_enable = False
  elif variant == "overlap":  # one step off on its own device, token-TIS behaviour weights
    c.rollout_devices = 1
    c.algorithm.max_staleness = 1
    c.algorithm.rollout_is = "token_truncated"
  elif variant == "kv_int8":  # the rollout's KV cache in int8, token-TIS for the mismatch
    c.rollout.kv_cache_dtype = "int8"
    c.algorithm.rollout_is = "token_truncated"
  elif variant == "multi_epoch":  # few problems, seen many times (the skip filter's setting)
    c.data.arithmetic.num_train = 256
    # The policy learns the 256 by heart: with the filter off, 3-5% of groups still varied by
    # step 150 (14-20 generation batches a step), and 20 stopped the run at step 157
    # (`bench/skip_demo.py`, seed 0; docs/skip_filter.md).
    c.algorithm.max_num_gen_batches = 64
  elif variant != "dapo":
    raise ValueError(f"Unknown tiny_cpu variant {variant!r}.")
  return c
