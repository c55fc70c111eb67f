"""The paged KV cache (models/paged_kv.py) and decode attention over it (paged_attention.py).

The allocator runs a random admit / decode / finish scenario against a plain-Python mirror of
every slot's tokens; the attention paths are compared with the dense `decode_attention` on the
same K/V content.
"""

from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax.models import attention
from dapo_jax.models import paged_attention as pa
from dapo_jax.models import paged_kv as pkv

L, K, E = 2, 2, 8  # layers, kv heads, head dim of the allocator tests

_reserve = jax.jit(pkv.reserve_append)
_alloc = jax.jit(pkv.alloc)
_free = jax.jit(pkv.free_slots)
_attach = jax.jit(pkv.attach)
_release = jax.jit(pkv.release)
_write_prompt = jax.jit(pkv.write_prompt)
_gather = jax.jit(pkv.gather_dense, static_argnums=(1, 2))


@jax.jit
def _write_all_layers(cache: pkv.PagedKVCache, kn_LxNxKxE, vn_LxNxKxE, app: pkv.Append):
  if cache.stacked:
    k, v = cache.k, cache.v
    for layer in range(L):
      k, v = pkv.write_token(k, v, kn_LxNxKxE[layer], vn_LxNxKxE[layer], app, layer)
  else:
    kv = [pkv.write_token(k, v, kn, vn, app)
          for k, v, kn, vn in zip(cache.k, cache.v, kn_LxNxKxE, vn_LxNxKxE)]
    k, v = tuple(x[0] for x in kv), tuple(x[1] for x in kv)
  return pkv.commit_append(cache.replace(k=k, v=v), app)


class Mirror:
  """What each slot must hold: its tokens' K/V in order, and who holds each page."""

  def __init__(self, cache: pkv.PagedKVCache):
    self.cache = cache
    n = cache.table.shape[0]
    self.tokens = [[] for _ in range(n)]  # per slot: list of (k [L, K, E], v [L, K, E])
    self.queue_holds: list[np.ndarray] = []  # pages held by queue entries

  def check(self):
    c = jax.device_get(self.cache)
    table, length, refcount = np.asarray(c.table), np.asarray(c.length), np.asarray(c.refcount)
    holders = np.zeros_like(refcount)
    for n, toks in enumerate(self.tokens):
      assert length[n] == len(toks)
      live = table[n][table[n] >= 0]
      assert len(live) == pkv.pages_for(len(toks), c.page_size), (n, table[n], len(toks))
      np.add.at(holders, live, 1)
    for pages in self.queue_holds:
      np.add.at(holders, pages[pages >= 0], 1)
    np.testing.assert_array_equal(refcount, holders)  # every hold counted, nothing leaked
    assert (refcount >= 0).all()
    # A page two slots hold is a prompt page: one both took by `attach`, never written since.
    owners: dict[int, list[int]] = {}
    for n in range(table.shape[0]):
      for j, p in enumerate(table[n]):
        if p >= 0:
          owners.setdefault(int(p), []).append((n, j))
    for p, who in owners.items():
      if len(who) > 1:
        assert len({j for _, j in who}) == 1 and refcount[p] >= len(who)
    for layer in range(L):
      k_NxKxExS, v_NxKxSxE, valid = (np.asarray(x) for x in _gather(self.cache, layer))
      for n, toks in enumerate(self.tokens):
        for s, (kt, vt) in enumerate(toks):
          np.testing.assert_array_equal(k_NxKxExS[n, :, :, s], kt[layer])
          np.testing.assert_array_equal(v_NxKxSxE[n, :, s], vt[layer])
        assert valid[n].sum() == len(toks)


def _kv(rng, *shape):
  return rng.normal(size=shape).astype(np.float32)


