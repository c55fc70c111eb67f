"""Continuous-batching rollout: every decode slot stays busy; a finished slot is refilled at once.

Built from the engine's pure pieces (`prefill_rows`, `insert_rows`, `decode_step` in
`jetstream_engine`), in two compiled programs with the slot state donated:

* `refill`: prefills up to N waiting requests as one batch (padded to a power of two) and inserts
  them into the free slots; the prefill token is the first response token.
* `decode_chunk`: a `lax.while_loop` of up to `chunk_steps` decode steps that stops as soon as any
  slot finishes (stop token or its own budget), so the host syncs once per finish event (at most
  every `chunk_steps` steps), never once per token, and no slot idles waiting for a fixed chunk.

The result is the static sampler's `RolloutBatch`, so the trainer can pick either by config:

    sampler = ContinuousSampler(graphdef, num_slots=64)
    batch = sampler.generate(state, ids_BxP, mask_BxP, key, params, num_samples=G)

Request (b, g) draws its tokens from fold_in(fold_in(key, b), g) whatever slot it lands in, so
results do not depend on the schedule.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dapo_jax import sharding as shd
from dapo_jax.models.init import cast_params
from dapo_jax.rollout import jetstream_engine as je
from dapo_jax.rollout.sampler import RolloutBatch
from dapo_jax.rollout.sampling import SamplingParams
from dapo_jax.tracing import TraceCounter

TRACES = TraceCounter()  # per program: tests assert no retrace


@dataclasses.dataclass(frozen=True)
class Request:
  """One response to generate.

  Attributes:
    prompt_ids: the prompt's real tokens (no padding).
    prompt_index: with `sample_index`, picks the request's random stream.
    sample_index: which of the prompt's samples this is.
    max_new_tokens: this request's budget (default and cap: `SamplingParams.max_new_tokens`).
  """
  prompt_ids: Sequence[int]
  prompt_index: int = 0
  sample_index: int = 0
  max_new_tokens: int | None = None


@dataclasses.dataclass
class RolloutStats:
  """What the last rollout did (host-side counters; no extra device work)."""
  requests: int = 0
  refills: int = 0  # refill programs run
  chunks: int = 0  # decode_chunk programs run
  decode_steps: int = 0  # decode steps run (all slots advance together)
  busy_slot_steps: int = 0  # sum over steps of slots holding a live request
  num_slots: int = 0
  slot_of_request: list[int] = dataclasses.field(default_factory=list)  # last slot of each

  @property
  def utilization(self) -> float:
    """Fraction of slot-steps that decoded a live request."""
    return self.busy_slot_steps / max(1, self.decode_steps * self.num_slots)


@flax.struct.dataclass
class _Slots:
  decode: je.DecodeState
  active: jax.Array  # [N] bool: holds a request still generating
  fresh_done: jax.Array  # [N] bool: finished by its prefill token (budget 1 or a stop token)
  count: jax.Array  # [N] int32 response tokens emitted so far
  budget: jax.Array  # [N] int32


def _is_stop(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
  stop = jnp.zeros(tokens.shape, bool)
  for eos in eos_ids:  # a handful of ids: unrolled compares
    stop |= tokens == eos
  return stop


_STATIC = ("graphdef", "params", "mesh")


@functools.partial(jax.jit, static_argnames=("graphdef", "num_slots", "cache_length"))
def _init_program(state, *, graphdef, num_slots: int, cache_length: int) -> _Slots:
  decode = je.empty_decode_state(nnx.merge(graphdef, state), num_slots, cache_length)
  z = jnp.zeros((num_slots,), jnp.int32)
  return _Slots(decode=decode, active=z.astype(bool), fresh_done=z.astype(bool), count=z,
                budget=z)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("slots",))
def _refill_program(state, slots: _Slots, tokens_MxP, true_length_M, base_key_data, key_ids_Mx2,
                    slot_ids_M, budget_M, *, graphdef, params: SamplingParams,
                    mesh: Mesh | None) -> tuple[_Slots, jax.Array, jax.Array]:
  """Prefills M requests and inserts them; slot id N (out of range) marks batch padding."""
  TRACES.record("refill")
  with shd.activation_sharding(mesh, shd.SAMPLE_RULES):
    keys = je.request_keys(base_key_data, key_ids_Mx2)
    prefix = je.prefill_rows(nnx.merge(graphdef, state), tokens_MxP, true_length_M, keys, params)
  done_M = _is_stop(prefix.token, params.eos_ids) | (budget_M <= 1)
  put = lambda dst, src: dst.at[slot_ids_M].set(src, mode="drop")
  slots = _Slots(decode=je.insert_rows(prefix, slots.decode, slot_ids_M),
                 active=put(slots.active, ~done_M), fresh_done=put(slots.fresh_done, done_M),
                 count=put(slots.count, jnp.ones_like(budget_M)),
                 budget=put(slots.budget, budget_M))
  return slots, prefix.token, prefix.logprob


@flax.struct.dataclass
class _Chunk:
  step: jax.Array
  any_done: jax.Array
  slots: _Slots
  tokens_KxN: jax.Array
  logprobs_KxN: jax.Array


@functools.partial(jax.jit, static_argnames=_STATIC + ("chunk_steps",),
                   donate_argnames=("slots",))
def _decode_chunk_program(state, slots: _Slots, *, graphdef, params: SamplingParams,
                          mesh: Mesh | None, chunk_steps: int
                          ) -> tuple[_Slots, jax.Array, jax.Array, jax.Array]:
  """Decodes until a slot finishes or `chunk_steps` steps; tokens are -1 where not emitted.

  Returns the slots, tokens and log-probs [chunk_steps, N], and the number of steps run.
  """
  TRACES.record("decode_chunk")
  n = slots.count.shape[0]
  with shd.activation_sharding(mesh, shd.SAMPLE_RULES):
    model = nnx.merge(graphdef, state)

    def cond(c: _Chunk) -> jax.Array:
      return (c.step < chunk_steps) & ~c.any_done

    def body(c: _Chunk) -> _Chunk:
      s = c.slots
      decode, _, _, _ = je.decode_step(model, s.decode, params)
      live = s.active
      count = s.count + live
      finished = live & (_is_stop(decode.token, params.eos_ids) | (count >= s.budget))
      put = lambda buf, row: jax.lax.dynamic_update_slice(buf, row[None], (c.step, 0))
      return _Chunk(step=c.step + 1, any_done=jnp.any(finished),
                    slots=s.replace(decode=decode, active=live & ~finished, count=count),
                    tokens_KxN=put(c.tokens_KxN, jnp.where(live, decode.token, -1)),
                    logprobs_KxN=put(c.logprobs_KxN, jnp.where(live, decode.logprob, 0.0)))

    init = _Chunk(step=jnp.array(0, jnp.int32), any_done=jnp.any(slots.fresh_done),
                  slots=slots.replace(fresh_done=jnp.zeros_like(slots.fresh_done)),
                  tokens_KxN=jnp.full((chunk_steps, n), -1, jnp.int32),
                  logprobs_KxN=jnp.zeros((chunk_steps, n), jnp.float32))
    out = jax.lax.while_loop(cond, body, init)
  return out.slots, out.tokens_KxN, out.logprobs_KxN, out.step


def _pow2_at_least(x: int, cap: int) -> int:
  m = 1
  while m < x:
    m *= 2
  return min(m, cap)


class ContinuousSampler:
  """Continuous-batching rollout over `num_slots` decode slots.

  Args:
    graphdef: the model graph (`nnx.split(model)[0]`); the state is passed per call.
    num_slots: concurrent decode rows N.
    chunk_steps: most decode steps per compiled call (the host still syncs at every finish).
    mesh: optional device mesh (parameters laid out with `SAMPLE_RULES`).
    max_prefill_length: longest prompt accepted (prompts are padded to the smallest JetStream
      bucket, 16, 32, 64, ..., that holds the longest prompt of a call).
  """

  def __init__(self, graphdef: nnx.GraphDef, *, num_slots: int = 8, chunk_steps: int = 32,
               mesh: Mesh | None = None, max_prefill_length: int | None = None):
    if num_slots < 1 or chunk_steps < 1:
      raise ValueError(f"num_slots ({num_slots}) and chunk_steps ({chunk_steps}) must be >= 1.")
    self.graphdef = graphdef
    self.max_prefill_length = max_prefill_length or je.PREFILL_BUCKETS[-1]
    self.num_slots = num_slots
    self.chunk_steps = chunk_steps
    self.mesh = mesh if mesh is not None and mesh.size > 1 else None
    self.last_stats = RolloutStats()

  def generate(self, state: nnx.State, prompt_ids: jax.Array, prompt_mask: jax.Array,
               key: jax.Array, params: SamplingParams, num_samples: int = 1,
               max_new_tokens: Sequence[int] | None = None) -> RolloutBatch:
    """`Sampler.generate`'s contract (rows prompt-major, row = b*G + g) plus optional per-row
    budgets `max_new_tokens` ([B*G], each <= params.max_new_tokens)."""
    ids_BxP, mask_BxP = np.asarray(prompt_ids), np.asarray(prompt_mask).astype(bool)
    if ids_BxP.ndim != 2 or mask_BxP.shape != ids_BxP.shape:
      raise ValueError(f"prompt_ids and prompt_mask must both be [B, P]; got {ids_BxP.shape} "
                       f"and {mask_BxP.shape}.")
    g = num_samples
    n = ids_BxP.shape[0] * g
    if max_new_tokens is not None and len(max_new_tokens) != n:
      raise ValueError(f"max_new_tokens has {len(max_new_tokens)} budgets for {n} rows.")
    requests = [Request(ids_BxP[i // g][mask_BxP[i // g]].tolist(), prompt_index=i // g,
                        sample_index=i % g,
                        max_new_tokens=None if max_new_tokens is None else int(max_new_tokens[i]))
                for i in range(n)]
    batch = self.run(state, requests, key, params)
    return batch.replace(prompt_ids=jnp.asarray(np.repeat(ids_BxP, g, axis=0), jnp.int32),
                         prompt_mask=jnp.asarray(np.repeat(mask_BxP, g, axis=0)))

  def run(self, state: nnx.State, requests: Sequence[Request], key: jax.Array,
          params: SamplingParams) -> RolloutBatch:
    """Generates every request; rows of the result follow `requests` (prompts left-padded)."""
    r_max, n_slots = params.max_new_tokens, self.num_slots
    budgets = [r_max if q.max_new_tokens is None else q.max_new_tokens for q in requests]
    bad = [b for b in budgets if not 1 <= b <= r_max]
    if bad:
      raise ValueError(f"Per-request max_new_tokens must be in [1, {r_max}] "
                       f"(SamplingParams.max_new_tokens); got {bad[:4]}.")
    if any(len(q.prompt_ids) == 0 for q in requests):
      raise ValueError("Every request needs at least one prompt token.")
    longest = max((len(q.prompt_ids) for q in requests), default=1)
    if longest > self.max_prefill_length:
      raise ValueError(f"A prompt has {longest} tokens; max_prefill_length is "
                       f"{self.max_prefill_length}.")
    p = je.prefill_bucket(longest)
    if self.mesh is not None:
      state = jax.device_put(state, shd.state_shardings(state, self.mesh, shd.SAMPLE_RULES))
    # fp32 master weights of a bf16 model: cast once per rollout, not on every decode step.
    state = cast_params(state, nnx.merge(self.graphdef, state).config.jnp_param_dtype)
    static = dict(graphdef=self.graphdef, params=params, mesh=self.mesh)
    slots = _init_program(state, graphdef=self.graphdef, num_slots=n_slots,
                          cache_length=p + r_max)
    is_typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    base_key = jax.random.key_data(key) if is_typed else key  # raw uint32[2] keys pass as is
    stats = RolloutStats(requests=len(requests), slot_of_request=[-1] * len(requests),
                         num_slots=n_slots)
    out_tokens = [[] for _ in requests]
    out_logprobs = [[] for _ in requests]
    waiting = collections.deque(range(len(requests)))
    slot_req = [-1] * n_slots

    while waiting or any(i >= 0 for i in slot_req):
      free = [s for s in range(n_slots) if slot_req[s] < 0]
      placed = list(zip(free, [waiting.popleft() for _ in range(min(len(free), len(waiting)))]))
      first = None
      if placed:
        m = _pow2_at_least(len(placed), n_slots)
        tokens = np.zeros((m, p), np.int32)
        true_len = np.ones((m,), np.int32)
        ids = np.zeros((m, 2), np.int32)
        slot_ids = np.full((m,), n_slots, np.int32)  # out of range: padding rows are dropped
        budget = np.ones((m,), np.int32)
        for row, (s, i) in enumerate(placed):
          q = requests[i]
          tokens[row, :len(q.prompt_ids)] = q.prompt_ids
          true_len[row], ids[row] = len(q.prompt_ids), (q.prompt_index, q.sample_index)
          slot_ids[row], budget[row] = s, budgets[i]
          slot_req[s] = i
          stats.slot_of_request[i] = s
        slots, first_tok, first_lp = _refill_program(state, slots, tokens, true_len, base_key,
                                                     ids, slot_ids, budget, **static)
        first = (first_tok, first_lp)
        stats.refills += 1
      slots, tok_KxN, lp_KxN, steps = _decode_chunk_program(
          state, slots, chunk_steps=self.chunk_steps, **static)
      # One host sync per chunk: the refill's first tokens, the chunk's tokens, and who is live.
      first, tok_KxN, lp_KxN, steps, active_N = jax.device_get(
          (first, tok_KxN, lp_KxN, steps, slots.active))
      stats.chunks += 1
      for row, (s, i) in enumerate(placed):
        out_tokens[i].append(int(first[0][row]))
        out_logprobs[i].append(float(first[1][row]))
      emitted_KxN = tok_KxN >= 0
      stats.decode_steps += int(steps)
      stats.busy_slot_steps += int(emitted_KxN.sum())
      for s, i in enumerate(slot_req):
        if i < 0:
          continue
        keep = emitted_KxN[:, s]
        out_tokens[i].extend(tok_KxN[keep, s].tolist())
        out_logprobs[i].extend(lp_KxN[keep, s].tolist())
        if not active_N[s]:
          slot_req[s] = -1
    self.last_stats = stats
    return _to_batch(requests, out_tokens, out_logprobs, params)


def make_rollout_fn(graphdef: nnx.GraphDef, *, mesh: Mesh | None = None, tokenizer=None,
                    max_concurrent_decodes: int = 64, max_prefill_length: int | None = None,
                    chunk_steps: int = 32):
  """The rollout callable `rollout.factory` wants: `Sampler.generate`'s signature."""
  del tokenizer  # stop tokens come with the call's SamplingParams.eos_ids
  return ContinuousSampler(graphdef, num_slots=max_concurrent_decodes, chunk_steps=chunk_steps,
                           mesh=mesh, max_prefill_length=max_prefill_length).generate


