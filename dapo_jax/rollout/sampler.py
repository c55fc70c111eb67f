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

from dapo_jax import sharding as shd
from dapo_jax.models.init import cast_params
from dapo_jax.models.qwen2 import KVCache, Qwen2ForCausalLM, apply_rope, default_positions
from dapo_jax.rollout.sampling import SamplingParams, sample_logits


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
class DecodeCache:
  """The decode loop's KV cache, laid out for one-token steps.

  Keys are [N, K, E, S] (slots minor) and values [N, K, S, E], so both attention products are
  plain batched matmuls over (N, K). The model's [N, S, K, E] layout made XLA CPU transpose the
  whole cache of every layer on every step (a quarter of the decode time at S = 160). All rows
  of a static batch write the same slot, so the update is one in-place dynamic_update_slice,
  not a per-row scatter.
  """
  k: tuple[jax.Array, ...]  # L x [N, K, E, S]
  v: tuple[jax.Array, ...]  # L x [N, K, S, E]
  valid: jax.Array  # [N, S] bool


@flax.struct.dataclass
class _Loop:
  """The while_loop carry."""
  step: jax.Array  # [] next response column to fill
  last_N: jax.Array  # [N] token written at column step - 1
  done_N: jax.Array  # [N] a stop token has been emitted
  cache: DecodeCache
  response_NxR: jax.Array
  logprobs_NxR: jax.Array


def _decode_cache(cache: KVCache, num_samples: int, extra_slots: int) -> DecodeCache:
  """Prefilled [B, P] model cache -> [B*G, ..., P + extra_slots] decode cache (prompt-major).

  One transpose, pad and repeat per rollout; the new slots start invalid.
  """
  def convert(x, perm, slot_axis):
    pad = [(0, 0)] * x.ndim
    pad[slot_axis] = (0, extra_slots)
    x = jnp.repeat(jnp.pad(x.transpose(perm), pad), num_samples, axis=0)
    return shd.constrain(x, ("batch", "kv_heads", None, None))
  valid = jnp.repeat(jnp.pad(cache.valid, [(0, 0), (0, extra_slots)]), num_samples, axis=0)
  return DecodeCache(k=tuple(convert(x, (0, 2, 3, 1), 3) for x in cache.k),
                     v=tuple(convert(x, (0, 2, 1, 3), 2) for x in cache.v),
                     valid=shd.constrain(valid, ("batch", None)))


def _grow_cache(cache: DecodeCache, extra_slots: int) -> DecodeCache:
  """Appends invalid slots (one copy of the cache, once per segment)."""
  pad = lambda x, axis: jnp.pad(x, [(0, extra_slots) if a == axis else (0, 0)
                                    for a in range(x.ndim)])
  return DecodeCache(k=tuple(pad(x, 3) for x in cache.k), v=tuple(pad(x, 2) for x in cache.v),
                     valid=pad(cache.valid, 1))


