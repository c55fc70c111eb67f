"""The combined K/V pool layout (`PagedKVCache.combined`, the ragged TPU kernel's [P, T, 2K, E]):
chosen by the attention impl, it yields the split layout's tokens. The ragged kernel itself only
compiles through libtpu (tests/test_plan_paged.py); on CPU the reference attention reads the
combined pool in its place."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dapo_jax.infra import sharding as shd
from dapo_jax.models import create_model, get_preset
from dapo_jax.models import paged_attention as pa
from dapo_jax.models import paged_kv as pkv
from dapo_jax.rollout import continuous
from dapo_jax.rollout.sampling import SamplingParams

G, R = 3, 16
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=R, eos_ids=(5, 7), pad_id=0)


def test_combined_pool_holds_the_split_pools_tokens():
  """Prompt writes, a copy-on-write and token writes land in the combined pool exactly where
  the split pool has them; the reference reads both to the same output."""
  kw = dict(num_layers=2, num_slots=2, num_pages=6, page_size=4, max_pages_per_slot=3,
            kv_heads=2, head_dim=8, dtype=jnp.float32)
  rng = np.random.default_rng(0)
  k = [jnp.asarray(rng.normal(size=(1, 2, 8, 8)), jnp.float32) for _ in range(2)]
  v = [jnp.asarray(rng.normal(size=(1, 2, 8, 8)), jnp.float32) for _ in range(2)]
  new = jnp.asarray(rng.normal(size=(2, 2, 8)), jnp.float32)
  q = jnp.asarray(rng.normal(size=(2, 4, 8)), jnp.float32)

  @jax.jit
  def run(k, v, new, q):
    out = []
    for combined in (False, True):
      c = pkv.PagedKVCache.zeros(**kw, combined=combined)
      c, pages, _ = pkv.alloc(c, jnp.int32(6))
      c = pkv.write_prompts(c, pages[None], tuple(k), tuple(v), jnp.array([6]))
      c = pkv.attach(c, jnp.array([0, 1]), jnp.stack([pages, pages]), jnp.array([6, 6]))
      c, app = pkv.reserve_append(c, jnp.array([True, True]))  # both write page 1: one copies
      pools = pkv.write_token(c.k[0], None if combined else c.v[0], new, -new, app)
      c = pkv.commit_append(c.replace(k=(pools[0], c.k[1]),
                                      v=None if combined else (pools[1], c.v[1])), app)
      att = pa.reference_paged_attention(q, c.k[0], None if combined else c.v[0], c.table,
                                         c.length)
      assert (c.v is None) == combined and c.page_size == 4
      out.append((pkv.gather_dense(c, 0), att, c.table))
    return out

  out = run(k, v, new, q)
  (dense_s, att_s, table_s), (dense_c, att_c, table_c) = out
  np.testing.assert_array_equal(table_s, table_c)
  for a, b in zip(dense_s, dense_c):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_allclose(att_s, att_c, atol=1e-6)
  # gather_dense's keys at slot 1's new token are what was written (the combined layout's
  # interleave is not a silent K/V swap).
  assert float(jnp.abs(dense_c[0][1, :, :, 6] - new[1]).max()) == 0.0


def test_ragged_call_is_read_as_the_kernels_own_reference_reads_it(monkeypatch):
  """`ragged_tpu_attention`'s arguments (one query token per slot, sm_scale, lengths, page
  table, and a stacked pool's layer as a page offset into its L x P pages) given to JAX's own
  reference of the ragged kernel (`ref_ragged_paged_attention`, what the kernel computes) give
  the reference paged attention's output for that layer."""
  from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(rpa, "ragged_paged_attention", lambda *a, num_kv_pages_per_block,
                      num_queries_per_block, **kw: rpa.ref_ragged_paged_attention(*a, **kw))
  rng = np.random.default_rng(1)
  layers, pages, t, kh, h, e, n = 2, 6, 4, 2, 4, 8, 3
  pool = jnp.asarray(rng.normal(size=(layers, pages, t, 2 * kh, e)), jnp.float32)
  q = jnp.asarray(rng.normal(size=(n, h, e)), jnp.float32)
  table = jnp.array([[0, 3, -1], [2, -1, -1], [5, 1, 4]], jnp.int32)
  length = jnp.array([6, 1, 11], jnp.int32)
  flat = pool.reshape((layers * pages,) + pool.shape[2:])  # the stacked pool's L x P pages
  for layer in range(layers):
    want = pa.reference_paged_attention(q, pool[layer], None, table, length)
    got = pa.ragged_tpu_attention(q, flat, jnp.maximum(table, 0) + layer * pages, length)
    np.testing.assert_allclose(got, want, atol=2e-6)


def test_combined_pool_is_refused_by_a_split_kernel():
  with pytest.raises(ValueError, match="takes split K and V"):
    pa.paged_decode_attention(jnp.zeros((1, 2, 8)), jnp.zeros((4, 4, 2, 8)), None,
                              jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32),
                              impl="pallas_gpu")


def test_ragged_impl_keeps_a_combined_pool_in_the_sharded_engine(monkeypatch):
  """attention_impl="ragged_tpu" on a 2 x 2 x 2 mesh, scanned layers: the engine's pools are
  combined, laid out per shard with KV heads over `tensor`, the attention runs in the kernels'
  shard_map (the reference standing in for the kernel, which needs libtpu), and the tokens are
  the dense engine's."""
  monkeypatch.setattr(pa, "ragged_tpu_attention", lambda q, kv, table, length:
                      pa.reference_paged_attention(q, kv, None, table, length))
  # Scanned layers: the stacked pools are [S, L, ...] (shards first, as every per-shard map
  # expects).
  mcfg = get_preset("test", num_hidden_layers=1, scan_layers=True)
  graphdef, state = nnx.split(create_model(mcfg, seed=0))
  rng = np.random.default_rng(0)
  ids = rng.integers(10, 100, (4, 7)).astype(np.int32)
  mask = np.ones_like(ids, bool)
  mask[1, :3] = mask[2, :5] = False
  budgets = rng.integers(1, R + 1, len(ids) * G).tolist()

  def generate(sampler):
    return jax.device_get(sampler.generate(state, np.where(mask, ids, 0), mask,
                                           jax.random.key(7), PARAMS, num_samples=G,
                                           max_new_tokens=budgets))

  dense = generate(continuous.ContinuousSampler(graphdef, num_slots=8, chunk_steps=8,
                                                max_prefill_length=16, kv_cache="dense"))
  mesh = shd.make_mesh([("data", 2), ("fsdp", 2), ("tensor", 2)])
  sampler = continuous.ContinuousSampler(graphdef, num_slots=8, chunk_steps=8, mesh=mesh,
                                         max_prefill_length=16, kv_cache="paged", page_size=4,
                                         kv_pages=14, attention_impl="ragged_tpu")
  out = generate(sampler)
  np.testing.assert_array_equal(out.response_ids, dense.response_ids)
  np.testing.assert_allclose(out.logprobs, dense.logprobs, atol=1e-5, rtol=0)
  stream = sampler.open_stream(state, params=PARAMS, num_samples=G, key=jax.random.key(0),
                               prompt_length=7)
  cache = stream._engine.slots.decode.cache  # pylint: disable=protected-access
  assert cache.combined and cache.v is None
  k = cache.k
  assert k.shape[:5] == (4, 1, 14, 4, 4)  # [S, L, P, T, 2K, E]
  assert k.sharding.shard_shape(k.shape)[:5] == (1, 1, 14, 4, 2)  # a shard's pool, a KV head's
  stream.close()
