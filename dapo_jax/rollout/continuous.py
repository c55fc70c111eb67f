"""Continuous-batching rollout: every decode slot stays busy; a finished slot is refilled at once.

The host side of the engine whose compiled programs live in `rollout/slot_programs.py`:

* `ContinuousStream` (the `rollout.stream.RolloutStream` interface): `admit` queues a prompt on
  the host; `poll` enqueues waiting prompts into the device queue (each prefilled once; its KV
  later copied into its G slots, or with the paged cache written once into pages its G slots
  share), then runs compiled chunks of decode steps that admit queued samples into free slots
  themselves, reading the emitted tokens once per chunk, until a group has finished. A sample
  the paged engine preempted (out of pages) is re-queued here and decoded again from its first
  token: it draws the same tokens. With a pool per data shard, the host gives each enqueued
  prompt to one shard (`_assign`): its pages are written there only and its samples decode in
  that shard's slots.
* `ContinuousSampler.generate`: the static sampler's contract (rows prompt-major) on a stream.

    sampler = ContinuousSampler(graphdef, num_slots=64, mesh=mesh)
    batch = sampler.generate(state, ids_BxP, mask_BxP, key, params, num_samples=G)

Sample g of prompt i draws from fold_in(fold_in(key, i), g) (token at position q: one more fold),
whatever slot or chunk it lands in, so results do not depend on the schedule. With a mesh, slots
are split over its batch axes; on several processes every process runs the same host schedule
on the same (replicated) chunk outputs, so all take the same decisions.

One piece: the host side of one engine: the stream's admission, queue, preemption and the chunk loop
are one state machine over the same slots.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dapo_jax.infra import distributed
from dapo_jax.infra import sharding as shd
from dapo_jax.models import paged_attention, paged_kv
from dapo_jax.models.init import cast_params
from dapo_jax.rollout import engine_programs
from dapo_jax.rollout import slot_programs as prog
from dapo_jax.rollout import slots as sl
from dapo_jax.rollout.sampler import RolloutBatch
from dapo_jax.rollout.sampling import SamplingParams
from dapo_jax.rollout.stream import FinishedGroup

TRACES = prog.TRACES


@dataclasses.dataclass
class RolloutStats:
  """What a stream did so far (host-side counters; no extra device work)."""
  prompts: int = 0  # admitted
  enqueues: int = 0  # enqueue (prefill) programs run
  prompts_prefilled: int = 0
  chunks: int = 0  # chunk programs run (= host reads)
  decode_steps: int = 0  # decode steps run (all slots advance together)
  busy_slot_steps: int = 0  # slot-steps that emitted a token of a live sample
  num_slots: int = 0
  kv_pages: int = 0  # paged: pages in the pool (0: dense cache)
  min_free_pages: int = 0  # paged: fewest free pages seen after a chunk
  preemptions: int = 0  # paged: samples sent back to the queue for want of pages
  preempted_tokens: int = 0  # tokens those samples had emitted (decoded again)
  stalled_slot_steps: int = 0  # paged: slot-steps that waited for a page
  peak_live_slots: int = 0  # most slots decoding at once

  @property
  def utilization(self) -> float:
    """Fraction of decoded slot-steps that emitted a token of a live sample."""
    return self.busy_slot_steps / max(1, self.decode_steps * self.num_slots)

  def to_dict(self) -> dict[str, float]:
    d = {k: float(v) for k, v in dataclasses.asdict(self).items()}
    # The keys every `RolloutStream.stats` gives (the first token also comes from a decode step).
    d.update(slot_utilization=self.utilization, decoded_tokens=float(self.busy_slot_steps),
             slot_steps=float(self.decode_steps * self.num_slots))
    return d


@dataclasses.dataclass
class _Group:
  """A prompt admitted to a stream: its samples' tokens as they arrive."""
  prompt_index: int
  prompt_ids: np.ndarray
  budget: np.ndarray  # [G]
  tokens: list[list[int]]
  logprobs: list[list[float]]
  versions: list[list[int]]
  done: int = 0


