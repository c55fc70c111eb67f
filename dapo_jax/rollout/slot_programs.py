"""The continuous-batching engine's compiled programs: a queue of prefilled prompts and N slots.

Shapes: Q queued prompts, G samples per prompt, P prompt slots, N decode slots, S = P + R cache
slots, K decode steps per chunk, A most slots admitted per step.

The KV cache is dense (each slot reserves S positions, each queue entry P) or, with a
`PagedSpec`, one page pool per data shard (`models/paged_kv.py`): a queued prompt belongs to one
shard (the host picks it at enqueue), its pages are written once into that shard's pool and
shared by its G samples (reference counts, the last partial page copied on write), which only
that shard's slots take; a slot holds only the pages its tokens need and attention reads only
live pages.

* `init_program`: an empty queue and N empty slots (slots laid out over the batch axes).
* `enqueue_program`: prefills M prompts ONCE each into free queue entries (their cache, or their
  pages, and the hidden state of their last token); their waiting samples (budget > 0) stay
  there until slots take them.
* `chunk_program`: a `lax.while_loop` of up to K steps. Each step first admits queued samples
  into the free slots (first come, first served: dense, the prompt's cache row is copied, in
  place, into each of its samples' slots; paged, a free slot of the prompt's shard takes it and
  its page table points at the prompt's pages; the sample's first token is drawn from the
  prompt's hidden state), then runs one
  decode step over all N slots (the model's `decode_step` or `decode_step_paged`). Every slot
  that stored its token emits it; a slot frees itself after its stop token or budget.
  Paged admission also waits for free pages (one per live slot of the shard stays in
  reserve). A step in which a slot finds no page preempts its shard's youngest live sample
  (largest owner): its pages are freed and the chunk reports it; the host re-queues it from its
  first token, and as every token is drawn with fold_in(request key, position) it redraws the
  same tokens, whichever shard and slot it lands in.
  The loop ends after K steps, when nothing is left to decode, or when a queue entry is free,
  a shard has a free slot and no queued sample, and the host has prompts to enqueue. Its
  outputs are replicated, so the host reads them (once per chunk) on every process.

The host driver is `rollout/continuous.py`.

One piece: the engine's compiled programs share the queue, slot and page-pool layouts; admission,
decoding and preemption read and write the same carry.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from dapo_jax.infra import sharding as shd
from dapo_jax.models import paged_attention, paged_kv
from dapo_jax.models.kv_cache import KVCache, per_layer
from dapo_jax.rollout import slots as sl
from dapo_jax.rollout.sampling import SamplingParams, is_stop, request_keys
from dapo_jax.infra.tracing import TraceCounter

TRACES = TraceCounter()  # per program: tests assert no retrace
EMPTY_SEQ = jnp.iinfo(jnp.int32).max  # `seq` of a free queue entry (sorts last)
SMALL_ADMIT = 4  # admission variant for steps with few free slots


@dataclasses.dataclass(frozen=True)
class PagedSpec:
  """A paged engine's pools (static: part of the compiled programs' shape): one pool per data
  shard (S = the mesh's batch shards), each serving that shard's N/S slots; a queued prompt is
  written into one shard's pool (`Queue.shard`), and only that shard's slots take it."""
  num_pages: int  # pages in each shard's pool
  page_size: int  # tokens per page
  impl: str = "auto"  # decode attention kernel (`models/paged_attention.py`)
  shards: int = 1

  def max_pages(self, cache_length: int) -> int:
    """Most pages one slot holds: its prompt plus its response."""
    return paged_kv.pages_for(cache_length, self.page_size)


@flax.struct.dataclass
class Queue:
  """Q prefilled prompts whose samples wait for slots."""
  cache: KVCache | None  # dense: [Q, P]
  pages: jax.Array | None  # paged: [Q, M] int32 the prompt's pages (ids in its shard's pool,
  # -1 none), held until every sample is placed
  shard: jax.Array  # [Q] int32 the data shard whose pool holds the prompt and whose slots
  # take its samples (0 for a dense cache: any slot)
  hidden: jax.Array  # [Q, D] hidden state at the prompt's last token
  position: jax.Array  # [Q] int32 prompt tokens = position of the first response token
  key_id: jax.Array  # [Q] int32 prompt index (first fold of the request keys)
  seq: jax.Array  # [Q] int32 admission order; EMPTY_SEQ when free
  budget: jax.Array  # [Q, G] int32 per-sample response budgets
  waiting: jax.Array  # [Q, G] bool sample not yet in a slot (none: placed, or entry free)


@flax.struct.dataclass
class Slots:
  """N decode slots and who holds them."""
  decode: sl.DecodeState
  live: jax.Array  # [N] bool: holds a sample still generating
  owner: jax.Array  # [N] int32 seq * G + sample of the holder
  count: jax.Array  # [N] int32 tokens emitted
  budget: jax.Array  # [N] int32


@flax.struct.dataclass
class Engine:
  queue: Queue
  slots: Slots
  lost: jax.Array  # [] int32 prompts enqueue could not give pages (the host's count was wrong)


@flax.struct.dataclass
class ChunkOut:
  """What one chunk emitted, replicated: [K, N] with owner -1 where a slot emitted nothing."""
  tokens_KxN: jax.Array
  logprobs_KxN: jax.Array
  owner_KxN: jax.Array
  done_KxN: jax.Array  # the token ended its sample
  steps: jax.Array  # [] decode steps run
  queued: jax.Array  # [Q] samples of each entry not yet in a slot (0: entry free)
  preempted_KxS: jax.Array  # [K, S] int32 owner each shard preempted at each step, -1 none
  stalls: jax.Array  # [] int32 slot-steps that waited for a page (paged)
  free_pages: jax.Array  # [S] int32 free pages of each shard's pool after the chunk (-1 dense)
  live: jax.Array  # [S] int32 slots of each shard holding a sample after the chunk
  lost: jax.Array  # [] int32 the engine's `lost`


_STATIC = ("graphdef", "params", "mesh")


def _slot_rows(x: jax.Array) -> jax.Array:
  return shd.constrain(x, ("batch",) + (None,) * (x.ndim - 1))


def _replicated(x: jax.Array) -> jax.Array:
  return shd.constrain(x, (None,) * x.ndim)


@functools.partial(jax.jit, static_argnames=("graphdef", "num_slots", "queue_size",
                                             "num_samples", "prompt_length", "cache_length",
                                             "mesh", "paged"))
def init_program(state, *, graphdef, num_slots: int, queue_size: int, num_samples: int,
                 prompt_length: int, cache_length: int, mesh: Mesh | None,
                 paged: PagedSpec | None = None) -> Engine:
  TRACES.record("init")
  with shd.activation_sharding(mesh, shd.SAMPLE_RULES):
    model = nnx.merge(graphdef, state)
    if paged is None:
      decode = sl.empty_decode_state(model, num_slots, cache_length)
      kv = lambda x: shd.constrain(x, ("batch", "kv_heads", None, None))
      decode = decode.replace(cache=decode.cache.replace(
          k=per_layer(kv, decode.cache.k), v=per_layer(kv, decode.cache.v),
          valid=_slot_rows(decode.cache.valid)))
    else:
      # A pool per data shard ([S, ...] over the batch axes), KV heads split over `tensor`.
      pool = model.init_paged_cache(num_slots, paged.num_pages, paged.page_size,
                                    paged.max_pages(cache_length), shards=paged.shards,
                                    combined=paged_attention.uses_combined_pool(
                                        paged.impl, dtype=model.config.kv_dtype))
      pool = pool.map_pools(lambda x: shd.constrain(x, pool.pool_axes))
      pool = pool.replace(refcount=_slot_rows(pool.refcount), table=_slot_rows(pool.table),
                          length=_slot_rows(pool.length))
      decode = sl.empty_decode_state(model, num_slots, 1).replace(cache=pool)
    zn = jnp.zeros((num_slots,), jnp.int32)
    slots = Slots(decode=decode, live=_slot_rows(zn.astype(bool)), owner=_slot_rows(zn - 1),
                  count=_slot_rows(zn), budget=_slot_rows(zn))
    zq = jnp.zeros((queue_size,), jnp.int32)
    if paged is None:
      # Queue rows are whole on every device (any slot may take any queued prompt, so
      # admission copies rows without collectives) but KV heads split over `tensor` as the
      # slots' do: left to XLA, the queue came out fully replicated (16 GiB per chip for the
      # 32B config).
      heads = lambda x: shd.constrain(x, (None, "kv_heads", None, None))
      qcache = model.init_cache(queue_size, prompt_length)
      qcache, pages = qcache.replace(k=per_layer(heads, qcache.k),
                                     v=per_layer(heads, qcache.v)), None
    else:  # small ids, replicated: every shard reads the rows of the prompts it admits
      qcache, pages = None, _replicated(jnp.full(
          (queue_size, paged.max_pages(cache_length)), -1, jnp.int32))
    queue = Queue(cache=qcache, pages=pages, shard=zq,
                  hidden=jnp.zeros((queue_size, model.config.hidden_size),
                                   model.config.jnp_dtype),
                  position=zq, key_id=zq, seq=zq + EMPTY_SEQ,
                  budget=jnp.zeros((queue_size, num_samples), jnp.int32),
                  waiting=jnp.zeros((queue_size, num_samples), bool))
  return Engine(queue=queue, slots=slots, lost=jnp.zeros((), jnp.int32))


@functools.partial(jax.jit, static_argnames=("graphdef", "mesh"), donate_argnames=("engine",))
def enqueue_program(state, engine: Engine, tokens_MxP, true_length_M, key_id_M, seq_M,
                    budget_MxG, entry_M, shard_M=None, *, graphdef, mesh: Mesh | None) -> Engine:
  """Prefills M right-padded prompts into queue entries `entry_M` (Q = padding, dropped); the
  samples with a budget > 0 wait for slots (a re-queued preempted sample: only its own).
  Paged: prompt m's pages go into shard `shard_M[m]`'s pool only (None: shard 0)."""
  TRACES.record("enqueue")
  with shd.activation_sharding(mesh, shd.SAMPLE_RULES):
    cache, h_MxD, position_M = sl.prefill_hidden(nnx.merge(graphdef, state), tokens_MxP,
                                                 true_length_M)
  q, d, lost = engine.queue, engine.slots.decode, engine.lost
  shard_M = jnp.zeros_like(entry_M) if shard_M is None else shard_M
  put = lambda dst, src: dst.at[entry_M].set(src.astype(dst.dtype), mode="drop")
  if q.pages is None:
    qcache, pages = q.cache.insert(cache, entry_M), None
  else:  # each shard allocates and writes only its own prompts (in order: the host's rule)
    real_M = entry_M < q.seq.shape[0]
    mine_SxM = real_M[None] & (shard_M[None] == jnp.arange(d.cache.shards)[:, None])
    pool, pages_SxMxP, ok_SxM = jax.vmap(paged_kv.alloc_prompts, in_axes=(0, None, 0))(
        d.cache, position_M, mine_SxM)
    pool = jax.vmap(paged_kv.write_prompts, in_axes=(0, 0, None, None, None))(
        pool, pages_SxMxP, cache.k, cache.v, position_M)
    ok_M = ok_SxM.any(0)
    lost = lost + (real_M & ~ok_M).sum(dtype=jnp.int32)
    entry_M = jnp.where(ok_M, entry_M, q.seq.shape[0])  # a prompt without pages is dropped
    d = d.replace(cache=pool)
    # Other shards' rows are -1: the max is the prompt's shard's pages.
    qcache, pages = None, put(q.pages, _replicated(pages_SxMxP.max(0)))
  queue = Queue(cache=qcache, pages=pages, shard=put(q.shard, shard_M),
                hidden=put(q.hidden, h_MxD), position=put(q.position, position_M),
                key_id=put(q.key_id, key_id_M), seq=put(q.seq, seq_M),
                budget=put(q.budget, budget_MxG), waiting=put(q.waiting, budget_MxG > 0))
  return Engine(queue=queue, slots=engine.slots.replace(decode=d), lost=lost)


@flax.struct.dataclass
class _Admission:
  """The samples one step places, padded to `max_admit`: entries past `count` have slot N
  (dropped). Small arrays only: the cache rows are copied by `_place`."""
  slot: jax.Array  # [A] int32
  entry: jax.Array  # [A] int32 queue entry of the prompt
  token: jax.Array  # [A] int32 first response token
  logprob: jax.Array  # [A] fp32
  position: jax.Array  # [A] int32
  key: jax.Array  # [A, 2] uint32
  owner: jax.Array  # [A] int32
  budget: jax.Array  # [A] int32
  count: jax.Array  # [] int32 samples placed (the first `count` entries)
  waiting: jax.Array  # [Q, G] the queue's `waiting` after this admission


def _no_admission(engine: Engine, pad_to: int) -> _Admission:
  n, z = engine.slots.live.shape[0], jnp.zeros((pad_to,), jnp.int32)
  return _Admission(slot=z + n, entry=z, token=z, logprob=z.astype(jnp.float32), position=z,
                    key=jnp.zeros((pad_to, 2), jnp.uint32), owner=z - 1, budget=z,
                    count=jnp.zeros((), jnp.int32), waiting=engine.queue.waiting)


def _waiting_per_shard(q: Queue, shards: int) -> jax.Array:
  """[S] samples queued for each shard's slots."""
  return jnp.zeros((shards,), jnp.int32).at[q.shard].add(q.waiting.sum(1, dtype=jnp.int32))


def _choose(model, engine: Engine, base_key_data, params: SamplingParams, max_admit: int,
            pad_to: int, limit_S: jax.Array) -> _Admission:
  """Up to `max_admit` waiting samples, oldest prompt first, each prompt's in sample order, for
  the free slots of the prompts' shards (at most `limit_S` per shard); their first tokens
  sampled from the prompts' hidden states."""
  q, s = engine.queue, engine.slots
  (nq, g), n, shards = q.budget.shape, s.live.shape[0], limit_S.shape[0]
  ns, f = n // shards, nq * g
  # Every queued sample in first-come order ([F] = [Q * G]: prompts by seq, then samples).
  order_Q = jnp.argsort(q.seq)
  waiting_F = q.waiting[order_Q].reshape(-1)
  entry_F, sample_F = jnp.repeat(order_Q, g), jnp.tile(jnp.arange(g, dtype=jnp.int32), nq)
  shard_F = q.shard[entry_F]
  in_FxS = waiting_F[:, None] & (shard_F[:, None] == jnp.arange(shards)[None])
  rank_F = jnp.take_along_axis(jnp.cumsum(in_FxS, 0, dtype=jnp.int32), shard_F[:, None],
                               1)[:, 0] - 1  # among its shard's queued samples
  free_SxR = ~s.live.reshape(shards, ns)
  room_S = jnp.minimum(free_SxR.sum(1, dtype=jnp.int32), limit_S)
  eligible_F = waiting_F & (rank_F < room_S[shard_F])
  count = jnp.minimum(eligible_F.sum(dtype=jnp.int32), max_admit)
  ok_A = jnp.arange(max_admit) < count
  f_A = jnp.nonzero(eligible_F, size=max_admit, fill_value=f - 1)[0]
  entry_A, sample_A, shard_A = entry_F[f_A], sample_F[f_A], shard_F[f_A]
  # A shard's r-th eligible sample takes its r-th free slot (the eligible are a prefix of
  # each shard's queued samples, so the first `count` of them use distinct slots).
  free_slots_SxR = jnp.argsort(~free_SxR, axis=1, stable=True)
  slot_A = jnp.where(ok_A, shard_A * ns + free_slots_SxR[shard_A, jnp.minimum(rank_F[f_A],
                                                                            ns - 1)], n)
  keys_Ax2 = request_keys(base_key_data, jnp.stack([q.key_id[entry_A], sample_A], -1))
  position_A = q.position[entry_A]
  token_A, logprob_A = sl.sample_first(model, q.hidden[entry_A], position_A, keys_Ax2, params)
  pad = lambda x, v: jnp.pad(x, [(0, pad_to - max_admit)] + [(0, 0)] * (x.ndim - 1),
                             constant_values=v)
  return _Admission(slot=pad(slot_A, n), entry=pad(entry_A, 0), token=pad(token_A, 0),
                    logprob=pad(logprob_A, 0), position=pad(position_A, 0),
                    key=pad(keys_Ax2, 0), owner=pad(q.seq[entry_A] * g + sample_A, -1),
                    budget=pad(q.budget[entry_A, sample_A], 0), count=count,
                    waiting=q.waiting.at[jnp.where(ok_A, entry_A, nq), sample_A].set(
                        False, mode="drop"))


def _place(engine: Engine, adm: _Admission) -> Engine:
  """Writes an admission into its slots. Dense: the prompts' cache rows are copied one by one
  by a loop of `count` in-place row copies (none on the usual step), never the whole cache.
  Paged: the slots' page tables point at the prompts' pages (no KV is copied), and a prompt
  whose last waiting sample was placed drops the queue's hold on its pages."""
  q, s = engine.queue, engine.slots
  d = s.decode
  if q.pages is None:
    cache = jax.lax.fori_loop(
        0, adm.count,
        lambda i, c: c.copy_row(q.cache, adm.entry[i], adm.slot[i], adm.position[i]), d.cache)
    q = q.replace(waiting=adm.waiting)
  else:  # each shard attaches its own slots (global slot n: shard n // (N/S))
    shards, ns = d.cache.shards, d.cache.table.shape[1]
    pages_AxM = q.pages[adm.entry]

    def attach(c, shard):
      local_A = jnp.where(adm.slot // ns == shard, adm.slot % ns, ns)
      return paged_kv.attach(c, local_A, pages_AxM, adm.position)

    cache = jax.vmap(attach)(d.cache, jnp.arange(shards))
    emptied_Q = q.waiting.any(1) & ~adm.waiting.any(1)
    drop_SxQ = emptied_Q[None] & (q.shard[None] == jnp.arange(shards)[:, None])
    cache = jax.vmap(paged_kv.release)(cache, jnp.where(drop_SxQ[:, :, None], q.pages[None], -1))
    q = q.replace(waiting=adm.waiting, pages=jnp.where(emptied_Q[:, None], -1, q.pages))
  put = lambda dst, src: dst.at[adm.slot].set(src.astype(dst.dtype), mode="drop")
  zeros = jnp.zeros_like(adm.slot)
  decode = d.replace(cache=cache, token=put(d.token, adm.token),
                     logprob=put(d.logprob, adm.logprob), position=put(d.position, adm.position),
                     length=put(d.length, zeros), key=put(d.key, adm.key))
  slots = Slots(decode=decode, live=put(s.live, zeros == 0), owner=put(s.owner, adm.owner),
                count=put(s.count, zeros), budget=put(s.budget, adm.budget))
  return engine.replace(queue=q, slots=slots)


def _decode(model, s: Slots, params: SamplingParams, paged: PagedSpec | None):
  """One decode step over every slot: the state, the fed tokens, their log-probs, which slots
  emit (stored their token) and which found no page."""
  if paged is None:
    decode, fed_N, lp_N, _ = sl.decode_step(model, s.decode, params)
    return decode, fed_N, lp_N, s.live, jnp.zeros_like(s.live)
  decode, fed_N, lp_N, ok_N, short_N = sl.decode_step_paged(model, s.decode, s.live, params,
                                                            paged.impl)
  return decode, fed_N, lp_N, s.live & ok_N, s.live & short_N


def _preempt(s: Slots, decode: sl.DecodeState, live_N: jax.Array, short_N: jax.Array):
  """In each shard where a slot found no page, the youngest live sample (largest owner) gives
  back its pages and leaves (the host re-queues it). Returns the decode state, the live slots
  and each shard's preempted owner [S] (-1 none)."""
  shards = decode.cache.shards
  rows = lambda x: x.reshape(shards, -1)
  live, owner = rows(live_N), rows(s.owner)
  victim_S = jnp.argmax(jnp.where(live, owner, -1), axis=1)
  victim_SxR = (rows(short_N).any(1)[:, None] & live
                & (jnp.arange(live.shape[1])[None] == victim_S[:, None]))
  owner_S = jnp.where(victim_SxR.any(1), jnp.take_along_axis(owner, victim_S[:, None], 1)[:, 0],
                      -1)
  victim_N = victim_SxR.reshape(-1)
  cache = paged_kv.on_shards(paged_kv.free_slots, decode.cache, victim_N)
  return decode.replace(cache=cache), live_N & ~victim_N, owner_S


@flax.struct.dataclass
class _Carry:
  step: jax.Array
  engine: Engine
  out: ChunkOut
  short: jax.Array  # [S] bool a slot of the shard found no page at the last step: the shard
  # admits nothing now


@functools.partial(jax.jit, static_argnames=_STATIC + ("chunk_steps", "max_admit", "paged"),
                   donate_argnames=("engine",))
def chunk_program(state, engine: Engine, base_key_data, host_has_more, *, graphdef,
                  params: SamplingParams, mesh: Mesh | None, chunk_steps: int, max_admit: int,
                  paged: PagedSpec | None = None) -> tuple[Engine, ChunkOut]:
  """Up to `chunk_steps` steps of admit + decode; see the module docstring for when it stops."""
  TRACES.record("chunk")
  n = engine.slots.live.shape[0]
  shards = paged.shards if paged is not None else 1  # a dense queue serves any slot
  live_S = lambda e: e.slots.live.reshape(shards, -1).sum(1, dtype=jnp.int32)
  with shd.activation_sharding(mesh, shd.SAMPLE_RULES):
    model = nnx.merge(graphdef, state)

    def cond(c: _Carry) -> jax.Array:
      q, live_N = c.engine.queue, c.engine.slots.live
      waiting_S = _waiting_per_shard(q, shards)
      # A shard with a free slot and nothing queued for it while the host could fill a free
      # queue entry: end the chunk so that the host enqueues.
      idle = jnp.any((live_S(c.engine) < n // shards) & (waiting_S == 0))
      starved = idle & ~jnp.all(q.waiting.any(1)) & host_has_more
      return (c.step < chunk_steps) & (jnp.any(live_N) | jnp.any(q.waiting)) & ~starved

    def body(c: _Carry) -> _Carry:
      e = c.engine
      # What each shard can place now: its free slots, its queued samples and, paged, its free
      # pages less one in reserve per live slot (nothing the step after a slot found no page).
      free_S = n // shards - live_S(e)
      limit_S = jnp.full((shards,), n, jnp.int32)
      if paged is not None:
        limit_S = jnp.where(c.short, 0, jnp.maximum(
            e.slots.decode.cache.free_pages() - live_S(e), 0))
      can = jnp.minimum(jnp.minimum(free_S, _waiting_per_shard(e.queue, shards)), limit_S).sum()
      # Choosing costs the first-token logits of what it may place, so the usual step, with a
      # slot or two free, takes a small variant. The switch returns small arrays only: a
      # branch returning the engine made XLA copy the whole KV cache twice per step.
      sizes = sorted({min(SMALL_ADMIT, max_admit), max_admit})
      branches = [functools.partial(_no_admission, pad_to=max_admit)] + [
          functools.partial(_choose, model, base_key_data=base_key_data, params=params,
                            max_admit=a, pad_to=max_admit, limit_S=limit_S) for a in sizes]
      adm = jax.lax.switch(jnp.where(can == 0, 0, jnp.where(can <= sizes[0], 1, len(sizes))),
                           branches, e)
      e = _place(e, adm)
      s = e.slots
      decode, fed_N, lp_N, emit_N, short_N = _decode(model, s, params, paged)
      count_N = s.count + emit_N
      done_N = emit_N & (is_stop(fed_N, params.eos_ids) | (count_N >= s.budget))
      live_N = s.live & ~done_N
      o = c.out
      if paged is not None:
        decode = decode.replace(cache=paged_kv.on_shards(paged_kv.free_slots, decode.cache,
                                                         done_N))
        decode, live_N, victim_S = _preempt(s, decode, live_N, short_N)
        o = o.replace(preempted_KxS=o.preempted_KxS.at[c.step].set(victim_S),
                      stalls=o.stalls + short_N.sum(dtype=jnp.int32))
      put = lambda buf, row: jax.lax.dynamic_update_slice(buf, row[None], (c.step, 0))
      out = o.replace(tokens_KxN=put(o.tokens_KxN, fed_N),
                      logprobs_KxN=put(o.logprobs_KxN, jnp.where(emit_N, lp_N, 0.0)),
                      owner_KxN=put(o.owner_KxN, jnp.where(emit_N, s.owner, -1)),
                      done_KxN=put(o.done_KxN, done_N))
      slots = s.replace(decode=decode, live=live_N, count=count_N)
      return _Carry(step=c.step + 1, engine=e.replace(slots=slots), out=out,
                    short=short_N.reshape(shards, -1).any(1))

    full = lambda v, dtype: jnp.full((chunk_steps, n), v, dtype)
    zero, zero_S = jnp.zeros((), jnp.int32), jnp.zeros((shards,), jnp.int32)
    out = ChunkOut(tokens_KxN=full(0, jnp.int32), logprobs_KxN=full(0.0, jnp.float32),
                   owner_KxN=full(-1, jnp.int32), done_KxN=full(False, bool), steps=zero,
                   queued=engine.queue.waiting.sum(1, dtype=jnp.int32),
                   preempted_KxS=jnp.full((chunk_steps, shards), -1, jnp.int32), stalls=zero,
                   free_pages=zero_S - 1, live=zero_S, lost=engine.lost)
    last = jax.lax.while_loop(cond, body, _Carry(step=zero, engine=engine, out=out,
                                                 short=jnp.zeros((shards,), bool)))
    e = last.engine
    free_S = e.slots.decode.cache.free_pages() if paged is not None else zero_S - 1
    out = last.out.replace(steps=last.step, queued=e.queue.waiting.sum(1, dtype=jnp.int32),
                           free_pages=free_S, live=live_S(e), lost=e.lost)
    out = jax.tree.map(_replicated, out)
  return last.engine, out