def segment_ends(max_new_tokens: int, num_segments: int, min_columns: int = 16) -> list[int]:
  """Response columns at which decode segments end: ..., R/4, R/2, R (halving back from R).

  Segment i holds P + ends[i] - 1 cache slots. Segments shorter than `min_columns` columns are
  merged into the next one (short responses get a single loop).
  """
  ends = [-(-max_new_tokens // 2**i) for i in reversed(range(max(num_segments, 1)))]
  return sorted({e for e in ends if e >= min_columns} | {max_new_tokens})


def _decode_step(model: Qwen2ForCausalLM, tokens_N: jax.Array, positions_N: jax.Array,
                 slot: jax.Array, cache: DecodeCache) -> tuple[jax.Array, DecodeCache]:
  """One token per row through the model's own modules; returns fp32 logits [N, V].

  Only the cache layout and the attention core (always the einsum form: a one-token step is
  bandwidth-bound, so `attention_impl` only picks the prefill kernel) differ from
  `Qwen2ForCausalLM.__call__`; tests/test_sampler.py checks both against the full forward.
  """
  cfg = model.config
  dtype = cfg.jnp_dtype
  n, k, e = tokens_N.shape[0], cfg.num_key_value_heads, cfg.dim_per_head
  h = cfg.num_attention_heads
  pos_Nx1 = positions_N[:, None]
  valid_NxS = jax.lax.dynamic_update_slice(cache.valid, jnp.ones((n, 1), bool), (0, slot))
  x_Nx1xD = jnp.take(model.embed_tokens[...], tokens_N[:, None], axis=0).astype(dtype)
  x_Nx1xD = shd.constrain(x_Nx1xD, ("batch", "length", "act_embed"))
  new_k, new_v = [], []
  for layer, k_NxKxExS, v_NxKxSxE in zip(model.layers, cache.k, cache.v):
    attn = layer.self_attn
    y_Nx1xD = layer.input_layernorm(x_Nx1xD)
    q_Nx1xHxE = apply_rope(attn.q_proj(y_Nx1xD, dtype), pos_Nx1, attn.rope_theta)
    q_Nx1xHxE = shd.constrain(q_Nx1xHxE, ("batch", "length", "act_heads", None))
    kn_Nx1xKxE = apply_rope(attn.k_proj(y_Nx1xD, dtype), pos_Nx1, attn.rope_theta)
    vn_Nx1xKxE = attn.v_proj(y_Nx1xD, dtype)
    k_NxKxExS = jax.lax.dynamic_update_slice(
        k_NxKxExS, kn_Nx1xKxE.transpose(0, 2, 3, 1).astype(k_NxKxExS.dtype), (0, 0, 0, slot))
    v_NxKxSxE = jax.lax.dynamic_update_slice(
        v_NxKxSxE, vn_Nx1xKxE.transpose(0, 2, 1, 3).astype(v_NxKxSxE.dtype), (0, 0, slot, 0))
    new_k.append(k_NxKxExS)
    new_v.append(v_NxKxSxE)
    # Grouped-query attention as in models/attention.py: head = kv_head * G + g, fp32 softmax.
    q_NxKxGxE = q_Nx1xHxE.reshape(n, k, h // k, e)
    s_NxKxGxS = jnp.einsum("nkge,nkes->nkgs", q_NxKxGxE, k_NxKxExS.astype(dtype),
                           preferred_element_type=jnp.float32) * (e ** -0.5)
    s_NxKxGxS = jnp.where(valid_NxS[:, None, None], s_NxKxGxS, jnp.finfo(jnp.float32).min)
    p_NxKxGxS = jax.nn.softmax(s_NxKxGxS, axis=-1).astype(dtype)
    o_NxKxGxE = jnp.einsum("nkgs,nkse->nkge", p_NxKxGxS, v_NxKxSxE.astype(dtype))
    x_Nx1xD = x_Nx1xD + attn.o_proj(o_NxKxGxE.reshape(n, 1, h, e), dtype)
    x_Nx1xD = x_Nx1xD + layer.mlp(layer.post_attention_layernorm(x_Nx1xD))
    x_Nx1xD = shd.constrain(x_Nx1xD, ("batch", "length", "act_embed"))
  logits_NxV = model.logits_from_hidden(model.norm(x_Nx1xD))[:, 0]
  return logits_NxV, DecodeCache(k=tuple(new_k), v=tuple(new_v), valid=valid_NxS)


def _is_stop(tokens_N: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
  stop_N = jnp.zeros(tokens_N.shape, bool)
  for eos in eos_ids:  # a handful of ids: unrolled compares beat a gather
    stop_N |= tokens_N == eos
  return stop_N


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
    h_BxPxD, cache = model.hidden_states(prompt_ids_BxP, default_positions(mask_BxP), mask_BxP,
                                         model.init_cache(b, p))
    # The next-token logits sit at each row's last real token; gathering it (rather than
    # taking column P-1) makes left, right or no padding all work.
    last_B = jnp.max(jnp.where(mask_BxP, jnp.arange(p), 0), axis=-1)
    h_BxD = jnp.take_along_axis(h_BxPxD, last_B[:, None, None], axis=1)[:, 0]
    logits_NxV = jnp.repeat(model.logits_from_hidden(h_BxD[:, None])[:, 0], g, axis=0)
    logits_NxV = shd.constrain(logits_NxV, ("batch", "act_vocab"))
    # Decode writes response columns 0 .. R-2 into the cache (column R-1 is never fed back).
    ends = segment_ends(r, cache_segments)
    cache = _decode_cache(cache, g, ends[0] - 1)
    prompt_len_N = jnp.repeat(mask_BxP.sum(-1, dtype=jnp.int32), g)

    # Column 0 comes from the prefill logits. Each step folds its index into the key; rows
    # draw independent noise from it inside `categorical`.
    tok_N, lp_N = sample(logits_NxV, jax.random.fold_in(key, 0))
    put = lambda buf_NxR, col_N, step: jax.lax.dynamic_update_slice(
        buf_NxR, col_N[:, None].astype(buf_NxR.dtype), (0, step))
    init = _Loop(
        step=jnp.array(1, jnp.int32), last_N=tok_N, done_N=_is_stop(tok_N, params.eos_ids),
        cache=cache,
        response_NxR=put(jnp.full((n, r), params.pad_id, jnp.int32), tok_N, 0),
        logprobs_NxR=put(jnp.zeros((n, r), jnp.float32), lp_N, 0))

    def cond(c: _Loop, end: int) -> jax.Array:
      return (c.step < end) & ~jnp.all(c.done_N)

    def body(c: _Loop) -> _Loop:
      # Feed column step - 1: cache slot P + step - 1 (the same for every row, as prompts
      # share the padded length P), position = the row's real tokens before it.
      logits_NxV, cache = _decode_step(model, c.last_N, prompt_len_N + c.step - 1,
                                       p + c.step - 1, c.cache)
      tok_N, lp_N = sample(logits_NxV, jax.random.fold_in(key, c.step))
      # Rows already stopped keep emitting pad (masked out, log-prob 0): spec section 6.1.
      tok_N = jnp.where(c.done_N, params.pad_id, tok_N)
      lp_N = jnp.where(c.done_N, 0.0, lp_N)
      return _Loop(step=c.step + 1, last_N=tok_N, done_N=c.done_N | _is_stop(tok_N, params.eos_ids),
                   cache=cache, response_NxR=put(c.response_NxR, tok_N, c.step),
                   logprobs_NxR=put(c.logprobs_NxR, lp_N, c.step))

    # One while_loop per segment; each attends over a cache only as long as its last step
    # needs, so attention work follows the response length instead of P + R every step.
    out = init
    for i, end in enumerate(ends):
      if i:
        out = out.replace(cache=_grow_cache(out.cache, end - ends[i - 1]))
      out = jax.lax.while_loop(functools.partial(cond, end=end), body, out)

    # The mask is every column up to and including the first stop token.
    stop_NxR = _is_stop(out.response_NxR, params.eos_ids)
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

  The program is compiled once per (prompt shape, SamplingParams, num_samples); `trace_count`
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
    self.trace_count = 0
    self._program = jax.jit(
        functools.partial(_generate_program, graphdef=graphdef, mesh=mesh, rules=rules,
                          cache_segments=cache_segments, on_trace=self._count_trace),
        static_argnames=("params", "num_samples"))

  def _count_trace(self) -> None:
    self.trace_count += 1

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