class ContinuousStream:
  """One stream of prompts through a `ContinuousSampler` (see `rollout.stream.RolloutStream`).

  Args beyond the protocol: `admit(..., max_new_tokens=[G budgets])` caps each sample's length
  (default `params.max_new_tokens`), e.g. to replay a fixed length mix.
  """

  def __init__(self, sampler: ContinuousSampler, state: nnx.State, params: SamplingParams,
               num_samples: int, key: jax.Array, prompt_length: int):
    if num_samples < 1:
      raise ValueError(f"num_samples must be >= 1, got {num_samples}.")
    self._s, self._params, self._g = sampler, params, num_samples
    if prompt_length > sampler.max_prefill_length:
      raise ValueError(f"A prompt of {prompt_length} tokens exceeds max_prefill_length="
                       f"{sampler.max_prefill_length}.")
    self._p = sl.prefill_bucket(prompt_length)  # the queue's prompt slots
    self._max_prompt = min(self._p, sampler.max_prefill_length)  # the longest `admit` takes
    mesh = sampler.mesh
    if mesh is not None:
      state = jax.device_put(state, shd.state_shardings(state, mesh, shd.SAMPLE_RULES))
    # fp32 master weights of a bf16 model: cast once per stream, not on every decode step.
    self._state = cast_params(state, nnx.merge(sampler.graphdef, state).config.jnp_param_dtype)
    is_typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    key_data = np.asarray(jax.device_get(jax.random.key_data(key) if is_typed else key))
    self._queue_size = sampler.queue_prompts(num_samples)
    cache_length = self._p + params.max_new_tokens
    self._paged = sampler.paged_spec(self._state, self._max_prompt, params.max_new_tokens,
                                     self._queue_size)
    self._progs = sampler.programs(self._state, queue_size=self._queue_size,
                                   num_samples=num_samples, prompt_length=self._p,
                                   cache_length=cache_length, params=params, paged=self._paged)
    self._engine = self._progs.init(self._state)
    self._key = self._put(key_data.astype(np.uint32))
    self._free_entries = list(range(self._queue_size))
    # (seq, budgets [G]) not yet enqueued; a re-queued preempted sample has only its own budget.
    self._host: collections.deque[tuple[int, np.ndarray]] = collections.deque()
    self._groups: dict[int, _Group] = {}  # seq -> group, until returned by poll
    self._index_seen: set[int] = set()
    self._stats = RolloutStats(num_slots=sampler.num_slots)
    # Paged: the host mirrors each shard's page count to enqueue only prompts that get pages,
    # and knows each queue entry's shard, its pages and each shard's live slots.
    pages = self._paged.num_pages if self._paged else 0
    shards = self._paged.shards if self._paged else 1
    self._stats.kv_pages = self._stats.min_free_pages = pages
    self._free_pages = np.full((shards,), pages, np.int64)
    self._entry_pages = np.zeros((self._queue_size,), np.int64)
    self._entry_shard = np.zeros((self._queue_size,), np.int64)
    self._entry_waiting = np.zeros((self._queue_size,), np.int64)  # samples not yet in a slot
    self._live = np.zeros((shards,), np.int64)
    self._page_blocked = False
    self._version, self._versioned = 0, False  # `set_weights`

  def _put(self, x: np.ndarray):
    """A host value (the same on every process) as a replicated input of the programs."""
    x = np.asarray(x)
    sharding = self._progs.replicated
    if self._s.mesh is None:
      return jax.device_put(x, sharding)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

  def admit(self, prompt_ids: Sequence[int], prompt_index: int,
            max_new_tokens: Sequence[int] | None = None) -> None:
    ids = np.asarray(prompt_ids, np.int32).reshape(-1)
    r = self._params.max_new_tokens
    if ids.size == 0:
      raise ValueError("A prompt needs at least one token.")
    limit = self._max_prompt
    if ids.size > limit:
      raise ValueError(f"A prompt has {ids.size} tokens; this stream takes at most {limit} "
                       f"(max_prefill_length {self._s.max_prefill_length}).")
    if prompt_index in self._index_seen:
      raise ValueError(f"prompt_index {prompt_index} was already admitted to this stream.")
    budget = np.full((self._g,), r, np.int32) if max_new_tokens is None else np.asarray(
        max_new_tokens, np.int32).reshape(-1)
    if budget.shape != (self._g,) or np.any((budget < 1) | (budget > r)):
      raise ValueError(f"max_new_tokens must be {self._g} budgets in [1, {r}] "
                       f"(SamplingParams.max_new_tokens); got {budget.tolist()}.")
    self._index_seen.add(prompt_index)
    seq = self._stats.prompts
    self._stats.prompts += 1
    self._groups[seq] = _Group(prompt_index, ids, budget, [[] for _ in range(self._g)],
                               [[] for _ in range(self._g)], [[] for _ in range(self._g)])
    self._host.append((seq, budget))

  @property
  def num_pending(self) -> int:
    return len(self._groups)

  def _assign(self, take: int) -> list[int]:
    """The shards of the first host prompts the paged pools take now (all of the first `take`
    with a dense cache: shard 0). Each goes to the shard with the fewest samples decoding or
    queued (then the most free pages, then the lowest index) among those where it gets its
    pages (the device's `alloc_prompts` rule) and the queue's holds leave room for one sample
    of the longest prompt to run to its full length, so that each shard's oldest sample can
    always finish; the first prompt no shard takes ends the list (first come, first served).
    Computed from the chunk outputs every process reads, so every process agrees."""
    if self._paged is None:
      return [0] * take
    t, pages, shards = self._paged.page_size, self._paged.num_pages, self._paged.shards
    one = self._paged.max_pages(self._max_prompt + self._params.max_new_tokens) + 1
    free = self._free_pages.copy()
    held = np.bincount(self._entry_shard, self._entry_pages, shards).astype(np.int64)
    load = self._live + np.bincount(self._entry_shard, self._entry_waiting, shards).astype(
        np.int64)
    out = []
    for i in range(take):
      seq, budget = self._host[i]
      need = paged_kv.pages_for(self._groups[seq].prompt_ids.size, t)
      fits = np.flatnonzero((need <= free) & (held + need + one <= pages))
      if not fits.size:
        break
      shard = min(fits.tolist(), key=lambda x: (load[x], -free[x], x))
      out.append(shard)
      free[shard] -= need
      held[shard] += need
      load[shard] += int((budget > 0).sum())
    return out

  def _enqueue(self) -> None:
    """Prefills as many host-side prompts as the device queue has free entries (and the paged
    pools have pages) for."""
    room = min(len(self._free_entries), len(self._host))
    shards = self._assign(room)
    take = len(shards)
    self._page_blocked = take < room
    if not take:
      return
    m = _pow2_at_least(take, self._queue_size)
    tokens = np.zeros((m, self._p), np.int32)
    true_len = np.ones((m,), np.int32)
    key_id, seq = np.zeros((m,), np.int32), np.zeros((m,), np.int32)
    budget = np.ones((m, self._g), np.int32)
    entry = np.full((m,), self._queue_size, np.int32)  # out of range: padding, dropped
    shard = np.zeros((m,), np.int32)
    for row in range(take):
      sq, budget[row] = self._host.popleft()
      grp = self._groups[sq]
      tokens[row, :grp.prompt_ids.size] = grp.prompt_ids
      true_len[row], key_id[row], seq[row] = grp.prompt_ids.size, grp.prompt_index, sq
      e = entry[row] = self._free_entries.pop(0)
      if self._paged is not None:
        need = paged_kv.pages_for(grp.prompt_ids.size, self._paged.page_size)
        shard[row] = self._entry_shard[e] = shards[row]
        self._entry_pages[e], self._entry_waiting[e] = need, int((budget[row] > 0).sum())
        self._free_pages[shards[row]] -= need
    args = map(self._put, (tokens, true_len, key_id, seq, budget, entry, shard))
    self._engine = self._progs.enqueue(self._state, self._engine, *args)
    self._stats.enqueues += 1
    self._stats.prompts_prefilled += take

  def _chunk(self) -> list[int]:
    """One compiled chunk; returns the seqs of the groups it completed."""
    # Prompts the pool has no pages for yet are not "more to enqueue": the chunk runs on.
    more = bool(self._host) and not self._page_blocked
    self._engine, out = self._progs.chunk(self._state, self._engine, self._key,
                                          self._put(np.asarray(more)))
    out = distributed.global_to_host(out)  # the one host read of the chunk
    st = self._stats
    st.chunks += 1
    st.decode_steps += int(out.steps)
    queued = np.asarray(out.queued)
    self._free_entries = np.flatnonzero(queued == 0).tolist()  # every sample in a slot
    if self._paged is not None:
      if int(out.lost):
        raise RuntimeError(f"The paged engine could not give {int(out.lost)} enqueued prompt(s) "
                           "pages although the host counted enough; please report this.")
      self._entry_pages[queued == 0] = 0  # the entry dropped its hold
      self._entry_waiting = queued.astype(np.int64)
      self._free_pages = np.asarray(out.free_pages, np.int64)
      self._live = np.asarray(out.live, np.int64)
      st.min_free_pages = min(st.min_free_pages, int(self._free_pages.min()))
      st.stalled_slot_steps += int(out.stalls)
    owner = np.asarray(out.owner_KxN)
    k_idx, n_idx = np.nonzero(owner >= 0)  # step-major: each sample's tokens in order
    st.peak_live_slots = max(st.peak_live_slots, int((owner >= 0).sum(1).max(initial=0)))
    st.busy_slot_steps += k_idx.size
    finished = []
    for k, n in zip(k_idx.tolist(), n_idx.tolist()):
      sq, g = divmod(int(owner[k, n]), self._g)
      grp = self._groups[sq]
      grp.tokens[g].append(int(out.tokens_KxN[k, n]))
      grp.logprobs[g].append(float(out.logprobs_KxN[k, n]))
      grp.versions[g].append(self._version)
      if out.done_KxN[k, n]:
        grp.done += 1
        if grp.done == self._g:
          finished.append(sq)
    for owner_id in np.asarray(out.preempted_KxS)[:int(out.steps)].reshape(-1):
      if owner_id >= 0:  # decoded again from its first token, ahead of new prompts
        sq, g = divmod(int(owner_id), self._g)
        grp = self._groups[sq]
        st.preemptions += 1
        st.preempted_tokens += len(grp.tokens[g])
        grp.tokens[g], grp.logprobs[g], grp.versions[g] = [], [], []
        only = np.where(np.arange(self._g) == g, grp.budget, 0).astype(np.int32)
        self._host.appendleft((sq, only))
    return finished

  def poll(self) -> list[FinishedGroup]:
    finished: list[int] = []
    while self._groups and not finished:
      before = (self._stats.enqueues, self._stats.decode_steps)
      self._enqueue()
      finished = self._chunk()
      if (self._stats.enqueues, self._stats.decode_steps) == before:  # never spin silently
        raise RuntimeError(f"The continuous engine made no progress with {len(self._groups)} "
                           "prompt(s) pending; please report this with the config.")
    return [self._finish(sq) for sq in sorted(finished)]

  def _finish(self, seq: int) -> FinishedGroup:
    grp = self._groups.pop(seq)
    r, pad, eos = self._params.max_new_tokens, self._params.pad_id, set(self._params.eos_ids)
    ids = np.full((self._g, r), pad, np.int32)
    logprobs = np.zeros((self._g, r), np.float32)
    versions = np.full((self._g, r), -1, np.int32)
    lengths = np.array([len(t) for t in grp.tokens], np.int32)
    for g, (t, lp, v) in enumerate(zip(grp.tokens, grp.logprobs, grp.versions)):
      ids[g, :len(t)], logprobs[g, :len(t)], versions[g, :len(t)] = t, lp, v
    return FinishedGroup(prompt_index=grp.prompt_index, prompt_ids=grp.prompt_ids,
                         response_ids=ids, response_mask=np.arange(r)[None] < lengths[:, None],
                         logprobs=logprobs, lengths=lengths,
                         truncated=np.array([not (t and t[-1] in eos) for t in grp.tokens]),
                         versions=versions if self._versioned else None)

  def set_weights(self, state: nnx.State | None, version: int) -> None:
    """Decodes with ``state`` from the next chunk on (the same shapes, e.g. the next policy
    version's rollout weights; None: the weights stay): a partial rollout. Samples in flight
    keep their KV cache and continue; every token from then on is labelled ``version``
    (`FinishedGroup.versions`), those before with the version set before (0 if none was)."""
    if state is not None:
      if self._s.mesh is not None:
        state = jax.device_put(state, shd.state_shardings(state, self._s.mesh, shd.SAMPLE_RULES))
      self._state = cast_params(state, nnx.merge(self._s.graphdef, state).config.jnp_param_dtype)
    self._version, self._versioned = int(version), True

  def stats(self) -> dict[str, float]:
    return self._stats.to_dict()

  @property
  def last_stats(self) -> RolloutStats:
    return self._stats

  def close(self) -> None:
    self._engine = None
    self._groups.clear()
    self._host.clear()


