"""Picks the rollout engine a config asks for; both return the same ``RolloutBatch``."""

from __future__ import annotations

from typing import Any, Callable

import jax
import ml_collections
from flax import nnx
from jax.sharding import Mesh

from dapo_jax import distributed
from dapo_jax import sharding as shd
from dapo_jax.rollout.sampler import RolloutBatch, Sampler
from dapo_jax.rollout.sampling import SamplingParams

# (params_state, prompt_ids [B,P], prompt_mask [B,P], key, params, num_samples) -> RolloutBatch
RolloutCallable = Callable[[nnx.State, Any, Any, jax.Array, SamplingParams, int], RolloutBatch]


def make_rollout(config: ml_collections.ConfigDict, graphdef: nnx.GraphDef, mesh: Mesh | None,
                 tokenizer) -> RolloutCallable:
  """``config.rollout.engine``: "continuous" (slots refilled inside the compiled loop) or
  "static" (one compiled while_loop per batch).

  Either takes host prompts that are the same on every process and returns the same host-backed
  ``RolloutBatch`` on every process.
  """
  engine = config.rollout.engine
  if engine == "static":
    sampler = Sampler(graphdef, mesh=mesh, rules=shd.SAMPLE_RULES)
    return distributed.global_rollout(sampler.generate, mesh)
  if engine == "continuous":
    from dapo_jax.rollout import continuous  # pylint: disable=g-import-not-at-top
    # Runs the same host schedule on every process and reads replicated outputs itself.
    return continuous.make_rollout_fn(graphdef, mesh=mesh, tokenizer=tokenizer,
                                      max_concurrent_decodes=config.rollout.max_concurrent_decodes,
                                      max_prefill_length=config.data.max_prompt_length)
  raise ValueError(f"config.rollout.engine={engine!r}; choose 'static' or 'continuous'.")
