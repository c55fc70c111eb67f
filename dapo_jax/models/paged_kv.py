"""A paged KV cache: one page pool per data shard, per-slot page tables, refcounted pages.

Shapes in names: L layers, K kv heads, E head dim, P pages in the pool, T tokens per page
(page_size), N decode slots, M most pages per slot, A attaching slots, X page lists.

Each layer's keys and values are [K, P, T, E] (a stacked model: [L, K, P, T, E]): the layout
`jax.experimental.pallas.ops.tpu.paged_attention` and `...ops.gpu.paged_attention` read as
they lie, so no kernel call copies or transposes the pool (see docs/paged_kv_design.md).

Everything here is a pure function of fixed shapes, for use inside the engine's compiled
`lax.while_loop`:

* the free list IS the refcount: page p is free when ``refcount[p] == 0``. Allocation takes the
  lowest free ids (a cumsum rank over [P], deterministic); freeing is a scatter-add of -1 that
  handles pages shared by several freed slots at once. Its cost is O(P) int32 per step,
  ~1e-5 of the step's KV bytes.
* a prompt's pages are allocated once (`alloc`, refcount 1: the queue entry's hold), then each of
  its samples `attach`es them (+1 each), and the queue `release`s its hold (-1) once all G are
  placed: a prompt's KV is stored once, not G times, and admission copies no KV.
* `reserve_append` gives each active slot the page and offset its next token goes to: a fresh
  page when it crosses a page boundary, a private copy of a shared page (copy-on-write of the
  last partial prompt page) when it first writes into one. A slot that cannot get a page is
  flagged in `ok_N == False` and writes nothing: never silent.

An 8-bit pool (int8 / float8_e4m3fn, `kv_quant`) has E + 4 entries per token and KV head, its
scale last: every write quantizes (`kv_quant.encode`), every page copy moves the scales with
the values, and the attention (`paged_attention`) reads them.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from dapo_jax.models import kv_quant
from dapo_jax.models.kv_cache import Layers, per_layer


# The continuous engine's cache choices (rollout.kv_cache): "auto" picks paged where it is faster.
KV_CACHES = ("auto", "paged", "dense")
# On CPU the paged cache wins from this many positions per slot (bench/paged_engine.py,
# docs/paged_kv.md); on TPU and GPU it always does.
PAGED_MIN_CACHE_LENGTH_CPU = 1024


def resolve_kv_cache(kv_cache: str, cache_length: int, platform: str | None = None) -> str:
  """"paged" or "dense" for ``rollout.kv_cache`` (auto: paged where it is faster) with slots of
  ``cache_length`` positions on ``platform`` (default: the first device's)."""
  if kv_cache not in KV_CACHES:
    raise ValueError(f"kv_cache={kv_cache!r}; choose one of {KV_CACHES}.")
  if kv_cache != "auto":
    return kv_cache
  platform = platform or jax.devices()[0].platform
  return "paged" if platform != "cpu" or cache_length >= PAGED_MIN_CACHE_LENGTH_CPU else "dense"


def page_bytes(num_layers: int, kv_heads: int, head_dim: int, page_size: int, dtype: Any
               ) -> int:
  """Bytes of one page of the pool, K and V of every layer (an 8-bit pool's scales included:
  `kv_quant.bytes_per_token_head`)."""
  return 2 * num_layers * kv_heads * page_size * kv_quant.bytes_per_token_head(head_dim, dtype)


def pages_in_budget(budget_bytes: float, page_bytes_per_device: int) -> int:
  """Pages a KV budget holds (what the engine sizes its pool by)."""
  return int(budget_bytes) // max(1, page_bytes_per_device)


def pages_for(length: jax.Array | int, page_size: int) -> jax.Array | int:
  """Pages holding `length` tokens: ceil(length / page_size)."""
  return -(-length // page_size)


@flax.struct.dataclass
class PagedKVCache:
  """One data shard's page pool, page tables and lengths (see the module docstring).

  The engine keeps S shards' pools as one of these with a leading shard axis on every array
  (k: L x [S, K, P, T, E] or stacked [S, L, K, P, T, E]; refcount [S, P]; table [S, N/S, M];
  length [S, N/S]), laid out over the mesh's batch axes: slot n of the engine is slot n % (N/S) of
  shard n // (N/S), page ids are shard-local, and the functions here run on each shard
  (`jax.vmap`), so no page or table ever crosses shards.
  """
  k: Layers  # L x [K, P, T, E], or [L, K, P, T, E] stacked (a sharded cache: see above)
  v: Layers  # like k
  refcount: jax.Array  # [P] int32 holders of each page (slots and queue entries); 0 = free
  table: jax.Array  # [N, M] int32 slot n's pages in token order; -1 = none
  length: jax.Array  # [N] int32 tokens stored in slot n's pages
  # The pool layout, fixed at creation by the attention kernel (never converted per step):
  # False: k and v per layer [K, P, T, E]; True: k holds both, interleaved [P, T, 2K, E] (kv
  # head j's K at 2j, V at 2j + 1: the ragged TPU kernel's layout), and v is None.
  combined: bool = flax.struct.field(pytree_node=False, default=False)

  @property
  def stacked(self) -> bool:
    return not isinstance(self.k, (tuple, list))

  @property
  def num_pages(self) -> int:
    return self.refcount.shape[-1]

  @property
  def shards(self) -> int | None:
    """S of a sharded cache (leading shard axis), None for one shard's."""
    return self.refcount.shape[0] if self.refcount.ndim == 2 else None

  @property
  def page_size(self) -> int:
    return (self.k if self.stacked else self.k[0]).shape[-3 if self.combined else -2]

  @property
  def page_axis(self) -> int:
    """The page axis of one shard's k ([L,] K, P, T, E or [L,] P, T, 2K, E)."""
    return int(self.stacked) + (0 if self.combined else 1)

  @property
  def pool_axes(self) -> tuple[str | None, ...]:
    """Logical axes of one pool array of a sharded cache (a layer's, or the stacked layers'):
    shards on `batch`, KV heads on `kv_heads`."""
    layer = (None, None, "kv_heads", None) if self.combined else ("kv_heads", None, None, None)
    return ("batch",) + ((None,) if self.stacked else ()) + layer

  def map_pools(self, fn) -> PagedKVCache:
    """`fn` on every pool array (each layer's, or the stacked one; k and v)."""
    each = lambda pools: None if pools is None else (
        fn(pools) if self.stacked else tuple(map(fn, pools)))
    return self.replace(k=each(self.k), v=each(self.v))

  @property
  def max_pages(self) -> int:
    return self.table.shape[-1]

  @classmethod
  def zeros(cls, *, num_layers: int, num_slots: int, num_pages: int, page_size: int,
            max_pages_per_slot: int, kv_heads: int, head_dim: int, dtype: Any,
            stacked: bool = False, shards: int | None = None, combined: bool = False
            ) -> PagedKVCache:
    """Empty pools; with `shards`, S pools of `num_pages` each for `num_slots` / S slots each;
    `combined`: K and V in one array (see `combined`)."""
    lead = () if shards is None else (shards,)
    slots = num_slots if shards is None else num_slots // shards
    head_dim = kv_quant.stored_dim(head_dim, dtype)
    shape = ((num_pages, page_size, 2 * kv_heads, head_dim) if combined
             else (kv_heads, num_pages, page_size, head_dim))
    # Stacked: the shard axis before the layers', so that every per-shard function (`on_shards`,
    # the engine's vmaps) maps axis 0 of every array and sees one shard's [L, ...] pool.
    pools = lambda: (jnp.zeros(lead + (num_layers,) + shape, dtype) if stacked
                     else tuple(jnp.zeros(lead + shape, dtype) for _ in range(num_layers)))
    return cls(k=pools(), v=None if combined else pools(),
               refcount=jnp.zeros(lead + (num_pages,), jnp.int32),
               table=jnp.full(lead + (slots, max_pages_per_slot), -1, jnp.int32),
               length=jnp.zeros(lead + (slots,), jnp.int32), combined=combined)

  def free_pages(self) -> jax.Array:
    """Free pages of the pool ([S] for a sharded cache)."""
    return (self.refcount == 0).sum(-1, dtype=jnp.int32)

  def _drop(self, page: jax.Array, keep: jax.Array) -> jax.Array:
    """`page` where `keep`, else P: an index every `mode="drop"` scatter ignores (-1 would
    wrap around to the last page)."""
    return jnp.where(keep & (page >= 0), page, self.num_pages)


def _first_free(refcount_P: jax.Array, rank: jax.Array) -> jax.Array:
  """The id of the `rank`-th free page (0-based, lowest ids first), -1 where there is none."""
  free_P = refcount_P == 0
  order_P = jnp.cumsum(free_P, dtype=jnp.int32) - 1  # rank of each free page
  p = refcount_P.shape[0]
  ids = jnp.full((p + 1,), -1, jnp.int32).at[jnp.where(free_P, order_P, p)].set(
      jnp.arange(p, dtype=jnp.int32), mode="drop")
  return ids[jnp.clip(rank, 0, p)]


def alloc(cache: PagedKVCache, length: jax.Array) -> tuple[PagedKVCache, jax.Array, jax.Array]:
  """Pages for a prompt of `length` tokens, held once (refcount 1). All or nothing: with too
  few free pages nothing is taken and `ok` is False (admission waits).

  Returns the cache, the pages [M] in token order (-1 past ceil(length / T)) and `ok`.
  """
  cache, pages_1xM, ok_1 = alloc_prompts(cache, jnp.asarray(length)[None], jnp.ones((1,), bool))
  return cache, pages_1xM[0], ok_1[0]


def release(cache: PagedKVCache, pages_XxM: jax.Array) -> PagedKVCache:
  """Drops one hold on each listed page (-1 entries ignored); a page whose count reaches 0 is
  free again. A page may appear several times (shared prompt pages of several slots)."""
  ids = cache._drop(pages_XxM.reshape(-1), pages_XxM.reshape(-1) >= 0)
  return cache.replace(refcount=cache.refcount.at[ids].add(-1, mode="drop"))


def attach(cache: PagedKVCache, slots_A: jax.Array, pages_AxM: jax.Array,
           length_A: jax.Array) -> PagedKVCache:
  """Slots `slots_A` take the prompt pages `pages_AxM` holding `length_A` tokens (one more hold
  each). Slot N (out of range) is batch padding and changes nothing."""
  n = cache.table.shape[0]
  real_A = slots_A < n
  ids = cache._drop(pages_AxM, real_A[:, None] & (pages_AxM >= 0)).reshape(-1)
  return cache.replace(refcount=cache.refcount.at[ids].add(1, mode="drop"),
                       table=cache.table.at[slots_A].set(pages_AxM, mode="drop"),
                       length=cache.length.at[slots_A].set(length_A, mode="drop"))


def free_slots(cache: PagedKVCache, done_N: jax.Array) -> PagedKVCache:
  """Finished slots give back their pages (shared prompt pages lose one hold each) and empty."""
  cache = release(cache, jnp.where(done_N[:, None], cache.table, -1))
  return cache.replace(table=jnp.where(done_N[:, None], -1, cache.table),
                       length=jnp.where(done_N, 0, cache.length))


@flax.struct.dataclass
class Append:
  """Where each slot's next token goes; `ok_N` False: it goes nowhere (inactive, or no page)."""
  page: jax.Array  # [N] int32 (P where not ok: dropped by the writes)
  offset: jax.Array  # [N] int32
  ok: jax.Array  # [N] bool
  out_of_pages: jax.Array  # [N] bool: active, but no free page (or past M pages)


def reserve_append(cache: PagedKVCache, active_N: jax.Array) -> tuple[PagedKVCache, Append]:
  """Makes room for one token in every active slot, at position ``length``.

  A slot starting a page gets a fresh one; a slot writing into a page it shares (the last,
  partial prompt page) gets a private copy of it (copy-on-write, all layers), except that when
  every holder of a page writes into it in this same step, the lowest slot keeps the original.
  Lengths do not change here: the caller writes the token (`write_token`) and then counts it
  (`commit_append`).
  """
  n, m, t, p = cache.table.shape[0], cache.max_pages, cache.page_size, cache.num_pages
  pos_N = cache.length
  j_N, off_N = pos_N // t, pos_N % t
  rows_N = jnp.arange(n, dtype=jnp.int32)
  cur_N = jnp.where(j_N < m, cache.table[rows_N, jnp.minimum(j_N, m - 1)], -1)
  fits_N = active_N & (j_N < m)
  fresh_N = fits_N & (off_N == 0)
  shared_N = fits_N & (off_N != 0) & (cache.refcount[jnp.maximum(cur_N, 0)] > 1)
  # Holders of a shared page all writing now: the lowest slot keeps it, the others copy.
  shared_ids = cache._drop(cur_N, shared_N)
  writers_P = jnp.zeros((p,), jnp.int32).at[shared_ids].add(1, mode="drop")
  first_P = jnp.full((p,), n, jnp.int32).at[shared_ids].min(rows_N, mode="drop")
  cur0 = jnp.maximum(cur_N, 0)
  keep_N = shared_N & (writers_P[cur0] == cache.refcount[cur0]) & (first_P[cur0] == rows_N)
  cow_N = shared_N & ~keep_N
  need_N = fresh_N | cow_N
  new_N = jnp.where(need_N, _first_free(cache.refcount, jnp.cumsum(need_N) - 1), -1)
  got_N = need_N & (new_N >= 0)
  out_N = (active_N & ~fits_N) | (need_N & ~got_N)
  ok_N = active_N & ~out_N

  refcount = cache.refcount.at[cache._drop(new_N, got_N)].set(1, mode="drop")
  refcount = refcount.at[cache._drop(cur_N, cow_N & got_N)].add(-1, mode="drop")
  table = cache.table.at[jnp.where(got_N, rows_N, n), jnp.minimum(j_N, m - 1)].set(
      new_N, mode="drop")
  src_N, dst_N = jnp.maximum(cur_N, 0), cache._drop(new_N, cow_N & got_N)
  axis = cache.page_axis

  def copy(x: jax.Array) -> jax.Array:
    if not cache.combined:
      idx = (slice(None),) * axis
      return x.at[idx + (dst_N,)].set(jnp.take(x, src_N, axis=axis), mode="drop")
    # Combined pools: token by token, (page, offset) pairs as `write_token` indexes them. Whole
    # pages ([T, 2K, E] windows) made XLA TPU lay the pool out anew for the scatter, copying it
    # twice per step (2K = 2 on a chip at tensor 8 is a thin tile).
    # A stacked pool's layer is indexed too, as `write_token` does: with the layer axis a window
    # of the gather and the scatter, libtpu laid the stacked pool out anew, three copies of it.
    offsets = jnp.tile(jnp.arange(t), n)
    rows_of = lambda pages: ((jnp.arange(x.shape[0])[:, None], pages[None], offsets[None])
                             if cache.stacked else (pages, offsets))
    rows = x[rows_of(jnp.repeat(src_N, t))]  # [(L,) N x T, 2K, E]
    return x.at[rows_of(jnp.repeat(dst_N, t))].set(rows, mode="drop")

  copies = lambda pools: None if pools is None else (
      copy(pools) if cache.stacked else tuple(map(copy, pools)))
  k, v = copies(cache.k), copies(cache.v)
  page_N = jnp.where(need_N, new_N, cur_N)
  return (cache.replace(k=k, v=v, refcount=refcount, table=table),
          Append(page=cache._drop(page_N, ok_N), offset=off_N, ok=ok_N, out_of_pages=out_N))


def write_token(k_KxPxTxE: jax.Array, v_KxPxTxE: jax.Array, kn_NxKxE: jax.Array,
                vn_NxKxE: jax.Array, app: Append, layer: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array]:
  """One layer's new key and value per slot at (page, offset); slots not ok write nothing.
  With `layer`, k and v are the stacked [L, K, P, T, E] pool and only that layer is written.
  `v_KxPxTxE` None: k is a combined pool ([L,] P, T, 2K, E), both written into it."""
  if v_KxPxTxE is None:
    at = (app.page, app.offset) if layer is None else (layer, app.page, app.offset)
    kv_Nx2KxE = kv_quant.encode(interleave_kv(kn_NxKxE, vn_NxKxE), k_KxPxTxE.dtype)
    return k_KxPxTxE.at[at].set(kv_Nx2KxE, mode="drop"), None
  kn, vn = kv_quant.encode(kn_NxKxE, k_KxPxTxE.dtype), kv_quant.encode(vn_NxKxE, v_KxPxTxE.dtype)
  if layer is None:  # indices on the adjacent P, T axes: the update is [K, N, E]
    idx, kn, vn = (slice(None), app.page, app.offset), kn.transpose(1, 0, 2), vn.transpose(1, 0, 2)
  else:  # layer, K slice, P, T: indices split by a slice put N first: [N, K, E]
    idx = (layer, slice(None), app.page, app.offset)
  return k_KxPxTxE.at[idx].set(kn, mode="drop"), v_KxPxTxE.at[idx].set(vn, mode="drop")


def commit_append(cache: PagedKVCache, app: Append) -> PagedKVCache:
  """Counts the token each ok slot wrote."""
  return cache.replace(length=cache.length + app.ok.astype(jnp.int32))


def alloc_prompts(cache: PagedKVCache, length_X: jax.Array, real_X: jax.Array
                  ) -> tuple[PagedKVCache, jax.Array, jax.Array]:
  """`alloc` for X prompts at once, in order: prompt x gets its pages when it and every real
  prompt before it fit in the free pages (a prefix rule the host can mirror exactly); the
  others get none (`ok_X` False). Returns the cache, pages [X, M] (-1 none) and `ok_X`."""
  m = cache.max_pages
  need_X = jnp.where(real_X, pages_for(length_X, cache.page_size), 0)
  end_X = jnp.cumsum(need_X)
  ok_X = real_X & (end_X <= cache.free_pages()) & (need_X <= m)
  r_M = jnp.arange(m, dtype=jnp.int32)
  take_XxM = ok_X[:, None] & (r_M[None] < need_X[:, None])
  pages_XxM = jnp.where(take_XxM, _first_free(cache.refcount, end_X[:, None] - need_X[:, None]
                                              + r_M[None]), -1)
  refcount = cache.refcount.at[cache._drop(pages_XxM, take_XxM).reshape(-1)].set(1, mode="drop")
  return cache.replace(refcount=refcount), pages_XxM, ok_X


def write_prompts(cache: PagedKVCache, pages_XxM: jax.Array, k_XxKxExS: Layers,
                  v_XxKxSxE: Layers, length_X: jax.Array) -> PagedKVCache:
  """X prefilled prompts into their pages (`alloc_prompts`), from the dense cache layout of
  `kv_cache.KVCache` (per layer keys [X, K, E, S], values [X, K, S, E]); tokens past
  `length_X`, and prompts without pages, are dropped."""
  s, t = (k_XxKxExS if not isinstance(k_XxKxExS, (tuple, list)) else k_XxKxExS[0]).shape[-1], (
      cache.page_size)
  pos_S = jnp.arange(s, dtype=jnp.int32)
  page_XxS = pages_XxM[:, jnp.minimum(pos_S // t, cache.max_pages - 1)]
  page_XxS = cache._drop(page_XxS, pos_S[None] < length_X[:, None])
  off_XxS = jnp.broadcast_to(pos_S % t, page_XxS.shape)

  def put(pool: jax.Array, x_KxXxSxE: jax.Array) -> jax.Array:  # one layer
    return pool.at[:, page_XxS, off_XxS].set(kv_quant.encode(x_KxXxSxE, pool.dtype), mode="drop")

  if cache.combined:  # [P, T, 2K, E] pools: K and V of each token interleaved
    put_kv = lambda pool, k, v: pool.at[page_XxS, off_XxS].set(kv_quant.encode(interleave_kv(
        k.transpose(0, 3, 1, 2), v.transpose(0, 2, 1, 3)), pool.dtype), mode="drop")
    return cache.replace(k=per_layer(put_kv, cache.k, k_XxKxExS, v_XxKxSxE))
  return cache.replace(
      k=per_layer(lambda pool, x: put(pool, x.transpose(1, 0, 3, 2)), cache.k, k_XxKxExS),
      v=per_layer(lambda pool, x: put(pool, x.transpose(1, 0, 2, 3)), cache.v, v_XxKxSxE))


def write_prompt(cache: PagedKVCache, pages_M: jax.Array, k_LxSxKxE: Layers,
                 v_LxSxKxE: Layers, length: jax.Array) -> PagedKVCache:
  """`write_prompts` of one prompt given per layer as [S, K, E] keys and values."""
  k = per_layer(lambda x: x.transpose(1, 2, 0)[None], k_LxSxKxE)
  v = per_layer(lambda x: x.transpose(1, 0, 2)[None], v_LxSxKxE)
  return write_prompts(cache, pages_M[None], k, v, jnp.asarray(length)[None])


def gather_dense(cache: PagedKVCache, layer: int, slots: int | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Slot rows as a dense cache layer (tests, debugging): k [N, K, E, M*T], v [N, K, M*T, E]
  and valid [N, M*T], the layout `attention.decode_attention` reads."""
  k, v = (split_kv(cache.k[layer]) if cache.combined else (cache.k[layer], cache.v[layer]))
  table = cache.table if slots is None else cache.table[:slots]
  kk, ee = k.shape[0], k.shape[-1]
  n, m, t = table.shape[0], table.shape[1], cache.page_size
  ids = jnp.maximum(table, 0)
  k_NxKxSxE = jnp.take(k, ids, axis=1).transpose(1, 0, 2, 3, 4).reshape(n, kk, m * t, ee)
  v_NxKxSxE = jnp.take(v, ids, axis=1).transpose(1, 0, 2, 3, 4).reshape(n, kk, m * t, ee)
  length = cache.length if slots is None else cache.length[:slots]
  valid_NxS = jnp.arange(m * t)[None] < length[:, None]
  return k_NxKxSxE.transpose(0, 1, 3, 2), v_NxKxSxE, valid_NxS


def interleave_kv(k_XxKxE: jax.Array, v_XxKxE: jax.Array) -> jax.Array:
  """K and V [..., K, E] into the combined layout's [..., 2K, E] (K at 2j, V at 2j + 1)."""
  both = jnp.stack([k_XxKxE, v_XxKxE], axis=-2)
  return both.reshape(both.shape[:-3] + (2 * both.shape[-3], both.shape[-1]))


def split_kv(kv_PxTx2KxE: jax.Array) -> tuple[jax.Array, jax.Array]:
  """A combined pool layer back to split [K, P, T, E] keys and values (tests, debugging)."""
  return (jnp.moveaxis(kv_PxTx2KxE[..., 0::2, :], -2, -4),
          jnp.moveaxis(kv_PxTx2KxE[..., 1::2, :], -2, -4))


def on_shards(fn, cache: PagedKVCache, *per_slot: Any, **kwargs):
  """`fn(one shard's cache, *its slots' rows, **kwargs)` on every shard of a sharded cache
  (`jax.vmap` over the shard axis), or on a one-shard cache as it is: per-slot arrays (or trees
  of them) [N, ...] go in split [S, N/S, ...]; a cache in the results comes back sharded,
  every other result [S, N/S, ...] back as [N, ...]."""
  if cache.shards is None:
    return fn(cache, *per_slot, **kwargs)
  s, ns = cache.shards, cache.table.shape[1]
  split = lambda x: x.reshape((s, ns) + x.shape[1:])
  out = jax.vmap(lambda c, *rows: fn(c, *rows, **kwargs))(cache, *jax.tree.map(split, per_slot))
  merge = lambda x: x if isinstance(x, PagedKVCache) else jax.tree.map(
      lambda a: a.reshape((s * ns,) + a.shape[2:]), x)
  return tuple(map(merge, out)) if isinstance(out, tuple) else merge(out)
