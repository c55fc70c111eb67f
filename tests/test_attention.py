"""Attention kernels by platform (dapo_jax.models.attention): selection, errors, numerics.

The splash kernel runs in Pallas interpret mode on CPU, against the XLA einsum reference.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dapo_jax.infra import sharding as shd
from dapo_jax.models import attention, create_model, get_preset
from dapo_jax.models.kv_cache import KVCache
from tests.hlo_checks import big_copies

B, T, H, K, E = 2, 128, 4, 2, 32


def _qkv(seed=0, t=T, s=T, dtype=jnp.float32):
  rng = np.random.RandomState(seed)
  q = jnp.asarray(rng.randn(B, t, H, E), dtype)
  k = jnp.asarray(rng.randn(B, s, K, E), dtype)
  v = jnp.asarray(rng.randn(B, s, K, E), dtype)
  return q, k, v


def _causal_mask(valid_BxT):
  valid = jnp.asarray(valid_BxT)
  t = valid.shape[1]
  dense = jnp.tril(jnp.ones((t, t), bool))[None] & valid[:, None, :]
  return attention.Mask(dense, valid, causal=True)


def _padded_valid():
  """Row 0 left-padded (a prompt), row 1 left- and right-padded (prompt + short response)."""
  valid = np.ones((B, T), bool)
  valid[0, :9] = False
  valid[1, :3] = False
  valid[1, 100:] = False
  return valid


@pytest.mark.parametrize("platform,dtype,seq_len,want", [
    ("gpu", jnp.bfloat16, 4096, "cudnn"),
    ("gpu", jnp.float32, 4096, "xla"),  # cuDNN flash attention is bf16/fp16 only
    ("gpu", jnp.bfloat16, 7, "xla"),  # odd length
    ("tpu", jnp.bfloat16, 4096, "splash"),
    ("tpu", jnp.float32, 384, "splash"),
    ("tpu", jnp.bfloat16, 100, "xla"),  # not a multiple of the 128 splash tile
    ("cpu", jnp.bfloat16, 4096, "xla"),
])
def test_auto_picks_kernel_by_platform(platform, dtype, seq_len, want):
  assert attention.resolve_impl("auto", platform=platform, dtype=dtype, seq_len=seq_len,
                                head_dim=64) == want


def test_explicit_names_pass_and_unknown_names_raise():
  for name in ("xla", "cudnn", "splash"):
    assert attention.resolve_impl(name, platform="cpu") == name
  with pytest.raises(ValueError, match="attention_impl='flash'"):
    attention.resolve_impl("flash")


def test_forced_accelerator_kernels_raise_clear_errors_on_cpu():
  q, k, v = _qkv()
  mask = _causal_mask(np.ones((B, T), bool))
  with pytest.raises(RuntimeError, match="cudnn.*needs an NVIDIA GPU"):
    attention.dot_product_attention(q, k, v, mask, impl="cudnn")
  with pytest.raises(RuntimeError, match="splash.*TPU kernel"):
    attention.dot_product_attention(q, k, v, mask, impl="splash")
  q, k, v = _qkv(t=100, s=100)
  with attention.interpret_pallas(), pytest.raises(ValueError, match="multiple of 128"):
    attention.dot_product_attention(q, k, v, _causal_mask(np.ones((B, 100), bool)),
                                    impl="splash")


def _loss(impl, valid):
  def f(q, k, v):
    out = attention.dot_product_attention(q, k, v, _causal_mask(valid), impl=impl)
    w = jnp.asarray(valid, jnp.float32)[:, :, None, None]  # padding queries are never read
    return jnp.sum(jnp.sin(out) * w), out
  return f


def test_splash_matches_xla_with_gqa_and_padding():
  q, k, v = _qkv()
  valid = _padded_valid()
  with attention.interpret_pallas():
    (_, out), grads = jax.jit(jax.value_and_grad(_loss("splash", valid), (0, 1, 2),
                                                 has_aux=True))(q, k, v)
  (_, ref), ref_grads = jax.value_and_grad(_loss("xla", valid), (0, 1, 2), has_aux=True)(q, k, v)
  np.testing.assert_allclose(np.asarray(out)[valid], np.asarray(ref)[valid], atol=1e-5)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=5e-5)


def test_splash_bf16_forward_close_to_fp32_reference():
  q, k, v = _qkv(seed=5)
  valid = _padded_valid()
  bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  with attention.interpret_pallas():
    out = jax.jit(lambda *a: _loss("splash", valid)(*a)[1])(*bf16)
  ref = attention.xla_attention(q, k, v, _causal_mask(valid).dense_BxTxS)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32)[valid], np.asarray(ref)[valid],
                             atol=3e-2)


def test_splash_under_a_mesh_is_shard_mapped_and_matches():
  """Batch over data x fsdp, heads over tensor: the kernel runs per shard (shard_map)."""
  mesh = shd.make_mesh([("data", 2), ("fsdp", 1), ("tensor", 2)], devices=jax.devices()[:4])
  q, k, v = _qkv(seed=1)
  valid = _padded_valid()

  def run(q, k, v):
    with shd.activation_sharding(mesh, shd.TRAIN_RULES):
      return attention.dot_product_attention(q, k, v, _causal_mask(valid), impl="splash")

  with attention.interpret_pallas():
    lowered = jax.jit(run).lower(q, k, v)
    out = lowered.compile()(q, k, v)
  assert "shard_map" in lowered.as_text() or "sdy.manual_computation" in lowered.as_text()
  ref = attention.xla_attention(q, k, v, _causal_mask(valid).dense_BxTxS)
  np.testing.assert_allclose(np.asarray(out)[valid], np.asarray(ref)[valid], atol=1e-5)


def test_decode_attention_matches_einsum_reference():
  """One query over the cache layout ([N, K, E, S] keys, [N, K, S, E] values) equals the
  full-pass einsums over [B, S, K, E]."""
  q, k, v = _qkv(seed=2, t=1, s=40)
  valid_BxS = jnp.asarray(np.random.RandomState(3).rand(B, 40) > 0.3)
  out = attention.decode_attention(q[:, 0], k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3),
                                   valid_BxS)
  ref = attention.xla_attention(q, k, v, valid_BxS[:, None])[:, 0]
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)


def test_model_forward_with_splash_matches_xla():
  """The model wires the structured mask through remat to the kernel: same logits."""
  cfg = get_preset("test", remat="full", num_hidden_layers=1)
  ref_model = create_model(cfg, seed=0)
  splash_model = create_model(cfg.replace(attention_impl="splash"), seed=0)
  valid = _padded_valid()
  ids = jnp.asarray(np.random.RandomState(4).randint(1, cfg.vocab_size, (B, T)))
  with attention.interpret_pallas():
    out = jax.jit(lambda m, i: m(i, attention_mask_BxT=valid))(splash_model, ids)
  ref = ref_model(ids, attention_mask_BxT=valid)
  np.testing.assert_allclose(np.asarray(out)[valid], np.asarray(ref)[valid], atol=1e-4)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("same_slot", [True, False], ids=["shared_slot", "per_row_slots"])
def test_kv_cache_decode_step_never_copies_the_cache(same_slot, scan):
  """model.decode_step, one token per row: no transpose or copy of a cache layer-sized array,
  whether all rows write one slot (static sampler) or each its own (JetStream slots), and
  whether the layers are unrolled or scanned over one stacked cache."""
  model = create_model(get_preset("test", scan_layers=scan), seed=0)
  graphdef, state = nnx.split(model)
  n, s = 8, 96
  cache = model.init_cache(n, s).replace(index=jnp.arange(n, dtype=jnp.int32) * 5)

  def step(state, cache, tok_N, pos_N):
    return nnx.merge(graphdef, state).decode_step(tok_N, pos_N, cache, same_slot=same_slot)

  args = (state, cache, jnp.zeros((n,), jnp.int32), jnp.full((n,), 5, jnp.int32))
  hlo = jax.jit(step, donate_argnums=1).lower(*args).compile().as_text()
  copies = big_copies(hlo, int(np.prod(cache.k[0].shape)))
  assert not copies, copies


def test_sampler_and_engine_prefill_through_the_kernel_decode_through_the_cache(monkeypatch):
  """attention_impl reaches the static sampler's and the JetStream engine's prefill; their
  one-token steps stay on the cache path."""
  from dapo_jax.rollout import jetstream_engine as je  # pylint: disable=g-import-not-at-top
  from dapo_jax.rollout import sampler, sampling  # pylint: disable=g-import-not-at-top
  calls = []

  def fake_splash(q, k, v, key_valid_BxS, interpret=None):
    del interpret
    calls.append(q.shape[1])
    return attention.xla_attention(q, k, v, _causal_mask(key_valid_BxS).dense_BxTxS)

  monkeypatch.setattr(attention, "splash_attention", fake_splash)
  model = create_model(get_preset("test", attention_impl="splash", num_hidden_layers=1), seed=0)
  ids = jnp.asarray(np.random.RandomState(6).randint(1, 100, (2, T)), jnp.int32)
  graphdef, params = nnx.split(model)
  out = sampler.Sampler(graphdef, cache_segments=1).generate(
      params, ids, jnp.ones(ids.shape, bool), jax.random.key(0),
      sampling.SamplingParams(max_new_tokens=2))
  assert int(out.num_steps) == 2 and calls == [T]  # the prefill only
  calls.clear()
  engine = je.QwenEngine(model, max_concurrent_decodes=2, max_prefill_length=T,
                         sampling=sampling.SamplingParams(temperature=0.0, max_new_tokens=2))
  state = engine.insert(engine.prefill(params=engine.load_params(), padded_tokens=ids[0],
                                       true_length=50), engine.init_decode_state(), slot=0)
  engine.generate(engine.load_params(), state)
  assert calls == [T]


@pytest.mark.parametrize("platform,dtype,prompt,response,expect", [
    ("tpu", "bfloat16", 100, 900, "multiple of 128 (e.g. 1024)"),
    ("tpu", "bfloat16", 128, 896, None),
    ("gpu", "float32", 128, 896, "model.dtype='float32'"),
    ("gpu", "bfloat16", 128, 896, None),
    ("cpu", "bfloat16", 100, 900, None),
])
def test_the_run_says_when_auto_attention_falls_back_to_xla(platform, dtype, prompt, response,
                                                            expect):
  from dapo_jax.trainer import run_setup  # pylint: disable=g-import-not-at-top
  mcfg = get_preset("qwen2.5-0.5b", dtype=dtype, attention_impl="auto")
  note = run_setup.attention_fallback(prompt + response, mcfg, platform)
  if expect is None:
    assert note is None
  else:
    assert expect in note, note


@pytest.mark.parametrize("stacked", [False, True], ids=["per_layer", "stacked"])
def test_kv_cache_copy_row_is_insert_of_one_row(stacked):
  """`copy_row` (the continuous engine's in-place admission) writes what `insert` writes for
  that one row: keys, values, valid slots (past the prompt: invalid) and the index; other rows
  untouched."""
  rng = np.random.RandomState(5)

  def filled(rows, length):
    c = KVCache.zeros(3, rows, length, 2, 4, jnp.float32, stacked=stacked)
    fill = lambda x: jnp.asarray(rng.randn(*x.shape), jnp.float32)
    return c.replace(k=jax.tree.map(fill, c.k), v=jax.tree.map(fill, c.v),
                     valid=jnp.asarray(rng.rand(rows, length) < 0.5),
                     index=jnp.asarray(rng.randint(0, length, rows), jnp.int32))

  dst, src = filled(5, 12), filled(3, 7)
  got = jax.jit(lambda d, s: d.copy_row(s, jnp.int32(2), jnp.int32(3), jnp.int32(9)))(dst, src)
  row = (lambda x: x[:, 2:3]) if stacked else (lambda x: x[2:3])
  src_row = KVCache(k=jax.tree.map(row, src.k), v=jax.tree.map(row, src.v),
                    valid=src.valid[2:3], index=jnp.asarray([9], jnp.int32))
  want = dst.insert(src_row, jnp.asarray([3]))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not np.asarray(got.valid)[3, 7:].any()


def test_the_cudnn_padding_bias_with_its_causal_flag_is_the_dense_mask():
  """cuDNN gets the causal flag and `padding_bias` (keys only) instead of the dense mask: the
  same attention, checked with jax.nn's XLA implementation of those very arguments (cuDNN itself
  needs a GPU)."""
  q, k, v = _qkv(seed=3)
  valid = _padded_valid()
  mask = _causal_mask(valid)
  bias = attention.padding_bias(mask, T, q.dtype)
  assert bias.shape == (B, 1, T, T)
  out = jax.nn.dot_product_attention(q, k, v, bias=bias, is_causal=True)
  ref = attention.dot_product_attention(q, k, v, mask, impl="xla")
  np.testing.assert_allclose(np.asarray(out)[valid], np.asarray(ref)[valid], atol=1e-5)


def test_cudnn_is_used_only_where_the_batch_divides_its_mesh_axes():
  """cuDNN's custom partitioner refuses a batch its mesh axes do not divide (GSPMD would pad):
  a prefill of 6 prompts on 8 GPUs failed to compile (IndivisibleError). Such a call takes the
  XLA path; a dividing batch keeps cuDNN (its compile: tests/test_plan_gpu.py)."""
  mesh = shd.make_mesh([("data", 1), ("fsdp", -1), ("tensor", 1)])
  assert mesh.size == 8
  with shd.activation_sharding(mesh, shd.SAMPLE_RULES):
    assert attention._batch_divides_its_mesh_axes(16)  # pylint: disable=protected-access
    assert not attention._batch_divides_its_mesh_axes(6)  # pylint: disable=protected-access
  assert attention._batch_divides_its_mesh_axes(6)  # no activation mesh: nothing to check


def test_the_cudnn_segment_bias_with_its_causal_flag_is_the_packed_mask():
  """Packed rows on GPU: cuDNN gets the causal flag and a [B, 1, T, S] bias from the segments
  (the same one array as the padding bias), checked with jax.nn's XLA implementation of those
  arguments against the dense segment mask; a padding query's row stays finite."""
  q, k, v = _qkv(seed=4)
  seg = np.zeros((B, T), np.int32)
  seg[0, :40], seg[0, 40:90], seg[0, 90:120] = 1, 2, 3
  seg[1, :128] = np.repeat([1, 2], 64)
  mask = attention.causal_mask(jnp.asarray(seg > 0), jnp.asarray(seg))
  bias = attention.padding_bias(mask, T, q.dtype)
  assert bias.shape == (B, 1, T, T)
  out = np.asarray(jax.nn.dot_product_attention(q, k, v, bias=bias, is_causal=True))
  ref = np.asarray(attention.dot_product_attention(q, k, v, mask, impl="xla"))
  real = seg > 0
  np.testing.assert_allclose(out[real], ref[real], atol=1e-5)
  assert np.isfinite(out).all()
  # Without the segments the first sequence's tokens would see across: the bias is not keys-only.
  keys_only = attention.padding_bias(attention.Mask(mask.dense_BxTxS, mask.key_valid_BxS,
                                                    causal=True), T, q.dtype)
  crossed = np.asarray(jax.nn.dot_product_attention(q, k, v, bias=keys_only, is_causal=True))
  assert not np.allclose(crossed[real], ref[real], atol=1e-3)
