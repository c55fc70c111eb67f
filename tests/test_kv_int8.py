"""8-bit KV caches (models/kv_quant.py, rollout.kv_cache_dtype): every attention path over int8
and e4m3 pages against the full-precision attention on the same random K/V within a stated
tolerance; the decode steps and the continuous engine (sampling, log-probs, preemption) with an
int8 cache; the default dtype untouched."""

from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dapo_jax.models import attention, kv_quant
from dapo_jax.models import paged_attention as pa
from dapo_jax.models import paged_kv as pkv
from dapo_jax.rollout import continuous
from dapo_jax.rollout.sampling import SamplingParams
from tests.test_paged_kv import _paged_problem

# Max |attention output - full precision| on unit-normal K/V and queries (outputs are O(0.3)):
# int8 rounds each value to 1/254 of its token's absmax (measured 0.011), e4m3 to 3 mantissa
# bits (measured 0.09). A wrong scale, page or token is off by O(1).
TOL = {"int8": 0.03, "float8_e4m3fn": 0.2}
LENGTHS = [1, 13, 64]


def _quantized(c: pkv.PagedKVCache, name: str) -> pkv.PagedKVCache:
  dt = kv_quant.QUANTIZED[name]
  return c.replace(k=tuple(kv_quant.encode(x, dt) for x in c.k),
                   v=tuple(kv_quant.encode(x, dt) for x in c.v))


def test_encode_keeps_a_scale_per_token_and_head_and_plain_dtypes_as_casts():
  x = jax.random.normal(jax.random.key(0), (3, 2, 16)) * jnp.arange(1, 4)[:, None, None]
  xs = kv_quant.encode(x, jnp.int8)
  assert xs.shape == (3, 2, 16 + kv_quant.SCALE_BYTES) and xs.dtype == jnp.int8
  vals, scale = kv_quant.split(xs)
  np.testing.assert_allclose(np.asarray(scale[..., 0]), np.abs(np.asarray(x)).max(-1) / 127,
                             rtol=1e-6)
  assert int(jnp.abs(vals.astype(jnp.int32)).max()) == 127
  np.testing.assert_allclose(np.asarray(kv_quant.decode(xs, jnp.float32)), np.asarray(x),
                             atol=float(scale.max()) / 2 + 1e-7)
  # An all-zero token (padding) stays zero, finite.
  assert not np.asarray(kv_quant.decode(kv_quant.encode(jnp.zeros((2, 8)), jnp.int8),
                                        jnp.float32)).any()
  for dt in (jnp.float32, jnp.bfloat16):  # the default cache: a plain cast, bit for bit
    np.testing.assert_array_equal(np.asarray(kv_quant.encode(x, dt)), np.asarray(x.astype(dt)))
  with pytest.raises(ValueError, match="kv_cache_dtype='int4'"):
    kv_quant.resolve("int4", "bfloat16")


@pytest.mark.parametrize("name", ["int8", "float8_e4m3fn"])
def test_dense_and_xla_paged_attention_over_8bit_pages_match_full_precision(name):
  q, c, full = _paged_problem(2, 3, 4, 2, 128, 16, 4, LENGTHS)
  cq = _quantized(c, name)
  assert cq.k[0].shape[-1] == 128 + kv_quant.SCALE_BYTES
  dense = attention.decode_attention(q, *pkv.gather_dense(cq, 0))
  ref = jax.jit(functools.partial(pa.reference_paged_attention, pages_per_block=3))(
      q, cq.k[0], cq.v[0], c.table, c.length)
  for out in (dense, ref):
    err = float(np.abs(np.asarray(out) - full).max())
    assert 1e-4 < err < TOL[name], err  # quantized (not exact), and close
  np.testing.assert_allclose(np.asarray(ref), np.asarray(dense), atol=1e-6)
  # The combined [P, T, 2K, E + 4] layout (the ragged kernel's) through the reference.
  comb = kv_quant.encode(pa.combine_kv(c.k[0], c.v[0]), kv_quant.QUANTIZED[name])
  out = pa.reference_paged_attention(q, comb, None, c.table, c.length)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-6)


