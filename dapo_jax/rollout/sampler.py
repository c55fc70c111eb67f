"""Static-batch sampler: prefill plus a `lax.while_loop` decode, one compiled program per shape.

The DAPO rollout (spec section 6 point 1) draws G responses per prompt. The B prompts are
prefilled ONCE and their KV cache is replicated to B*G rows (row = b*G + g, prompt-major), so
prefill costs B, not B*G, prompt passes. The decode loop runs on device until every row has
emitted a stop token or `max_new_tokens` is reached: no host sync and no Python loop per token.

The cache never crosses the program boundary: it is allocated inside the program and carried by
the while_loop, which XLA updates in place, so there is no host-side buffer to donate.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from dapo_jax.infra import sharding as shd
from dapo_jax.models.init import cast_params
from dapo_jax.models.kv_cache import KVCache
from dapo_jax.models.qwen2 import Qwen2ForCausalLM, default_positions
from dapo_jax.rollout.sampling import SamplingParams, is_stop, sample_logits
from dapo_jax.infra.tracing import TraceCounter


@flax.struct.dataclass
class RolloutBatch:
  """B*G trajectories, rows prompt-major (row = b*G + g).

  Attributes:
    prompt_ids: [N, P] int32, each prompt repeated G times (padding as given).
    prompt_mask: [N, P] bool.
    response_ids: [N, R] int32; pad_id after the first stop token.
    response_mask: [N, R] bool; includes the first stop token, nothing after it.
    logprobs: [N, R] fp32 log-probs of the response tokens under softmax(logits / T); 0 where
      masked.
    lengths: [N] int32 response lengths (counting the stop token).
    truncated: [N] bool, no stop token within max_new_tokens.
    num_steps: [] int32 response columns actually generated (< R when all rows stopped early).
  """
  prompt_ids: jax.Array
  prompt_mask: jax.Array
  response_ids: jax.Array
  response_mask: jax.Array
  logprobs: jax.Array
  lengths: jax.Array
  truncated: jax.Array
  num_steps: jax.Array


@flax.struct.dataclass
class _Loop:
  """The while_loop carry."""
  step: jax.Array  # [] next response column to fill
  last_N: jax.Array  # [N] token written at column step - 1
  done_N: jax.Array  # [N] a stop token has been emitted
  cache: KVCache
  response_NxR: jax.Array
  logprobs_NxR: jax.Array


def segment_ends(max_new_tokens: int, num_segments: int, min_columns: int = 16) -> list[int]:
  """Response columns at which decode segments end: ..., R/4, R/2, R (halving back from R).

  Segment i holds P + ends[i] - 1 cache slots. Segments shorter than `min_columns` columns are
  merged into the next one (short responses get a single loop).
  """
  ends = [-(-max_new_tokens // 2**i) for i in reversed(range(max(num_segments, 1)))]
  return sorted({e for e in ends if e >= min_columns} | {max_new_tokens})


def _generate_program(state: nnx.State, prompt_ids_BxP: jax.Array, prompt_mask_BxP: jax.Array,
                      key: jax.Array, *, graphdef: nnx.GraphDef, params: SamplingParams,
                      num_samples: int, mesh: Mesh | None, rules: shd.Rules,
                      cache_segments: int, on_trace: Any) -> RolloutBatch:
  """The whole rollout; traced once per (shapes, params, num_samples)."""
  on_trace()
  with shd.activation_sharding(mesh, rules):
    model: Qwen2ForCausalLM = nnx.merge(graphdef, state)
    # fp32 master weights (a bf16 model being trained) are read in the model's param dtype:
    # one cast per rollout instead of twice the weight bytes on every decode step.
    model = nnx.merge(graphdef, cast_params(state, model.config.jnp_param_dtype))
    b, p = prompt_ids_BxP.shape
    g, r = num_samples, params.max_new_tokens
    n = b * g
    sample = functools.partial(sample_logits, temperature=params.temperature,
                               top_p=params.top_p, top_k=params.top_k)
    mask_BxP = prompt_mask_BxP.astype(bool)

    # Prefill the B distinct prompts once, into a cache exactly P long (prefill attention
    # then covers P slots, not P + R).
    h_BxPxD, cache = model.prefill(prompt_ids_BxP, default_positions(mask_BxP), mask_BxP)
    # The next-token logits sit at each row's last real token; gathering it (rather than
    # taking column P-1) makes left, right or no padding all work.
    last_B = jnp.max(jnp.where(mask_BxP, jnp.arange(p), 0), axis=-1)
    h_BxD = jnp.take_along_axis(h_BxPxD, last_B[:, None, None], axis=1)[:, 0]
    logits_NxV = jnp.repeat(model.logits_from_hidden(h_BxD[:, None])[:, 0], g, axis=0)
    logits_NxV = shd.constrain(logits_NxV, ("batch", "act_vocab"))
    # Decode writes response columns 0 .. R-2 into the cache (column R-1 is never fed back).
    # Every row writes slot P + step - 1 (prompts share the padded length P), so the step
    # writes all rows with one dynamic_update_slice (same_slot).
    ends = segment_ends(r, cache_segments)
    # A scanned model's cache is one [L, ...] array per k and v: growing it copies every layer
    # at once (at the last growth, old + new = 1.55x the final cache at the paper's lengths).
    # It is made full length here instead, and each segment attends over its own prefix.
    stacked = cache.stacked
    cache = cache.grow((r if stacked else ends[0]) - 1).repeat(g)
    prompt_len_N = jnp.repeat(mask_BxP.sum(-1, dtype=jnp.int32), g)

    # Column 0 comes from the prefill logits. Each step folds its index into the key; rows
    # draw independent noise from it inside `categorical`.
    tok_N, lp_N = sample(logits_NxV, jax.random.fold_in(key, 0))
    put = lambda buf_NxR, col_N, step: jax.lax.dynamic_update_slice(
        buf_NxR, col_N[:, None].astype(buf_NxR.dtype), (0, step))
    init = _Loop(
        step=jnp.array(1, jnp.int32), last_N=tok_N, done_N=is_stop(tok_N, params.eos_ids),
        cache=cache,
        response_NxR=put(jnp.full((n, r), params.pad_id, jnp.int32), tok_N, 0),
        logprobs_NxR=put(jnp.zeros((n, r), jnp.float32), lp_N, 0))

    def cond(c: _Loop, end: int) -> jax.Array:
      return (c.step < end) & ~jnp.all(c.done_N)

    def body(c: _Loop, attend: int | None) -> _Loop:
      # Feed column step - 1: cache slot P + step - 1, position = the row's real tokens
      # before it.
      logits_NxV, cache = model.decode_step(c.last_N, prompt_len_N + c.step - 1, c.cache,
                                            same_slot=True, attend=attend)
      tok_N, lp_N = sample(logits_NxV, jax.random.fold_in(key, c.step))
      # Rows already stopped keep emitting pad (masked out, log-prob 0): spec section 6.1.
      tok_N = jnp.where(c.done_N, params.pad_id, tok_N)
      lp_N = jnp.where(c.done_N, 0.0, lp_N)
      return _Loop(step=c.step + 1, last_N=tok_N,
                   done_N=c.done_N | is_stop(tok_N, params.eos_ids), cache=cache,
                   response_NxR=put(c.response_NxR, tok_N, c.step),
                   logprobs_NxR=put(c.logprobs_NxR, lp_N, c.step))

    # One while_loop per segment; each attends over a cache only as long as its last step
    # needs, so attention work follows the response length instead of P + R every step.
    out = init
    for i, end in enumerate(ends):
      if i and not stacked:
        out = out.replace(cache=out.cache.grow(end - ends[i - 1]))
      attend = p + end - 1 if stacked and end < r else None
      out = jax.lax.while_loop(functools.partial(cond, end=end),
                               functools.partial(body, attend=attend), out)

    # The mask is every column up to and including the first stop token.
    stop_NxR = is_stop(out.response_NxR, params.eos_ids)
    stops_before_NxR = jnp.cumsum(stop_NxR, axis=-1) - stop_NxR
    response_mask_NxR = (stops_before_NxR == 0) & (jnp.arange(r) < out.step)
    row = lambda x: shd.constrain(x, ("batch",) + (None,) * (x.ndim - 1))
    return RolloutBatch(
        prompt_ids=row(jnp.repeat(prompt_ids_BxP.astype(jnp.int32), g, axis=0)),
        prompt_mask=row(jnp.repeat(mask_BxP, g, axis=0)),
        response_ids=row(jnp.where(response_mask_NxR, out.response_NxR, params.pad_id)),
        response_mask=row(response_mask_NxR),
        logprobs=row(jnp.where(response_mask_NxR, out.logprobs_NxR, 0.0)),
        lengths=row(response_mask_NxR.sum(-1, dtype=jnp.int32)),
        truncated=row(~out.done_N),
        num_steps=out.step)


class Sampler:
  """Compiled static-batch sampler for one model graph.

  Usage::

    graphdef, state = nnx.split(model)          # once
    sampler = Sampler(graphdef, mesh=mesh)
    batch = sampler.generate(state, ids_BxP, mask_BxP, key, SamplingParams(...), num_samples=G)

  The program is compiled once per (prompt shape, SamplingParams, num_samples); `traces`
  counts traces so tests can catch silent recompiles.

  Args:
    graphdef: from `nnx.split(model)`.
    mesh: run sharded: prompts and KV cache over the data axes, params laid out by `rules`.
    rules: logical-axis rules (default `SAMPLE_RULES`: params split over `tensor` only).
    cache_segments: the decode loop runs as up to this many while_loops ending at response
      columns ..., R/4, R/2, R, each attending over a cache just long enough for it, instead of
      P + R slots on every step. Each segment compiles its own loop body; 1 = a single loop.
  """

  def __init__(self, graphdef: nnx.GraphDef, *, mesh: Mesh | None = None,
               rules: shd.Rules = shd.SAMPLE_RULES, cache_segments: int = 4):
    if cache_segments < 1:
      raise ValueError(f"cache_segments must be >= 1, got {cache_segments}.")
    self.graphdef = graphdef
    self.mesh = mesh
    self.rules = rules
    self.cache_segments = cache_segments
    self.traces = TraceCounter()
    self._program = jax.jit(
        functools.partial(_generate_program, graphdef=graphdef, mesh=mesh, rules=rules,
                          cache_segments=cache_segments, on_trace=self.traces.record),
        static_argnames=("params", "num_samples"))

  def generate(self, state: nnx.State, prompt_ids: jax.Array, prompt_mask: jax.Array,
               key: jax.Array, params: SamplingParams, num_samples: int = 1) -> RolloutBatch:
    """Samples `num_samples` responses per prompt; returns device arrays (no host sync)."""
    if num_samples < 1:
      raise ValueError(f"num_samples must be >= 1, got {num_samples}.")
    if prompt_ids.ndim != 2 or prompt_mask.shape != prompt_ids.shape:
      raise ValueError(f"prompt_ids and prompt_mask must both be [B, P]; got "
                       f"{prompt_ids.shape} and {prompt_mask.shape}.")
    if self.mesh is not None:
      # A no-op when the arrays already sit in these layouts (e.g. on the second call).
      state = jax.device_put(state, shd.state_shardings(state, self.mesh, self.rules))
      batch = shd.prompt_sharding(self.mesh, self.rules, prompt_ids.shape[0], num_samples)
      prompt_ids, prompt_mask = jax.device_put((prompt_ids, prompt_mask), batch)
    return self._program(state, prompt_ids, prompt_mask, key, params=params,
                         num_samples=num_samples)


@functools.lru_cache(maxsize=8)
def _cached_sampler(graphdef: nnx.GraphDef, mesh: Mesh | None, rules: shd.Rules) -> Sampler:
  return Sampler(graphdef, mesh=mesh, rules=rules)


def generate(model: Qwen2ForCausalLM, prompt_ids: jax.Array, prompt_mask: jax.Array,
             key: jax.Array, params: SamplingParams, num_samples: int = 1, *,
             mesh: Mesh | None = None, rules: shd.Rules = shd.SAMPLE_RULES) -> RolloutBatch:
  """Convenience: split `model` and sample with a cached `Sampler` (no recompile per call)."""
  graphdef, state = nnx.split(model)
  return _cached_sampler(graphdef, mesh, rules).generate(state, prompt_ids, prompt_mask, key,
                                                         params, num_samples)
