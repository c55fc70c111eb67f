# dapo-train --config configs/dapo_qwen3_32b_base.py --workdir gs://BUCKET/dapo_qwen3_32b \
#     --config.model.checkpoint=/path/to/Qwen3-32B
"""DAPO on Qwen3-32B: configs/dapo_qwen3_8b_base.py's recipe (the paper's, field by field, with
Qwen3's chat template and thinking kept in the response) at 32B, laid out as the paper's
Qwen2.5-32B run is (configs/dapo_qwen2_5_32b.py): fsdp 4 x tensor 8 (64 query / 8 KV heads,
head_dim 128), 32 chips at least, more add data parallelism. Qwen3 publishes no 32B base model;
`Qwen3-32B` is the post-trained one.

dapo-plan on tpu:v5p:2x4x4 (v5p-64, compiled through libtpu; docs/planning.md): train step
71.58 GiB a chip at micro-batch 8, the rollout phase with the continuous engine 65.85 GiB at 256
slots and 89.59 GiB at the 1,660 slots its pool fits: fits in 95.7 GiB, as Qwen2.5-32B does."""

from dapo_jax.config import sibling_config


def get_config(arg: str | None = None):
  del arg
  c = sibling_config(__file__, "dapo_qwen3_8b_base")
  c.model.preset = "qwen3-32b"
  c.mesh = [("data", -1), ("fsdp", 4), ("tensor", 8)]
  c.optim.micro_batch_size = 8  # the planned train step (dapo-plan: 71.58 GiB a chip)
  c.rollout.prompts_per_call = 16  # the static engine's calls, when chosen
  return c