@pytest.mark.parametrize("stacked", [False, True])
def test_allocator_scenario_keeps_every_page_and_token(stacked):
  """Prompts shared by G samples, copy-on-write of their last page, random decode and finish:
  after every step pages are conserved, refcounts equal the holders, only prompt pages are
  shared, and every slot reads back exactly the tokens written to it."""
  rng = np.random.default_rng(0)
  n, t, m, g = 6, 4, 6, 3
  cache = pkv.PagedKVCache.zeros(num_layers=L, num_slots=n, num_pages=40, page_size=t,
                                 max_pages_per_slot=m, kv_heads=K, head_dim=E,
                                 dtype=jnp.float32, stacked=stacked)
  mir = Mirror(cache)
  s_max = 8
  for step in range(14):
    free_slots = [i for i in range(n) if not mir.tokens[i]]
    if len(free_slots) >= g:  # admit a prompt: its pages allocated once, attached G times
      plen = int(rng.integers(1, s_max + 1))
      kp, vp = _kv(rng, L, s_max, K, E), _kv(rng, L, s_max, K, E)
      c, pages, ok = _alloc(mir.cache, jnp.int32(plen))
      assert bool(ok)
      pk = kp if stacked else tuple(kp)
      pv = vp if stacked else tuple(vp)
      c = _write_prompt(c, pages, pk, pv, jnp.int32(plen))
      slots = np.array(free_slots[:g] + [n], np.int32)  # one padding entry (dropped)
      c = _attach(c, jnp.asarray(slots), jnp.tile(pages[None], (g + 1, 1)),
                  jnp.full((g + 1,), plen, jnp.int32))
      mir.queue_holds.append(np.asarray(pages))
      for i in slots[:g]:
        mir.tokens[i] = [(kp[:, s], vp[:, s]) for s in range(plen)]
      mir.cache = c
      mir.check()
      if step % 2 == 0:  # the queue drops its hold once all G are placed
        mir.cache = _release(mir.cache, mir.queue_holds.pop()[None])
    # Decode: a random subset of the live slots writes one token each.
    live = np.array([bool(x) and len(x) < m * t for x in mir.tokens])
    active = live & (rng.random(n) < 0.8)
    c, app = _reserve(mir.cache, jnp.asarray(active))
    np.testing.assert_array_equal(np.asarray(app.ok), active)  # the pool is large enough
    kn, vn = _kv(rng, L, n, K, E), _kv(rng, L, n, K, E)
    mir.cache = _write_all_layers(c, jnp.asarray(kn), jnp.asarray(vn), app)
    for i in np.flatnonzero(active):
      mir.tokens[i].append((kn[:, i], vn[:, i]))
    mir.check()
    done = live & (rng.random(n) < 0.2)
    mir.cache = _free(mir.cache, jnp.asarray(done))
    for i in np.flatnonzero(done):
      mir.tokens[i] = []
    mir.check()
  mir.cache = _free(mir.cache, jnp.ones((n,), bool))
  mir.cache = _release(mir.cache, jnp.asarray(np.stack(mir.queue_holds))) if mir.queue_holds \
      else mir.cache
  mir.tokens, mir.queue_holds = [[] for _ in range(n)], []
  mir.check()
  assert int(mir.cache.free_pages()) == 40  # everything came back


def test_all_holders_writing_at_once_copy_all_but_one():
  """G samples whose prompt ends mid-page all write their first token in one step: G - 1
  copies, the lowest slot keeps the original, and the prompt tokens survive in every copy."""
  g, t = 3, 4
  kp = jnp.arange(4 * 2, dtype=jnp.float32).reshape(4, 1, 2)

  @jax.jit
  def run():
    cache = pkv.PagedKVCache.zeros(num_layers=1, num_slots=g, num_pages=8, page_size=t,
                                   max_pages_per_slot=2, kv_heads=1, head_dim=2,
                                   dtype=jnp.float32)
    cache, pages, _ = pkv.alloc(cache, jnp.int32(2))
    cache = pkv.write_prompt(cache, pages, (kp,), (-kp,), jnp.int32(2))
    cache = pkv.attach(cache, jnp.arange(g), jnp.tile(pages[None], (g, 1)),
                       jnp.full((g,), 2, jnp.int32))
    cache = pkv.release(cache, pages[None])  # the queue's hold
    held = cache.refcount[pages[0]]
    cache, app = pkv.reserve_append(cache, jnp.ones((g,), bool))
    return cache, pages, held, app, pkv.gather_dense(cache, 0)[0]

  cache, pages, held, app, k = jax.device_get(run())
  assert held == g and np.asarray(app.ok).all() and int(cache.free_pages()) == 8 - g
  assert app.page[0] == pages[0] and len(set(app.page.tolist())) == g
  assert (cache.refcount[app.page] == 1).all()
  np.testing.assert_array_equal(k[:, 0, :, :2], np.tile(np.asarray(kp[:2, 0]).T[None], (g, 1, 1)))


