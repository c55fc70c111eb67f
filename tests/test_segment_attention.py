"""Packed-row attention (models/segment_attention.py): the splash kernel with each row's block map
skips the blocks across segments, counted, and equals the dense segment mask (interpret mode)."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax.models import attention
from dapo_jax.models import segment_attention as sa

B, T, H, K, E = 2, 640, 4, 2, 32
BLOCK = 128  # the splash tile for T = 640 (5 x 128; `attention._splash_block`)


def _segments():
  """Row 0: three sequences then padding; row 1: a short one and a long one."""
  seg = np.zeros((B, T), np.int32)
  seg[0, :100], seg[0, 100:300], seg[0, 300:460] = 1, 2, 3
  seg[1, :50], seg[1, 50:] = 1, 2
  return seg


def _qkv(seed=0):
  rng = np.random.RandomState(seed)
  return (jnp.asarray(rng.randn(B, T, H, E), jnp.float32),
          jnp.asarray(rng.randn(B, T, K, E), jnp.float32),
          jnp.asarray(rng.randn(B, T, K, E), jnp.float32))


def test_the_block_map_is_what_the_dense_segment_mask_implies():
  seg = _segments()
  got = np.asarray(sa.block_map(jnp.asarray(seg), BLOCK))
  dense = np.asarray(attention.causal_mask(jnp.asarray(seg > 0), jnp.asarray(seg)).dense_BxTxS)
  n = T // BLOCK
  for b in range(B):
    for i in range(n):
      for j in range(n):
        tile = dense[b, i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
        want = 1 if i == j else (2 if tile.any() else 0)
        assert got[b, i, j] == want, (b, i, j)
  # Row 0 computes 9 of its 15 causal blocks (the third sequence's block skips the first two,
  # the padding block all but itself); row 1's long second sequence reaches back to block 0.
  np.testing.assert_array_equal(np.asarray(sa.computed_blocks(jnp.asarray(seg), BLOCK)), [9, 15])
  assert attention._splash_block(T) == BLOCK  # pylint: disable=protected-access


def test_work_follows_the_sequences_squares_not_the_rows():
  """Eight sequences of 512 tokens in a row of 4096: 8 x (4 x 5 / 2) = 80 blocks of 128, where
  the row's causal square is 32 x 33 / 2 = 528."""
  seg = np.repeat(np.arange(1, 9, dtype=np.int32), 512)[None]
  assert int(sa.computed_blocks(jnp.asarray(seg), BLOCK)[0]) == 80


def _dense(q, k, v, seg):
  mask = attention.causal_mask(jnp.asarray(seg > 0), jnp.asarray(seg))
  return attention.xla_attention(q, k, v, mask.dense_BxTxS)


def _packed_splash(q, k, v, seg):
  mask = attention.causal_mask(jnp.asarray(seg > 0), jnp.asarray(seg))
  with attention.interpret_pallas():
    return attention.dot_product_attention(q, k, v, mask, impl="splash")


def test_packed_splash_equals_the_dense_segment_mask_forward_and_backward():
  seg = _segments()
  q, k, v = _qkv()
  valid = seg > 0
  np.testing.assert_allclose(np.asarray(_packed_splash(q, k, v, seg))[valid],
                             np.asarray(_dense(q, k, v, seg))[valid], atol=1e-5)

  def loss(fn):
    return lambda q, k, v: jnp.sum(jnp.where(valid[:, :, None, None], fn(q, k, v, seg), 0) ** 2)

  got = jax.grad(loss(_packed_splash), argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(loss(_dense), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("poisoned_block", [0, 1])
def test_skipped_blocks_are_never_read(poisoned_block):
  """Keys and values of one key block set to NaN: the query blocks the map skips it for stay
  finite and unchanged, and the ones that visit it turn NaN (so the check can fail)."""
  seg = _segments()
  q, k, v = _qkv(seed=1)
  sl = slice(poisoned_block * BLOCK, (poisoned_block + 1) * BLOCK)
  k_bad = k.at[:, sl].set(jnp.nan)
  v_bad = v.at[:, sl].set(jnp.nan)
  out = np.asarray(_packed_splash(q, k_bad, v_bad, seg))
  clean = np.asarray(_packed_splash(q, k, v, seg))
  visit = np.asarray(sa.block_map(jnp.asarray(seg), BLOCK))[:, :, poisoned_block] > 0
  checked = 0
  for b in range(B):
    for i in range(T // BLOCK):
      rows = out[b, i * BLOCK:(i + 1) * BLOCK]
      if visit[b, i]:
        assert np.isnan(rows).any(), (b, i)
      else:
        np.testing.assert_array_equal(rows, clean[b, i * BLOCK:(i + 1) * BLOCK])
        checked += 1
  assert checked >= 1


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install 'jax[tpu]')")
def test_packed_splash_compiles_for_tpu_forward_and_backward():
  """libtpu's Mosaic compiler takes the kernel with per-row block maps (a loop of kernel calls
  over the rows, as Pallas batches scalar-prefetched maps), forward and gradients, at a packed
  row of 4,096 tokens and Qwen-like heads (bf16)."""
  from dapo_jax.planner import targets as plan_targets  # pylint: disable=g-import-not-at-top
  plan_targets.prepare_libtpu_env("tpu:v5p:2x2x1")
  device = plan_targets.tpu_devices("v5p:2x2x1")[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  b, t, h, kh, e = 2, 4096, 8, 2, 128

  def loss(q, k, v, seg):
    mask = attention.causal_mask(seg > 0, seg)
    return jnp.sum(attention.dot_product_attention(q, k, v, mask, impl="splash")
                   .astype(jnp.float32))

  mesh = jax.sharding.Mesh(np.array([device]), ("x",))
  with attention.compile_for("tpu"), jax.set_mesh(mesh):
    lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(
        spec((b, t, h, e), jnp.bfloat16), spec((b, t, kh, e), jnp.bfloat16),
        spec((b, t, kh, e), jnp.bfloat16), spec((b, t), jnp.int32))
    compiled = lowered.compile()  # raises if Mosaic rejects the kernel
  assert "tpu_custom_call" in compiled.as_text()
