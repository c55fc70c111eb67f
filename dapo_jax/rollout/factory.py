"""Picks the rollout engine a run asks for: a rollout callable (both engines return the same
``RolloutBatch``) and a `RolloutStream` opener for streaming dynamic sampling.

The settings come in as plain values (this layer does not read the run spec):
`trainer.run_setup.engine_args` gives them for a run's ``rollout`` and ``data`` sections.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
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


def make_rollout(engine: str, graphdef: nnx.GraphDef, mesh: Mesh | None, tokenizer, *,
                 max_prompt_length: int, max_concurrent_decodes: int, **kv: Any
                 ) -> RolloutCallable:
  """``engine`` (``rollout.engine``): "continuous" (slots refilled inside the compiled loop) or
  "static" (one compiled while_loop per batch).

  The continuous engine prefills up to ``max_prompt_length`` tokens (``data.max_prompt_length``)
  in ``max_concurrent_decodes`` slots, its KV cache as ``kv`` says (kv_cache, page_size,
  kv_pages, kv_hbm_fraction, attention_impl: `continuous.ContinuousSampler`'s arguments).
  Either takes host prompts that are the same on every process and returns the same host-backed
  ``RolloutBatch`` on every process.
  """
  if engine == "static":
    sampler = Sampler(graphdef, mesh=mesh, rules=shd.SAMPLE_RULES)
    return distributed.global_rollout(sampler.generate, mesh)
  if engine == "continuous":
    from dapo_jax.rollout import continuous  # pylint: disable=g-import-not-at-top
    # Runs the same host schedule on every process and reads replicated outputs itself.
    return continuous.make_rollout_fn(graphdef, mesh=mesh, tokenizer=tokenizer,
                                      max_concurrent_decodes=max_concurrent_decodes,
                                      max_prefill_length=max_prompt_length, **kv)
  raise ValueError(f"config.rollout.engine={engine!r}; choose 'static' or 'continuous'.")


def make_stream_opener(engine: str, graphdef: nnx.GraphDef, mesh: Mesh | None,
                       rollout: RolloutCallable, *, gen_batch_size: int, prompts_per_call: int,
                       max_prompt_length: int, max_concurrent_decodes: int, **kv: Any
                       ) -> StreamOpener:
  """``open_stream(state, *, params, num_samples, key)`` for ``engine`` (``rollout.engine``).

  Static: a `StaticStream` over ``rollout`` (already wrapped for several processes) in the
  batch-level loop's call layout (``gen_batch_size`` prompts per generation batch,
  ``prompts_per_call`` per call, 0: all), so both loops decode the same rows with the same keys.
  Continuous: the engine's own stream, with `make_rollout`'s settings.
  """
  if engine == "static":
    gen, ppc = gen_batch_size, prompts_per_call
    per_call = ppc if 0 < ppc < gen else gen

    def open_static(state, *, params: SamplingParams, num_samples: int, key: jax.Array):
      return StaticStream(rollout, state, params=params, num_samples=num_samples, key=key,
                          prompts_per_call=per_call, calls_per_batch=gen // per_call,
                          prompt_length=max_prompt_length)
    return open_static
  if engine == "continuous":
    from dapo_jax.rollout import continuous  # pylint: disable=g-import-not-at-top
    sampler = continuous.ContinuousSampler(
        graphdef, num_slots=max_concurrent_decodes, mesh=mesh,
        max_prefill_length=max_prompt_length, **kv)
    return sampler.open_stream
  raise ValueError(f"config.rollout.engine={engine!r}; choose 'static' or 'continuous'.")