def test_out_of_pages_is_flagged_and_writes_nothing():
  t = 2
  cache = pkv.PagedKVCache.zeros(num_layers=1, num_slots=3, num_pages=4, page_size=t,
                                 max_pages_per_slot=3, kv_heads=1, head_dim=2,
                                 dtype=jnp.float32)
  cache, _, ok = pkv.alloc(cache, jnp.int32(7))  # 4 pages needed, 4 free, but M = 3
  assert not bool(ok) and int(cache.free_pages()) == 4

  @jax.jit
  def step(cache, value):
    cache, app = pkv.reserve_append(cache, jnp.ones((3,), bool))
    new = jnp.full((3, 1, 2), value)
    k, v = pkv.write_token(cache.k[0], cache.v[0], new, new, app)
    return pkv.commit_append(cache.replace(k=(k,), v=(v,)), app), app

  for i in range(3):  # 3 slots x 1 page, then each needs a second page: only 1 is left
    cache, app = step(cache, jnp.float32(i + 1))
    ok = np.asarray(app.ok)
    if i < 2:
      assert ok.all()
  np.testing.assert_array_equal(ok, [True, False, False])
  np.testing.assert_array_equal(np.asarray(app.out_of_pages), [False, True, True])
  np.testing.assert_array_equal(np.asarray(cache.length), [3, 2, 2])
  k, _, valid = pkv.gather_dense(cache, 0)
  np.testing.assert_array_equal(np.where(valid, np.asarray(k)[:, 0, 0], 0)[:, :4],
                                [[1, 2, 3, 0], [1, 2, 0, 0], [1, 2, 0, 0]])
  # The flagged slots wrote nowhere: the pool holds the 7 counted tokens and zeros.
  pool = np.sort(np.asarray(cache.k[0]).reshape(-1))
  np.testing.assert_array_equal(pool[pool != 0], [1] * 6 + [2] * 6 + [3] * 2)
  _, ok = pkv.alloc(cache, jnp.int32(1))[::2]
  assert not bool(ok)