@pytest.mark.parametrize("name", ["int8", "float8_e4m3fn"])
def test_pallas_kernels_in_interpret_mode_read_8bit_pages(name):
  """The Pallas TPU kernel (its QuantizedTensor) and the GPU kernel (its [K, P, T] scales), in
  interpret mode, agree with the reference over the same 8-bit pages; the stacked GPU path
  reads layer 1 of a stacked 8-bit pool."""
  q, c, full = _paged_problem(2, 3, 4, 2, 128, 16, 4, LENGTHS)
  cq = _quantized(c, name)
  ref = np.asarray(pa.reference_paged_attention(q, cq.k[0], cq.v[0], c.table, c.length))
  with attention.interpret_pallas():
    tpu = pa.paged_decode_attention(q, cq.k[0], cq.v[0], c.table, c.length, impl="pallas_tpu")
    stack = lambda x: jnp.stack([x, jnp.zeros_like(x), x])
    gpu = jax.jit(functools.partial(pa.paged_decode_attention, impl="pallas_gpu"))(
        q, stack(cq.k[0]), stack(cq.v[0]), c.table, c.length, layer=jnp.int32(2))
  # The TPU kernel dequantizes in fp32 at its DEFAULT (bf16-pass) matmul precision.
  np.testing.assert_allclose(np.asarray(tpu), ref, atol=1e-2)
  np.testing.assert_allclose(np.asarray(gpu), ref, atol=1e-5)
  assert float(np.abs(np.asarray(gpu) - full).max()) < TOL[name]


def _with_kv(graphdef, state, kv_cache_dtype):
  model = nnx.merge(graphdef, state)
  model.config = model.config.replace(kv_cache_dtype=kv_cache_dtype)
  return nnx.split(model)[0]


def test_int8_decode_steps_dense_and_paged_agree_and_stay_near_full_precision():
  """Prefill, then 6 fed tokens: the int8 dense step and the int8 paged step (shared prompt
  pages, copy-on-write) give the same logits, within 0.05 of the full-precision step's.
  Scanned layers (the stacked caches); the engine test below runs the unrolled model."""
  scan = True
  from dapo_jax.models import create_model, get_preset  # pylint: disable=g-import-not-at-top
  from dapo_jax.rollout import slots as sl  # pylint: disable=g-import-not-at-top
  g, steps, t = 2, 6, 4
  lens = np.array([5, 3], np.int32)
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(1, 100, size=(2, 8)).astype(np.int32))
  feed = jnp.asarray(rng.integers(1, 100, size=(steps, 2 * g)).astype(np.int32))
  rows = np.repeat(np.arange(2), g)

  def run(kv_cache_dtype):
    model = create_model(get_preset("test", num_hidden_layers=2, scan_layers=scan,
                                    kv_cache_dtype=kv_cache_dtype), seed=3)

    @jax.jit
    def go(prompts, feed):
      cache, _, _ = sl.prefill_hidden(model, prompts, jnp.asarray(lens))
      dense = cache.repeat(g).grow(steps)
      paged = model.init_paged_cache(2 * g, num_pages=12, page_size=t, max_pages_per_slot=4)
      for i in range(2):
        paged, pages, _ = pkv.alloc(paged, jnp.int32(lens[i]))
        kv = [pkv.per_layer(lambda x: x[i].transpose(2, 0, 1), cache.k),
              pkv.per_layer(lambda x: x[i].transpose(1, 0, 2), cache.v)]
        paged = pkv.write_prompt(paged, pages, *kv, jnp.int32(lens[i]))
        paged = pkv.attach(paged, jnp.arange(g) + i * g, jnp.tile(pages[None], (g, 1)),
                           jnp.full((g,), lens[i], jnp.int32))
        paged = pkv.release(paged, pages[None])

      def step(carry, xs):
        dense, paged = carry
        s, tokens = xs
        pos = jnp.asarray(lens[rows]) + s
        ld, dense = model.decode_step(tokens, pos, dense)
        lp, paged, _ = model.decode_step_paged(tokens, pos, paged, jnp.ones((2 * g,), bool),
                                               impl="xla")
        return (dense, paged), (ld, lp)

      (dense, paged), out = jax.lax.scan(step, (dense, paged), (jnp.arange(steps), feed))
      return out, dense.k, paged.k
    return go(prompts, feed)

  (ld, lp), dk, pk = run("int8")
  (ld0, _), dk0, _ = run("")
  assert jax.tree.leaves(dk)[0].dtype == jnp.int8 and jax.tree.leaves(pk)[0].dtype == jnp.int8
  assert jax.tree.leaves(dk0)[0].dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(lp), np.asarray(ld), atol=1e-5, rtol=1e-5)
  err = float(np.abs(np.asarray(ld) - np.asarray(ld0)).max())
  assert 1e-6 < err < 0.05, err


G, R = 3, 24
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=R, eos_ids=(5, 7), pad_id=0)


