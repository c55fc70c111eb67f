"""Picks the rollout engine a config asks for: a rollout callable (both engines return the same
``RolloutBatch``) and a `RolloutStream` opener for streaming dynamic sampling."""

from __future__ import annotations

from typing import Any, Callable

import jax
import ml_collections
from flax import nnx
from jax.sharding import Mesh

from dapo_jax.infra import distributed
from dapo_jax.infra import sharding as shd
from dapo_jax.rollout.sampler import RolloutBatch, Sampler
from dapo_jax.rollout.sampling import SamplingParams
from dapo_jax.rollout.static_stream import StaticStream
from dapo_jax.rollout.stream import RolloutStream

# (params_state, prompt_ids [B,P], prompt_mask [B,P], key, params, num_samples) -> RolloutBatch
RolloutCallable = Callable[[nnx.State, Any, Any, jax.Array, SamplingParams, int], RolloutBatch]
# (params_state, *, params, num_samples, key) -> RolloutStream
StreamOpener = Callable[..., RolloutStream]


def kv_cache_args(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The continuous engine's KV-cache arguments from ``config.rollout``."""
  r = config.rollout
  return dict(kv_cache=r.kv_cache, page_size=r.page_size, kv_pages=r.kv_pages,
              kv_hbm_fraction=r.kv_hbm_fraction, attention_impl=r.attention_impl)


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
                                      max_prefill_length=config.data.max_prompt_length,
                                      **kv_cache_args(config))
  raise ValueError(f"config.rollout.engine={engine!r}; choose 'static' or 'continuous'.")


def make_stream_opener(config: ml_collections.ConfigDict, graphdef: nnx.GraphDef,
                       mesh: Mesh | None, rollout: RolloutCallable) -> StreamOpener:
  """``open_stream(state, *, params, num_samples, key)`` for ``config.rollout.engine``.

  Static: a `StaticStream` over ``rollout`` (already wrapped for several processes) in the
  batch-level loop's call layout, so both loops decode the same rows with the same keys.
  Continuous: the engine's own stream.
  """
  if config.rollout.engine == "static":
    gen, ppc = config.algorithm.gen_batch_size, config.rollout.prompts_per_call
    per_call = ppc if 0 < ppc < gen else gen

    def open_static(state, *, params: SamplingParams, num_samples: int, key: jax.Array):
      return StaticStream(rollout, state, params=params, num_samples=num_samples, key=key,
                          prompts_per_call=per_call, calls_per_batch=gen // per_call,
                          prompt_length=config.data.max_prompt_length)
    return open_static
  if config.rollout.engine == "continuous":
    from dapo_jax.rollout import continuous  # pylint: disable=g-import-not-at-top
    sampler = continuous.ContinuousSampler(
        graphdef, num_slots=config.rollout.max_concurrent_decodes, mesh=mesh,
        max_prefill_length=config.data.max_prompt_length, **kv_cache_args(config))
    return sampler.open_stream
  raise ValueError(f"config.rollout.engine={config.rollout.engine!r}; choose 'static' or "
                   "'continuous'.")