def _paged_problem(seed, n, h, kh, e, t, m, lengths, dtype=np.float32):
  """Random pages, a shuffled page table per slot, and the same content as a dense cache."""
  rng = np.random.default_rng(seed)
  p = n * m + 3
  k = rng.normal(size=(kh, p, t, e)).astype(dtype)
  v = rng.normal(size=(kh, p, t, e)).astype(dtype)
  table = rng.permutation(p)[:n * m].reshape(n, m).astype(np.int32)
  length = np.asarray(lengths, np.int32)
  table = np.where(np.arange(m)[None] < -(-length[:, None] // t), table, -1)
  q = rng.normal(size=(n, h, e)).astype(dtype)
  cache = pkv.PagedKVCache(k=(jnp.asarray(k),), v=(jnp.asarray(v),),
                           refcount=jnp.zeros((p,), jnp.int32), table=jnp.asarray(table),
                           length=jnp.asarray(length))
  dense = attention.decode_attention(jnp.asarray(q), *pkv.gather_dense(cache, 0))
  return jnp.asarray(q), cache, np.asarray(dense)


@pytest.mark.parametrize("t,h,kh,block", [(4, 8, 2, 3), (16, 6, 1, None), (8, 4, 4, 100)])
def test_reference_paged_attention_equals_dense(t, h, kh, block):
  m = 40 // t + 1
  lengths = [1, t, t + 1, 17, 40, 3][: 6]
  q, c, dense = _paged_problem(0, 6, h, kh, 16, t, m, lengths)
  fn = jax.jit(functools.partial(pa.reference_paged_attention, pages_per_block=block))
  out = fn(q, c.k[0], c.v[0], c.table, c.length)
  np.testing.assert_allclose(np.asarray(out), dense, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("block", [8, 24])
def test_reference_paged_attention_idle_and_full_slots(block):
  """Idle slots (length 0) between live ones own no page of the flat list, a full slot all M.
  10 live pages: blocks of 8 (one full trip, then 2 remainder trips of 1 page) and of 24 (no
  full trip, 4 remainder trips of 3 pages, the last one part padding)."""
  t, m = 4, 6
  q, c, dense = _paged_problem(3, 6, 4, 2, 8, t, m, [0, 9, 0, 24, 1, 0])
  out = np.asarray(jax.jit(functools.partial(pa.reference_paged_attention,
                                             pages_per_block=block))(q, c.k[0], c.v[0], c.table,
                                                                     c.length))
  live = np.asarray(c.length) > 0
  np.testing.assert_allclose(out[live], dense[live], atol=1e-6, rtol=1e-6)
  assert np.isfinite(out).all()


def test_reference_paged_attention_in_a_while_loop():
  """As the engine calls it: inside `lax.while_loop`, lengths growing from step to step (the
  flat list's size, so the trip counts, are loop values), against dense at every step."""
  t, m, steps = 4, 5, 7
  q, c, _ = _paged_problem(4, 3, 4, 2, 8, t, m, [m * t] * 3)
  start = jnp.asarray([0, 3, 9], jnp.int32)

  @jax.jit
  def run(q, k, v, table):
    def body(carry):
      i, out = carry
      length = jnp.minimum(start + 2 * i, m * t)
      o = pa.reference_paged_attention(q, k, v, table, length, pages_per_block=2)
      return i + 1, out.at[i].set(o)
    return jax.lax.while_loop(lambda c: c[0] < steps, body,
                              (jnp.int32(0), jnp.zeros((steps,) + q.shape)))[1]

  out = np.asarray(run(q, c.k[0], c.v[0], c.table))
  for i in range(steps):
    length = np.minimum(np.asarray(start) + 2 * i, m * t)
    cache = c.replace(length=jnp.asarray(length))
    dense = np.asarray(attention.decode_attention(q, *pkv.gather_dense(cache, 0)))
    live = length > 0
    np.testing.assert_allclose(out[i][live], dense[live], atol=1e-6, rtol=1e-6)


def test_reference_paged_attention_memory_does_not_grow_with_capacity():
  """The compiled reference's temporaries are the same for 8 and 512 pages per slot: nothing
  of slots x capacity (e.g. a relayout of the whole pool) is materialised. (Inside the
  engine's loop: tests/test_paged_engine.py::test_paged_chunk_never_copies_the_pool.)"""
  n, h, kh, e, t = 4, 4, 2, 8, 4

  def temp_bytes(m):
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    fn = jax.jit(functools.partial(pa.reference_paged_attention, pages_per_block=4))
    compiled = fn.lower(f32(n, h, e), f32(kh, n * m, t, e), f32(kh, n * m, t, e),
                        jax.ShapeDtypeStruct((n, m), jnp.int32),
                        jax.ShapeDtypeStruct((n,), jnp.int32)).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  small, large = temp_bytes(8), temp_bytes(512)
  assert large == small, (small, large)
  assert large < n * 512 * t * e * 4  # below one [N, S, E] fp32 operand at capacity 2048


def _bf16_exact(x):
  return x.astype(jnp.bfloat16).astype(jnp.float32)


def test_tpu_kernel_in_interpret_mode_matches_reference():
  """The Pallas TPU kernel runs its matmuls as the TPU does at DEFAULT precision (one bf16 pass,
  emulated in interpret mode): on bf16-exact inputs it agrees with the reference to the bf16
  rounding of the softmax weights; a wrong page or length would be off by O(1)."""
  q, c, _ = _paged_problem(1, 3, 4, 2, 128, 16, 4, [5, 33, 64])
  q, k, v = _bf16_exact(q), _bf16_exact(c.k[0]), _bf16_exact(c.v[0])
  ref = pa.reference_paged_attention(q, k, v, c.table, c.length)
  with attention.interpret_pallas():
    out = pa.paged_decode_attention(q, k, v, c.table, c.length, impl="pallas_tpu")
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-2)


def test_auto_picks_the_xla_path_on_tpu_where_the_kernels_cannot_tile_the_head():
  """Mosaic tiles the TPU kernels' head_dim in lanes of 128: Qwen2.5-0.5B's 64 is refused by
  libtpu ("divisible by 8 and 128"), so "auto" takes the XLA paged path there, and asking for a
  TPU kernel names the setting."""
  assert pa.resolve_paged_impl("auto", "tpu", head_dim=128) == "ragged_tpu"
  assert pa.resolve_paged_impl("auto", "tpu", head_dim=64) == "xla"
  assert pa.resolve_paged_impl("auto", "tpu") == "ragged_tpu"  # head_dim not known here
  assert pa.resolve_paged_impl("auto", "gpu", head_dim=64) == "pallas_gpu"
  for impl in ("pallas_tpu", "ragged_tpu"):
    with pytest.raises(ValueError, match=f"rollout.attention_impl='{impl}' needs a head_dim"):
      pa.resolve_paged_impl(impl, "tpu", head_dim=64)
  q, c, dense = _paged_problem(2, 3, 4, 2, 16, 4, 8, [1, 13, 32])
  with attention.compile_for("tpu"):  # head_dim 16: the reference runs, as it would on a TPU
    out = pa.paged_decode_attention(q, c.k[0], c.v[0], c.table, c.length, impl="auto")
  np.testing.assert_allclose(np.asarray(out), dense, atol=1e-5, rtol=1e-5)


def test_gpu_kernel_in_interpret_mode_matches_reference():
  q, c, dense = _paged_problem(2, 3, 4, 2, 16, 4, 8, [1, 13, 32])
  out = pa.gpu_paged_attention(q, c.k[0], c.v[0], c.table, c.length, interpret=True)
  np.testing.assert_allclose(np.asarray(out), dense, atol=1e-5, rtol=1e-5)


def test_gpu_kernel_reads_a_stacked_pool_in_place():
  """pallas_gpu on layer l of a stacked [L, K, P, T, E] pool (the pool read as L x K x P pages,
  each (slot, KV head) a row of the kernel's batch) equals the kernel on that layer's slice."""
  q, c, dense = _paged_problem(2, 3, 4, 2, 16, 4, 8, [1, 13, 32])
  noise = lambda x, s: x + s * jnp.ones_like(x)  # other layers differ from layer 1
  k_L, v_L = (jnp.stack([noise(x, 3.0), x, noise(x, -2.0)]) for x in (c.k[0], c.v[0]))
  with attention.interpret_pallas():
    out = jax.jit(functools.partial(pa.paged_decode_attention, impl="pallas_gpu"))(
        q, k_L, v_L, c.table, c.length, layer=jnp.int32(1))
  np.testing.assert_allclose(np.asarray(out), dense, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install 'jax[tpu]')")
@pytest.mark.parametrize("n,h,kh,e,p,t,m", [
    (8, 16, 8, 128, 64, 16, 8),
    # Qwen3-8B's shard at tensor 4 (8 query, 2 KV heads, 64-token pages, 352 pages a sequence):
    # 128 pages a block needed 16.41 MiB of the 16 MiB scoped VMEM before RAGGED_BLOCK_BYTES.
    (256, 8, 2, 128, 512, 64, 352),
    # Qwen3-32B's at tensor 8 (8 query heads, 1 KV head, 64 slots): 18.73 MiB at 128 pages.
    (64, 8, 1, 128, 512, 64, 352),
], ids=["small", "qwen3_8b_tensor4", "qwen3_32b_tensor8"])
def test_ragged_kernel_compiles_for_tpu(n, h, kh, e, p, t, m):
  from dapo_jax.planner import targets as plan_targets  # pylint: disable=g-import-not-at-top
  plan_targets.prepare_libtpu_env("tpu:v5p:2x2x1")
  device = plan_targets.tpu_devices("v5p:2x2x1")[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  # The kernel asks the abstract mesh for its chip (else the default device: this host's CPU).
  mesh = jax.sharding.Mesh(np.array([device]), ("x",))
  with attention.compile_for("tpu"), jax.set_mesh(mesh):
    lowered = jax.jit(pa.ragged_tpu_attention).lower(
        spec((n, h, e), jnp.bfloat16), spec((p, t, 2 * kh, e), jnp.bfloat16),
        spec((n, m), jnp.int32), spec((n,), jnp.int32))
    lowered.compile()  # raises if libtpu's Mosaic compiler rejects the kernel
  assert lowered.out_info.shape == (n, h, e)


@pytest.mark.parametrize("scan,impl", [(False, "xla"), (True, "xla"), (True, "pallas_gpu")])
def test_paged_decode_step_equals_dense_decode_step(scan, impl):
  """Two prompts (5 and 3 tokens, pages of 4) shared by 2 samples each: the paged decode
  step (copy-on-write of the last prompt page, new pages on the way) gives the dense step's
  logits for the same fed tokens. pallas_gpu (interpreted) reads the stacked pool in place."""
  from dapo_jax.models import create_model, get_preset  # pylint: disable=g-import-not-at-top
  from dapo_jax.rollout import slots as sl  # pylint: disable=g-import-not-at-top
  model = create_model(get_preset("test", num_hidden_layers=2, scan_layers=scan), seed=3)
  g, p, t, steps = 2, 8, 4, 6
  lens = np.array([5, 3], np.int32)
  rng = np.random.default_rng(0)
  prompts = rng.integers(1, 100, size=(2, p)).astype(np.int32)
  rows = np.repeat(np.arange(2), g)  # slot = prompt * g + sample
  feed = rng.integers(1, 100, size=(steps, 2 * g)).astype(np.int32)

  @jax.jit
  def run(prompts, feed):
    cache, _, _ = sl.prefill_hidden(model, prompts, jnp.asarray(lens))
    dense = cache.repeat(g).grow(steps)
    paged = model.init_paged_cache(2 * g, num_pages=12, page_size=t, max_pages_per_slot=4)
    for i in range(2):  # one prompt's pages, written once, attached to its g slots
      paged, pages, _ = pkv.alloc(paged, jnp.int32(lens[i]))
      kv = [pkv.per_layer(lambda x: x[i].transpose(2, 0, 1), cache.k),
            pkv.per_layer(lambda x: x[i].transpose(1, 0, 2), cache.v)]
      paged = pkv.write_prompt(paged, pages, *kv, jnp.int32(lens[i]))
      paged = pkv.attach(paged, jnp.arange(g) + i * g, jnp.tile(pages[None], (g, 1)),
                         jnp.full((g,), lens[i], jnp.int32))
      paged = pkv.release(paged, pages[None])
    def step(carry, xs):  # one compiled body for all steps
      dense, paged = carry
      s, tokens = xs
      pos = jnp.asarray(lens[rows]) + s
      ld, dense = model.decode_step(tokens, pos, dense)
      lp, paged, app = model.decode_step_paged(tokens, pos, paged, jnp.ones((2 * g,), bool),
                                               impl=impl)
      return (dense, paged), (ld, lp, app.ok)

    (_, paged), out = jax.lax.scan(step, (dense, paged), (jnp.arange(steps), feed))
    return out, paged

  with attention.interpret_pallas():
    out, paged = run(jnp.asarray(prompts), jnp.asarray(feed))
  ld, lp, ok = (np.asarray(x) for x in out)
  assert ok.all()
  np.testing.assert_allclose(lp, ld, atol=1e-5, rtol=1e-5)
  # Prompt 0 (5 tokens -> 11): its first page shared, the second kept by one slot and copied
  # for the other, a third page each: 5. Prompt 1 (3 tokens -> 9): the first page kept and
  # copied, two more each: 6.
  np.testing.assert_array_equal(np.asarray(paged.length), lens[rows] + steps)
  assert int(paged.free_pages()) == 12 - 5 - 6


def test_ragged_blocks_keep_the_block_within_the_scoped_vmem_budget():
  """Off a TPU the ragged kernel's (pages, queries) per block: its default (128, 32), capped by
  the sequence's pages and slots, then halved until RAGGED_BLOCK_BYTES' estimate fits."""
  spec = jax.ShapeDtypeStruct
  bf16 = jnp.bfloat16
  blocks = lambda q, kv, m, n, dtype=bf16: pa.ragged_blocks(spec(q, dtype), spec(kv, dtype), m, n)
  # Qwen2.5-32B at tensor 8 (5 query heads, 1 KV head): compiled at 128 pages; kept.
  assert blocks((256, 5, 128), (9, 64, 2, 128), 352, 256) == (128, 32)
  # Qwen3-8B at tensor 4 and Qwen3-32B at tensor 8: out of scoped VMEM at 128, fit at 64.
  assert blocks((256, 8, 128), (9, 64, 4, 128), 352, 256) == (64, 32)
  assert blocks((64, 8, 128), (9, 64, 2, 128), 352, 64) == (64, 32)
  # A short sequence or few slots cap it first; fp32 KV takes fewer pages.
  assert blocks((4, 8, 128), (9, 64, 4, 128), 10, 4) == (10, 4)
  assert blocks((256, 8, 128), (9, 64, 4, 128), 352, 256, jnp.float32)[0] == 32