def _to_batch(requests: Sequence[Request], tokens: list[list[int]], logprobs: list[list[float]],
              params: SamplingParams) -> RolloutBatch:
  """Host lists -> RolloutBatch (prompts left-padded with pad_id, responses right-padded)."""
  n, r = len(requests), params.max_new_tokens
  p = max(len(q.prompt_ids) for q in requests) if requests else 0
  prompt_ids = np.full((n, p), params.pad_id, np.int32)
  prompt_mask = np.zeros((n, p), bool)
  response = np.full((n, r), params.pad_id, np.int32)
  logprob = np.zeros((n, r), np.float32)
  lengths = np.array([len(t) for t in tokens], np.int32)
  eos = set(params.eos_ids)
  for i, q in enumerate(requests):
    k = len(q.prompt_ids)
    prompt_ids[i, p - k:], prompt_mask[i, p - k:] = q.prompt_ids, True
    response[i, :lengths[i]], logprob[i, :lengths[i]] = tokens[i], logprobs[i]
  truncated = np.array([not (t and t[-1] in eos) for t in tokens], bool)
  mask = np.arange(r)[None] < lengths[:, None]
  return RolloutBatch(prompt_ids=jnp.asarray(prompt_ids), prompt_mask=jnp.asarray(prompt_mask),
                      response_ids=jnp.asarray(response), response_mask=jnp.asarray(mask),
                      logprobs=jnp.asarray(logprob), lengths=jnp.asarray(lengths),
                      truncated=jnp.asarray(truncated),
                      num_steps=jnp.asarray(int(lengths.max(initial=0)), jnp.int32))
