"""Causal attention over packed rows that computes only the blocks a sequence needs (TPU).

A packed row (trainer/packing.py) holds several sequences, each attending within itself. A fused
kernel given only segment ids (splash's, cuDNN's) still visits the row's whole causal square
and masks what lies across segments: at a row of 22,528 tokens holding four sequences, about 4x
the attention work of the sequences' own squares. Here the splash kernel gets a block map built
on device from each row's segment ids, per row:

    block (i, j), query block i and key block j of ``block`` tokens:
      1  on the diagonal (the causal tile; the segment ids mask within it);
      2  below it where a real segment has tokens in both blocks (all kept but for segments);
      0  elsewhere: not computed, not even fetched (the kernel's scalar-prefetched map).

so attention work follows the sum of the sequences' causal squares at block granularity.
Padding (segment 0, at the row's end) attends only within its diagonal blocks: every query row
keeps at least itself, so no output is NaN.

`block_map` is the one definition of which blocks run: the kernel's map, `computed_blocks` (the
count a test compares with the dense mask's and the planner prices) and the skip test all read it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

_BIG = np.iinfo(np.int32).max


def _block_ranges(segment_ids_BxT: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
  """[B, n] lowest and highest real segment id in each block (an all-padding block: an empty
  range, lowest > highest)."""
  b, t = segment_ids_BxT.shape
  seg = segment_ids_BxT.reshape(b, t // block, block)
  real = seg > 0
  lo = jnp.min(jnp.where(real, seg, _BIG), axis=-1)
  hi = jnp.max(jnp.where(real, seg, -1), axis=-1)
  return lo, hi


def block_map(segment_ids_BxT: jax.Array, block: int) -> jax.Array:
  """[B, n, n] int8: 0 skip, 1 diagonal (causal tile), 2 below-diagonal block shared by a
  segment (see the module docstring); n = T / block."""
  t = segment_ids_BxT.shape[1]
  if t % block:
    raise ValueError(f"A packed row of {t} tokens does not split into blocks of {block}.")
  lo, hi = _block_ranges(segment_ids_BxT, block)
  n = t // block
  i = jnp.arange(n)[:, None]
  j = jnp.arange(n)[None, :]
  shared = (lo[:, :, None] <= hi[:, None, :]) & (lo[:, None, :] <= hi[:, :, None])
  out = jnp.where(i == j, 1, jnp.where((j < i) & shared, 2, 0))
  return out.astype(jnp.int8)


def computed_blocks(segment_ids_BxT: jax.Array, block: int) -> jax.Array:
  """[B] blocks the kernel computes per row (per head)."""
  return jnp.sum(block_map(segment_ids_BxT, block) > 0, axis=(1, 2))


def _carry_last_live(live_NxM: jax.Array, index_NxM: jax.Array, axis: int) -> jax.Array:
  """Each entry's block index if live, else the last live one before it along ``axis`` (0 when
  none): a skipped step then asks for the block already in memory, so nothing is fetched."""
  marked = jnp.where(live_NxM, index_NxM, -1)
  return jnp.maximum(jax.lax.cummax(marked, axis=axis), 0).astype(jnp.int32)


def _mask_infos(map_NxN: jax.Array, block: int):
  """The splash kernel's forward and fused-backward (dkv) MaskInfo of one row's block map."""
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as mi
  n = map_NxN.shape[0]
  live = map_NxN > 0
  kv_index = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[None, :], (n, n))
  q_index = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[:, None], (n, n))
  tile = np.tril(np.ones((block, block), bool))  # the diagonal's causal tile, [q, k]
  zeros = jnp.zeros((1, n, n), jnp.int32)  # every partial block is the one causal tile
  fwd = mi.MaskInfo(data_next=_carry_last_live(live, kv_index, 1)[None], mask_next=zeros,
                    block_mask=map_NxN[None], partial_mask_blocks=jnp.asarray(tile[None]),
                    q_sequence=None, is_dynamic_mask=False)
  dkv = mi.MaskInfo(data_next=_carry_last_live(live, q_index, 0)[None], mask_next=zeros,
                    block_mask=map_NxN[None], partial_mask_blocks=jnp.asarray(tile.T[None]),
                    q_sequence=None, is_dynamic_mask=False)
  return fwd, dkv


@functools.lru_cache(maxsize=8)
def _block_sizes(block: int):
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu import splash_attention as sa
  return sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                       block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                       use_fused_bwd_kernel=True)


def segment_splash(q_HxTxE: jax.Array, k_KxTxE: jax.Array, v_KxTxE: jax.Array,
                   segment_ids_T: jax.Array, block: int, interpret: bool) -> jax.Array:
  """One packed row through the splash kernel with its own block map; q pre-scaled."""
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  fwd, dkv = _mask_infos(block_map(segment_ids_T[None], block)[0], block)
  kernel = sk.SplashAttentionKernel(
      fwd, None, dkv, block_sizes=_block_sizes(block), is_mqa=False, save_residuals=False,
      mask_value=sk.DEFAULT_MASK_VALUE, attn_logits_soft_cap=None,
      residual_checkpoint_name="attention", mask_function=None, interpret=interpret)
  return kernel(q_HxTxE, k_KxTxE, v_KxTxE,
                segment_ids=sk.SegmentIds(segment_ids_T, segment_ids_T))