def _generate(graphdef, state, **kw):
  from tests.test_paged_engine import _prompts  # pylint: disable=g-import-not-at-top
  ids, mask = _prompts()
  budgets = np.random.default_rng(1).integers(1, R + 1, len(ids) * G).tolist()
  sampler = continuous.ContinuousSampler(graphdef, num_slots=4, chunk_steps=6,
                                         max_prefill_length=16, attention_impl="xla", **kw)
  out = sampler.generate(state, ids, mask, jax.random.key(7), PARAMS, num_samples=G,
                         max_new_tokens=budgets)
  return jax.device_get(out), sampler.last_stats


def test_continuous_engine_with_an_int8_cache_samples_records_logprobs_and_preempts(split_model):
  """The int8 paged engine on the smallest pool (preempting again and again: each preempted
  sample is prefilled and quantized again) draws the int8 dense engine's tokens with its
  log-probs; those log-probs are the int8 cache's (not the default's), close to them."""
  graphdef, state = split_model
  g8 = _with_kv(graphdef, state, "int8")
  dense8, _ = _generate(g8, state, kv_cache="dense")
  paged8, stats = _generate(g8, state, kv_cache="paged", page_size=4, kv_pages=17)
  ref, _ = _generate(graphdef, state, kv_cache="dense")
  assert stats.preemptions > 0 and stats.stalled_slot_steps > 0
  np.testing.assert_array_equal(paged8.response_ids, dense8.response_ids)
  np.testing.assert_array_equal(paged8.lengths, dense8.lengths)
  np.testing.assert_allclose(paged8.logprobs, dense8.logprobs, atol=1e-5, rtol=0)
  real = np.arange(R)[None] < paged8.lengths[:, None]
  assert np.isfinite(paged8.logprobs[real]).all() and (paged8.logprobs[real] <= 0).all()
  # Where the int8 run drew the default run's tokens so far, its log-probs differ a little.
  same = np.cumprod(paged8.response_ids == ref.response_ids, axis=1).astype(bool) & real
  gap = np.abs(paged8.logprobs - ref.logprobs)[same]
  assert same.sum() > 20 and 0 < gap.max() < 0.05, (same.sum(), gap.max())


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install 'jax[tpu]')")
@pytest.mark.parametrize("name", ["int8", "float8_e4m3fn"])
def test_int8_paged_kernel_compiles_for_tpu(name):
  """The Pallas TPU paged kernel over an 8-bit pool ([K, P, T, E + 4]: split into its values
  and QuantizedTensor scales) compiles for a v5p chip with libtpu, at the 32B shard's shape
  (5 query heads, 1 KV head, E = 128, pages of 64)."""
  from dapo_jax.planner import targets as plan_targets  # pylint: disable=g-import-not-at-top
  plan_targets.prepare_libtpu_env("tpu:v5p:2x2x1")
  device = plan_targets.tpu_devices("v5p:2x2x1")[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  n, h, kh, e, p, t, m = 16, 5, 1, 128, 256, 64, 16
  pool = spec((kh, p, t, e + kv_quant.SCALE_BYTES), kv_quant.QUANTIZED[name])
  mesh = jax.sharding.Mesh(np.array([device]), ("x",))
  with attention.compile_for("tpu"), jax.set_mesh(mesh):
    lowered = jax.jit(functools.partial(pa.paged_decode_attention, impl="pallas_tpu")).lower(
        spec((n, h, e), jnp.bfloat16), pool, pool, spec((n, m), jnp.int32),
        spec((n,), jnp.int32))
    compiled = lowered.compile()  # raises if libtpu's Mosaic compiler rejects the kernel
  assert lowered.out_info.shape == (n, h, e)
  assert "tpu_custom_call" in compiled.as_text()


def test_auto_reads_an_8bit_pool_with_the_xla_path_everywhere():
  """The kernels would have an 8-bit pool split or dequantized every call (a compiled v5p
  chunk's temporaries 4-5x the pool: tests/test_kv_int8_pool.py), so "auto" runs the XLA
  paged path, in the split layout; a kernel named explicitly is still used."""
  for platform in ("tpu", "gpu", "cpu"):
    for dt in (jnp.int8, jnp.float8_e4m3fn):
      assert pa.resolve_paged_impl("auto", platform, head_dim=128, dtype=dt) == "xla"
      assert not pa.uses_combined_pool("auto", platform, dtype=dt)
  assert pa.resolve_paged_impl("auto", "tpu", head_dim=128, dtype=jnp.bfloat16) == "ragged_tpu"
  assert pa.uses_combined_pool("auto", "tpu", dtype=jnp.bfloat16)
  assert pa.resolve_paged_impl("pallas_tpu", "tpu", head_dim=128, dtype=jnp.int8) == "pallas_tpu"