def _pow2_at_least(x: int, cap: int) -> int:
  return min(1 << max(0, (x - 1).bit_length()), cap)


class ContinuousSampler:
  """Continuous-batching rollout over `num_slots` decode slots.

  Args:
    graphdef: the model graph (`nnx.split(model)[0]`); the state is passed per call.
    num_slots: concurrent decode rows N (with a mesh: a multiple of its batch shards).
    chunk_steps: decode steps per compiled call; the host reads results once per chunk.
    mesh: optional device mesh: parameters laid out with `SAMPLE_RULES`, slots split over the
      batch axes.
    max_prefill_length: longest prompt accepted (prompts are padded to the smallest JetStream
      bucket, 16, 32, 64, ..., that holds the longest prompt of a call).
    queue_prompts: prefilled prompts the device queue holds (0: enough to refill every slot
      twice, at least 2).
    max_admit: most samples placed into free slots per decode step (0: min(N, max(16, N/8))):
      admission samples the first tokens of that many rows whenever a slot is free, so it is kept
      well below N; the rest of the free slots fill on the next steps.
    kv_cache: "paged" (a page pool per data shard shared by its slots, a queued prompt's pages
      in one shard's pool shared by its samples, attention over live pages), "dense" (each slot
      reserves prompt + response) or "auto" (paged on TPU and GPU, and on CPU from
      `paged_kv.PAGED_MIN_CACHE_LENGTH_CPU` positions).
    page_size: tokens per page (paged).
    kv_pages: pages in each data shard's pool (paged); 0 sizes it by `kv_hbm_fraction` of the
      accelerator memory left free, capped at what every slot at full length and the queued
      prompts need (on CPU: that cap).
    attention_impl: the paged decode attention (`models/paged_attention.PAGED_IMPLS`).
  """

  def __init__(self, graphdef: nnx.GraphDef, *, num_slots: int = 8, chunk_steps: int = 32,
               mesh: Mesh | None = None, max_prefill_length: int | None = None,
               queue_prompts: int = 0, max_admit: int = 0, kv_cache: str = "auto",
               page_size: int = 64, kv_pages: int = 0, kv_hbm_fraction: float = 0.9,
               attention_impl: str = "auto"):
    if num_slots < 1 or chunk_steps < 1:
      raise ValueError(f"num_slots ({num_slots}) and chunk_steps ({chunk_steps}) must be >= 1.")
    if kv_cache not in paged_kv.KV_CACHES:
      raise ValueError(f"kv_cache={kv_cache!r}; choose one of {paged_kv.KV_CACHES}.")
    if page_size < 1 or kv_pages < 0 or not 0 < kv_hbm_fraction <= 1:
      raise ValueError(f"page_size ({page_size}) must be >= 1, kv_pages ({kv_pages}) >= 0 and "
                       f"kv_hbm_fraction ({kv_hbm_fraction}) in (0, 1].")
    paged_attention.resolve_paged_impl(attention_impl)  # an unknown name fails here
    self.kv_cache, self.page_size, self.kv_pages = kv_cache, page_size, kv_pages
    self.kv_hbm_fraction, self.attention_impl = kv_hbm_fraction, attention_impl
    self.mesh = mesh if mesh is not None and mesh.size > 1 else None
    self.batch_shards = 1  # data shards of the slots (and paged pools)
    if self.mesh is not None:
      shards = self.batch_shards = math.prod(
          shd.batch_axes(self.mesh, shd.SAMPLE_RULES).values())
      if num_slots % shards:
        raise ValueError(
            f"rollout.max_concurrent_decodes={num_slots} slots do not split over the mesh's "
            f"{shards} batch shards; use a multiple of {shards}, e.g. "
            f"{' or '.join(map(str, shd.nearest_multiples(num_slots, shards)))}.")
    self.graphdef = graphdef
    self.max_prefill_length = max_prefill_length or sl.PREFILL_BUCKETS[-1]
    self.num_slots = num_slots
    self.chunk_steps = chunk_steps
    self._queue_prompts = queue_prompts
    self.max_admit = max_admit or min(num_slots, max(16, num_slots // 8))
    self.last_stats = RolloutStats()

  def programs(self, state: nnx.State, *, queue_size: int, num_samples: int, prompt_length: int,
               cache_length: int, params: SamplingParams, paged: prog.PagedSpec | None = None
               ) -> engine_programs.EnginePrograms:
    """The compiled programs of streams of this shape (`engine_programs.programs_for`)."""
    return engine_programs.programs_for(
        state, graphdef=self.graphdef, mesh=self.mesh, num_slots=self.num_slots,
        queue_size=queue_size, num_samples=num_samples, prompt_length=prompt_length,
        cache_length=cache_length, params=params, chunk_steps=self.chunk_steps,
        max_admit=self.max_admit, paged=paged)

  def paged_spec(self, state: nnx.State, prompt_length: int, response_length: int,
                 queue_size: int) -> prog.PagedSpec | None:
    """The pool of a stream whose prompts hold up to `prompt_length` tokens and responses up to
    `response_length` (None: dense cache). Raises when `kv_pages` cannot hold one prompt and
    one full-length sample besides it."""
    cache_length = prompt_length + response_length
    if paged_kv.resolve_kv_cache(self.kv_cache, cache_length) != "paged":
      return None
    t = self.page_size
    full = paged_kv.pages_for(cache_length, t)
    smallest = paged_kv.pages_for(prompt_length, t) + full + 1
    # Never more than a data shard's slots at full length plus every queued prompt (each pool
    # is one shard's): no preemption.
    enough = (self.num_slots // self.batch_shards * full
              + queue_size * paged_kv.pages_for(prompt_length, t) + 1)
    pages = self.kv_pages or min(enough, max(smallest, self._pages_in_budget(state, t)))
    if pages < smallest:
      raise ValueError(
          f"rollout.kv_pages={pages} pages of {t} tokens cannot hold a {prompt_length}-token "
          f"prompt and one {cache_length}-token sample; use at least {smallest}.")
    return prog.PagedSpec(num_pages=pages, page_size=t, impl=self.attention_impl,
                          shards=self.batch_shards)

  def _pages_in_budget(self, state: nnx.State, page_size: int) -> int:
    """Pages that `kv_hbm_fraction` of the first device's free memory holds (per device, a
    page is split over the mesh's `tensor` axis like the KV heads); a huge number where the
    backend reports no memory (CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
      return 1 << 40
    cfg = nnx.merge(self.graphdef, state).config
    split = self.mesh.shape.get("tensor", 1) if self.mesh is not None else 1
    # The pool's own storage (rollout.kv_cache_dtype): an 8-bit page is about half a bf16 one.
    page_bytes = paged_kv.page_bytes(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                     cfg.dim_per_head, page_size, cfg.kv_dtype) // max(1, split)
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return paged_kv.pages_in_budget(self.kv_hbm_fraction * free, page_bytes)

  def queue_prompts(self, num_samples: int) -> int:
    """Device queue entries for a stream of `num_samples` per prompt."""
    return self._queue_prompts or max(2, -(-2 * self.num_slots // num_samples))

  def open_stream(self, state: nnx.State, *, params: SamplingParams, num_samples: int,
                  key: jax.Array, prompt_length: int | None = None) -> ContinuousStream:
    """A stream whose prompts hold at most `prompt_length` tokens (default max_prefill_length)."""
    return ContinuousStream(self, state, params, num_samples, key,
                            prompt_length or self.max_prefill_length)

  def generate(self, state: nnx.State, prompt_ids: jax.Array, prompt_mask: jax.Array,
               key: jax.Array, params: SamplingParams, num_samples: int = 1,
               max_new_tokens: Sequence[int] | None = None) -> RolloutBatch:
    """`Sampler.generate`'s contract (rows prompt-major, row = b*G + g; host prompts, the same on
    every process) plus optional per-row budgets `max_new_tokens` ([B*G], each <=
    params.max_new_tokens). Row b*G + g is sample g of prompt index b."""
    ids_BxP, mask_BxP = np.asarray(prompt_ids), np.asarray(prompt_mask).astype(bool)
    if ids_BxP.ndim != 2 or mask_BxP.shape != ids_BxP.shape:
      raise ValueError(f"prompt_ids and prompt_mask must both be [B, P]; got {ids_BxP.shape} "
                       f"and {mask_BxP.shape}.")
    b, g = ids_BxP.shape[0], num_samples
    if max_new_tokens is not None and len(max_new_tokens) != b * g:
      raise ValueError(f"max_new_tokens has {len(max_new_tokens)} budgets for {b * g} rows.")
    prompts = [ids_BxP[i][mask_BxP[i]] for i in range(b)]
    stream = self.open_stream(state, params=params, num_samples=g, key=key,
                              prompt_length=max((p.size for p in prompts), default=1))
    for i, p in enumerate(prompts):
      stream.admit(p, prompt_index=i, max_new_tokens=None if max_new_tokens is None
                   else max_new_tokens[i * g:(i + 1) * g])
    groups: dict[int, FinishedGroup] = {}
    while stream.num_pending:
      groups.update((f.prompt_index, f) for f in stream.poll())
    self.last_stats = stream.last_stats
    stream.close()
    rows = [groups[i] for i in range(b)]
    cat = lambda name: jnp.asarray(np.concatenate([getattr(f, name) for f in rows]))
    lengths = np.concatenate([f.lengths for f in rows])
    return RolloutBatch(prompt_ids=jnp.asarray(np.repeat(ids_BxP, g, axis=0), jnp.int32),
                        prompt_mask=jnp.asarray(np.repeat(mask_BxP, g, axis=0)),
                        response_ids=cat("response_ids"), response_mask=cat("response_mask"),
                        logprobs=cat("logprobs"), lengths=jnp.asarray(lengths),
                        truncated=cat("truncated"),
                        num_steps=jnp.asarray(int(lengths.max(initial=0)), jnp.int32))


def make_rollout_fn(graphdef: nnx.GraphDef, *, mesh: Mesh | None = None, tokenizer=None,
                    max_concurrent_decodes: int = 64, max_prefill_length: int | None = None,
                    chunk_steps: int = 32, **kv):
  """The rollout callable `rollout.factory` wants: `Sampler.generate`'s signature, host prompts
  in and the same host-backed `RolloutBatch` out on every process. `kv`: the sampler's KV
  cache arguments (kv_cache, page_size, kv_pages, kv_hbm_fraction, attention_impl)."""
  del tokenizer  # stop tokens come with the call's SamplingParams.eos_ids
  return ContinuousSampler(graphdef, num_slots=max_concurrent_decodes, chunk_steps=chunk_steps,
                           mesh=mesh, max_prefill_length=max_prefill_length, **kv).generate
