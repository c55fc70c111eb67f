"""Decode attention over a paged KV cache (models/paged_kv.py), reading only live pages.

    o_NxHxE = paged_decode_attention(q_NxHxE, k_KxPxTxE, v_KxPxTxE, table_NxM, length_N,
                                     impl="auto")

One query token per slot over the first ``length[n]`` tokens of the pages ``table[n]``;
scores scaled by E**-0.5, softmax in fp32, head h = kv_head * G + g (as `decode_attention`).
``impl``:

* "xla": the pure-JAX reference, any backend. The live pages of all slots form one flat list;
  a `lax.fori_loop` walks it in blocks of pages with an online softmax per slot, its trip
  count ceil(live pages / block): the work grows with the live pages (sum of the slots'
  ceil(length / T)), not with the slots' capacity nor with the longest slot, and as the
  bound is a runtime value it runs inside the engine's compiled loop without a recompile per
  length (a static bucketed gather would need one program per bucket, or a `lax.switch` over
  all of them). Its online-softmax sums are scatter-adds: deterministic on CPU and TPU; XLA
  on GPU may add them in any order (use "pallas_gpu" there, the default).
* "pallas_tpu": `jax.experimental.pallas.ops.tpu.paged_attention` (this pool's layout).
* "pallas_gpu": `jax.experimental.pallas.ops.gpu.paged_attention` (this pool's layout).
* "ragged_tpu": `...ops.tpu.ragged_paged_attention` (JAX's tuned TPU kernel, vLLM-TPU's), which
  takes K and V interleaved in one [P, T, 2K, E] array: an engine that picks it keeps its pool
  in that layout from creation (`uses_combined_pool`, `PagedKVCache.combined`), so no call
  converts it. It only runs compiled by libtpu: its interpret mode fails on CPU in jax 0.10.2
  ("'ReshapeTransform' object has no attribute 'indices'"); the "xla" reference reads the
  combined layout too (pass ``v=None``), which is how CPU tests check that layout's plumbing.
* "auto": ragged_tpu on TPU, pallas_gpu on GPU, else xla. On TPU the ragged kernel reads a
  scanned model's stacked pool in place (its L x P pages as one pool, the layer as a page
  offset: `Attention.decode_paged`); "pallas_tpu" takes one layer's [K, P, T, E], which under
  scanned layers is a slice XLA copies for the call, one layer's pool per layer and step (the
  whole pool per decode step). "pallas_gpu" reads the stacked split pool in place too
  (`gpu_stacked_paged_attention`: its L x K x P pages as one pool, each (slot, KV head) a row of
  the kernel's batch). On TPU with a head_dim that is not a multiple of 128
  (Qwen2.5-0.5B's 64), xla: Mosaic tiles the TPU kernels' last dimension in lanes of 128 and
  refuses the block ("divisible by 8 and 128"). Asking for a TPU kernel with such a head_dim is
  an error naming the setting.

Under an activation mesh (the engine's), the kernels run per device in a `shard_map` over the
pools' shard axis and KV heads (`attend_shards`): a custom call is opaque to XLA's partitioner.

Inactive slots (length 0) give finite values that are never read.

8-bit pools (models/kv_quant.py: E + 4 entries per token and KV head, the scale last): "xla"
reads the values and scales in place (scales on the fp32 scores and on the probabilities).
The JAX kernels take scales in arrays of their own ("pallas_tpu": `QuantizedTensor` scales
broadcast over E; "pallas_gpu": [K, P, T]; "ragged_tpu": one scalar per pool), so for them the
pool is split (values, scales) or dequantized ("ragged_tpu") before the call: correct, but a
copy of the layer's pool per call, not yet the halved read (docs/kv_int8.md); so "auto" runs
"xla" over an 8-bit pool (`resolve_paged_impl`), and a kernel is used only when named.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from dapo_jax.infra import sharding as shd
from dapo_jax.models import attention, kv_quant
from dapo_jax.infra.profiling import scoped

PAGED_IMPLS = ("auto", "xla", "pallas_tpu", "pallas_gpu", "ragged_tpu")
# ragged_paged_attention's (KV pages, queries) per block where its tuned table has no entry for
# the device at hand (a compile-only TPU client reports a CPU device): the kernel's own default.
RAGGED_BLOCKS = (128, 32)
# What a ragged block may take of the 16 MiB of scoped VMEM Mosaic gives a kernel by default, in
# the model `ragged_blocks` uses: its KV pages, double-buffered, plus the fp32 scores of its
# queries (queries x query heads a KV head x the block's tokens). Fitted on libtpu 0.0.42.1 for
# v5p: estimated 13 MiB compiled (Qwen2.5-32B's shard at tensor 8, 128 pages), 16 MiB
# (Qwen3-32B's at tensor 8, 64 slots) and 20 MiB (Qwen3-8B's at tensor 4) did not
# (CompileTimeScopedVmemOom at 18.73 and 16.41 MiB); both fit at 64 pages.
RAGGED_BLOCK_BYTES = 14 * 2**20
BLOCK_TOKENS = 256  # tokens per kernel compute block (and per step of the reference off CPU)
BLOCK_TOKENS_CPU = 4096  # tokens per step of the reference loop on CPU
TPU_LANES = 128  # the TPU kernels' head_dim must be a multiple of this (Mosaic's lane width)


def _divisor_at_most(m: int, cap: int) -> int:
  return max(d for d in range(1, min(m, cap) + 1) if m % d == 0)


def resolve_paged_impl(impl: str, platform: str | None = None, head_dim: int | None = None,
                       dtype=None) -> str:
  """The kernel ``impl`` means on ``platform`` (default: the one being compiled for) for heads
  of ``head_dim`` (None: not known here, the TPU kernels assumed to fit) over a pool of
  ``dtype`` (None: not known). A TPU kernel named for a head_dim it cannot tile is an error
  when compiling for a TPU. "auto" over an 8-bit pool is "xla", which reads its pages and
  scales in place: the kernels would have the layer's pool split or dequantized for every call
  (module docstring; a compiled TPU chunk's temporaries came to 4-5x the int8 pool)."""
  if impl not in PAGED_IMPLS:
    raise ValueError(f"paged attention impl={impl!r}; choose one of {PAGED_IMPLS}.")
  platform = platform or attention._backend()  # pylint: disable=protected-access
  lanes_ok = head_dim is None or head_dim % TPU_LANES == 0
  if impl in ("pallas_tpu", "ragged_tpu") and not lanes_ok and platform == "tpu":
    raise ValueError(f"rollout.attention_impl={impl!r} needs a head_dim that is a multiple of "
                     f"{TPU_LANES} (Mosaic's lane width); this model's is {head_dim}. Use "
                     "'auto' (the XLA paged path there) or 'xla'.")
  if impl != "auto":
    return impl
  if dtype is not None and kv_quant.is_quantized(dtype):
    return "xla"
  if platform == "tpu" and not lanes_ok:
    return "xla"
  return {"tpu": "ragged_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu"}.get(platform, "xla")


def uses_combined_pool(impl: str, platform: str | None = None, dtype=None) -> bool:
  """Whether the pool for `impl` (over a pool of `dtype`) is kept in the combined [P, T, 2K, E]
  layout."""
  return resolve_paged_impl(impl, platform, dtype=dtype) == "ragged_tpu"


def block_pages(page_size: int, platform: str | None = None) -> int:
  """Default pages per step of the reference loop: `BLOCK_TOKENS_CPU` tokens on CPU (the
  per-step overhead (a while-loop trip, three scatters of the [N, H] softmax state) is paid
  per block, the gather is not), `BLOCK_TOKENS` elsewhere."""
  platform = platform or attention._backend()  # pylint: disable=protected-access
  return max(1, (BLOCK_TOKENS_CPU if platform == "cpu" else BLOCK_TOKENS) // page_size)


@scoped("attention_core")
def reference_paged_attention(q_NxHxE: jax.Array, k_KxPxTxE: jax.Array, v_KxPxTxE: jax.Array,
                              table_NxM: jax.Array, length_N: jax.Array, *,
                              pages_per_block: int | None = None) -> jax.Array:
  """The "xla" path (module docstring); dtypes as `attention.decode_attention`: q·k and p·v in
  the query dtype with fp32 accumulation, softmax statistics in fp32.

  The live pages of all slots, in slot order, form one flat list of `sum(ceil(length / T))`
  pages (slot n owns entries start[n] .. end[n]); the loop walks it in blocks of
  `pages_per_block` (default `block_pages`), then the remainder in blocks of an eighth of that,
  so at most that eighth is padding. Per block: the pages are gathered and brought to
  [B, K, T, E] (the operand layout of the batched q·k and p·v) with their slot's query, and the
  online-softmax state of each slot is updated by scatters over the block's slot ids (max,
  then sums). Work and temporaries grow with the live pages, not with slots x capacity or with
  the longest slot."""
  n, h, e = q_NxHxE.shape
  combined = v_KxPxTxE is None  # k_KxPxTxE is then the combined [P, T, 2K, E] pool
  kh, t = ((k_KxPxTxE.shape[2] // 2, k_KxPxTxE.shape[1]) if combined
           else (k_KxPxTxE.shape[0], k_KxPxTxE.shape[2]))
  m, g = table_NxM.shape[1], h // kh
  big = min(pages_per_block or block_pages(t), n * m)  # more than every slot's pages: padding
  small = max(1, big // 8)
  dtype = q_NxHxE.dtype
  quantized = kv_quant.is_quantized(k_KxPxTxE.dtype)
  low = jnp.finfo(jnp.float32).min
  q_NxKxGxE = q_NxHxE.reshape(n, kh, g, e)
  pages_N = jnp.clip(-(-length_N // t), 0, m).astype(jnp.int32)
  end_N = jnp.cumsum(pages_N)
  start_N, total = end_N - pages_N, end_N[-1]
  get = lambda x, i: x.at[i].get(mode="promise_in_bounds")  # indices below are in range

  def block(first, b, carry):
    """Flat pages first .. first + b - 1 into the running (max, sum, acc) of their slots."""
    m_NxKxG, l_NxKxG, acc_NxKxGxE = carry
    j_B = first + jnp.arange(b, dtype=jnp.int32)
    slot_B = jnp.minimum((j_B[:, None] >= end_N[None]).sum(-1, dtype=jnp.int32), n - 1)
    col_B = jnp.clip(j_B - get(start_N, slot_B), 0, m - 1)
    page_B = jnp.maximum(get(table_NxM, (slot_B, col_B)), 0)
    to_B = jnp.where(j_B < total, slot_B, n)  # past the list: index n, dropped by the scatters
    # Gathered along the pool's own page axis, then the small block transposed: moving the
    # pool's page axis first makes XLA CPU copy the whole pool per block once the pool is a
    # loop carry (the engine's; see the memory test in tests/test_paged_kv.py).
    cast = (lambda x: x) if quantized else (lambda x: x.astype(dtype))
    if combined:  # [B, T, 2K, E] gathered, K and V split out of the small block
      kv_BxTx2KxE = cast(k_KxPxTxE.at[page_B].get(mode="promise_in_bounds"))
      k_BxKxTxE = kv_BxTx2KxE[:, :, 0::2].transpose(0, 2, 1, 3)
      v_BxKxTxE = kv_BxTx2KxE[:, :, 1::2].transpose(0, 2, 1, 3)
    else:
      k_BxKxTxE = cast(jnp.moveaxis(k_KxPxTxE.at[:, page_B].get(mode="promise_in_bounds"), 0, 1))
      v_BxKxTxE = cast(jnp.moveaxis(v_KxPxTxE.at[:, page_B].get(mode="promise_in_bounds"), 0, 1))
    if quantized:  # values into the matmuls, scales on the scores and the probabilities
      (k_BxKxTxE, k_scale_BxKxTx1), (v_BxKxTxE, v_scale_BxKxTx1) = (
          kv_quant.split(k_BxKxTxE), kv_quant.split(v_BxKxTxE))
      k_BxKxTxE, v_BxKxTxE = k_BxKxTxE.astype(dtype), v_BxKxTxE.astype(dtype)
    s_BxKxGxT = jnp.einsum("bkge,bkte->bkgt", get(q_NxKxGxE, slot_B), k_BxKxTxE,
                           preferred_element_type=jnp.float32) * (e ** -0.5)
    if quantized:
      s_BxKxGxT = s_BxKxGxT * jnp.swapaxes(k_scale_BxKxTx1, -1, -2)
    # Tokens past the slot's length masked; entries past the list need no mask (dropped below).
    live_BxT = col_B[:, None] * t + jnp.arange(t)[None] < get(length_N, slot_B)[:, None]
    s_BxKxGxT = jnp.where(live_BxT[:, None, None], s_BxKxGxT, low)
    # Every listed page holds a live token, so each touched slot's new max is a real score.
    m_new = m_NxKxG.at[to_B].max(s_BxKxGxT.max(-1), mode="drop")
    alpha = jnp.exp(m_NxKxG - m_new)
    p_BxKxGxT = jnp.exp(s_BxKxGxT - get(m_new, slot_B)[..., None])
    pv_p = p_BxKxGxT * jnp.swapaxes(v_scale_BxKxTx1, -1, -2) if quantized else p_BxKxGxT
    pv = jnp.einsum("bkgt,bkte->bkge", pv_p.astype(dtype), v_BxKxTxE,
                    preferred_element_type=jnp.float32)
    return (m_new, (alpha * l_NxKxG).at[to_B].add(p_BxKxGxT.sum(-1), mode="drop"),
            (alpha[..., None] * acc_NxKxGxE).at[to_B].add(pv, mode="drop"))

  carry = (jnp.full((n, kh, g), low, jnp.float32), jnp.zeros((n, kh, g), jnp.float32),
           jnp.zeros((n, kh, g, e), jnp.float32))
  full = total // big
  carry = jax.lax.fori_loop(0, full, lambda i, c: block(i * big, big, c), carry)
  rest = -(-(total - full * big) // small)
  _, l_NxKxG, acc = jax.lax.fori_loop(
      0, rest, lambda i, c: block(full * big + i * small, small, c), carry)
  out = acc / jnp.maximum(l_NxKxG, jnp.finfo(jnp.float32).tiny)[..., None]
  return out.astype(dtype).reshape(n, h, e)


def _kernel_args(q_NxHxE, table_NxM, length_N):
  # The kernels take q unscaled (no sm_scale argument), in-range page ids everywhere, and at
  # least one token (a length-0 slot would leave its output unwritten).
  e = q_NxHxE.shape[-1]
  q = (q_NxHxE.astype(jnp.float32) * (e ** -0.5)).astype(q_NxHxE.dtype)
  return q, jnp.maximum(table_NxM, 0), jnp.maximum(length_N, 1).astype(jnp.int32)


def tpu_paged_attention(q_NxHxE, k_KxPxTxE, v_KxPxTxE, table_NxM, length_N, *,
                        interpret: bool | None = None):
  """`jax.experimental.pallas.ops.tpu.paged_attention`; in Pallas TPU interpret mode under
  `attention.interpret_pallas()` (tests on CPU). Its matmuls run at the TPU's DEFAULT precision
  (one bf16 pass, emulated so in interpret mode too), so fp32 inputs agree with the reference
  to bf16 rounding, not to fp32 rounding."""
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental.pallas import tpu as pltpu
  from jax.experimental.pallas.ops.tpu import paged_attention as tpu_pa
  interpret = attention._INTERPRET.get() if interpret is None else interpret  # pylint: disable=protected-access
  from jax.experimental.pallas.ops.tpu.paged_attention import quantization_utils as tpu_quant
  q, table, length = _kernel_args(q_NxHxE, table_NxM, length_N)
  t = k_KxPxTxE.shape[2]
  ppcb = _divisor_at_most(table.shape[1], max(1, BLOCK_TOKENS // t))
  k_pages, v_pages = k_KxPxTxE, v_KxPxTxE
  if kv_quant.is_quantized(k_KxPxTxE.dtype):
    # The kernel's QuantizedTensor: values and absmax-style scales [K, P, T, 1] (it dequantizes
    # as x * h / 127.5, so h = scale * 127.5), broadcast by the kernel over E.
    as_kernel = lambda vals, scale: tpu_quant.QuantizedTensor(vals, scale * tpu_quant.MAX_INT8)
    k_pages, v_pages = as_kernel(*kv_quant.split(k_KxPxTxE)), as_kernel(*kv_quant.split(v_KxPxTxE))
  run = lambda: tpu_pa.paged_attention(q, k_pages, v_pages, length, table,
                                       pages_per_compute_block=ppcb)
  if interpret:
    with pltpu.force_tpu_interpret_mode():
      return run()
  return run()


def gpu_paged_attention(q_NxHxE, k_KxPxTxE, v_KxPxTxE, table_NxM, length_N, *,
                        interpret: bool | None = None):
  """`jax.experimental.pallas.ops.gpu.paged_attention` (Triton); `interpret=True` (or
  `attention.interpret_pallas()`) runs it through the Pallas interpreter on any backend."""
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental.pallas.ops.gpu import paged_attention as gpu_pa
  interpret = attention._INTERPRET.get() if interpret is None else interpret  # pylint: disable=protected-access
  q, table, length = _kernel_args(q_NxHxE, table_NxM, length_N)
  m, t = table.shape[1], k_KxPxTxE.shape[2]
  k_splits = _divisor_at_most(m, 16)
  ppcb = _divisor_at_most(m // k_splits, max(1, BLOCK_TOKENS // t))
  scales = {}
  if kv_quant.is_quantized(k_KxPxTxE.dtype):  # the kernel's scales: [K, P, T] per token
    (k_KxPxTxE, k_scale), (v_KxPxTxE, v_scale) = (kv_quant.split(k_KxPxTxE),
                                                  kv_quant.split(v_KxPxTxE))
    scales = dict(k_scales_pages=k_scale[..., 0], v_scales_pages=v_scale[..., 0])
  return gpu_pa.paged_attention(q, k_KxPxTxE, v_KxPxTxE, table, length,
                                k_splits=k_splits, pages_per_compute_block=ppcb,
                                interpret=interpret, **scales)


def gpu_stacked_paged_attention(q_NxHxE, k_LxKxPxTxE, v_LxKxPxTxE, table_NxM, length_N,
                                layer, *, interpret: bool | None = None):
  """`gpu_paged_attention` on layer ``layer`` of a stacked [L, K, P, T, E] pool, read in place.

  A layer's [K, P, T, E] slice of the stacked pool is an operand XLA copies for the kernel call
  (one layer's K and V per layer and decode step under scanned layers: the whole pool per step).
  Instead the pool is read as one pool of L x K x P pages (a reshape of its major axes, a
  bitcast), each (slot, KV head) pair as a row of the kernel's batch with that head's G query
  heads, and its pages at (layer x K + k) x P + page. The kernel indexes with 64 bits once an
  operand passes 4 GiB (Pallas' Triton lowering), so the stacked pool's size is no limit."""
  n, h, e = q_NxHxE.shape
  num_layers, kh, p, t, _ = k_LxKxPxTxE.shape
  m = table_NxM.shape[1]
  flat = lambda pool: pool.reshape(1, num_layers * kh * p, t, pool.shape[-1])  # 8-bit: E + 4
  offset_K = (layer * kh + jnp.arange(kh, dtype=jnp.int32)) * p
  table_RxM = (jnp.maximum(table_NxM, 0)[:, None, :] + offset_K[None, :, None]).reshape(n * kh, m)
  out = gpu_paged_attention(q_NxHxE.reshape(n * kh, h // kh, e), flat(k_LxKxPxTxE),
                            flat(v_LxKxPxTxE), table_RxM, jnp.repeat(length_N, kh),
                            interpret=interpret)
  return out.reshape(n, h, e)


def combine_kv(k_KxPxTxE: jax.Array, v_KxPxTxE: jax.Array) -> jax.Array:
  """The ragged kernel's layout: [P, T, 2K, E], K and V of kv head k at 2k and 2k + 1."""
  kh, p, t, e = k_KxPxTxE.shape
  return jnp.stack([k_KxPxTxE, v_KxPxTxE], axis=1).transpose(2, 3, 0, 1, 4).reshape(
      p, t, 2 * kh, e)


def ragged_blocks(q_NxHxE, kv_PxTx2KxE, pages_per_seq: int, num_slots: int) -> tuple[int, int]:
  """(KV pages, queries) per block of `ragged_paged_attention` where its tuned table does not
  apply: the kernel's default (RAGGED_BLOCKS) capped by the sequence's pages and the slots, then
  halved until the block's estimate (RAGGED_BLOCK_BYTES) fits, at the heads per block the kernel
  picks."""
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import get_min_heads_per_blk
  _, page_size, combined, head_dim = kv_PxTx2KxE.shape
  q_heads = q_NxHxE.shape[1]
  _, kv_heads_per_block = get_min_heads_per_blk(q_heads, combined, q_NxHxE.dtype,
                                                kv_PxTx2KxE.dtype)
  queries = min(num_slots, RAGGED_BLOCKS[1])
  ratio = q_heads // (combined // 2)  # query heads a KV head
  page_bytes = (2 * page_size * kv_heads_per_block * head_dim
                * jnp.dtype(kv_PxTx2KxE.dtype).itemsize  # KV, double-buffered
                + queries * ratio * page_size * 4)  # fp32 scores
  pages = min(pages_per_seq, RAGGED_BLOCKS[0])
  while pages > 1 and pages * page_bytes > RAGGED_BLOCK_BYTES:
    pages //= 2
  return pages, queries


def ragged_tpu_attention(q_NxHxE: jax.Array, kv_PxTx2KxE: jax.Array, table_NxM: jax.Array,
                         length_N: jax.Array) -> jax.Array:
  """One decode token per slot through `...ops.tpu.ragged_paged_attention` (libtpu only)."""
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes
  n, _, e = q_NxHxE.shape
  _, table, length = _kernel_args(q_NxHxE, table_NxM, length_N)
  # An 8-bit pool dequantized for the kernel, which takes one scale per pool (a copy).
  kv_PxTx2KxE = kv_quant.decode(kv_PxTx2KxE, q_NxHxE.dtype)
  cu_q_lens = jnp.arange(n + 1, dtype=jnp.int32)  # one query token per slot
  if tuned_block_sizes.get_tpu_version() >= 4:  # on a TPU: its tuned table
    pages, queries = None, None
  else:  # compiling for a TPU from another host: the kernel's untuned default, capped as it
    # does, with no more pages a block than fit the scoped VMEM (RAGGED_BLOCK_BYTES)
    pages, queries = ragged_blocks(q_NxHxE, kv_PxTx2KxE, table.shape[1], n)
  return ragged_paged_attention(q_NxHxE, kv_PxTx2KxE, length, table, cu_q_lens,
                                jnp.array([n], jnp.int32), sm_scale=e ** -0.5,
                                num_kv_pages_per_block=pages, num_queries_per_block=queries)


def paged_decode_attention(q_NxHxE: jax.Array, k_KxPxTxE: jax.Array, v_KxPxTxE: jax.Array,
                           table_NxM: jax.Array, length_N: jax.Array, *,
                           impl: str = "auto", layer: jax.Array | None = None) -> jax.Array:
  """Decode attention over live pages with `impl` (module docstring); output like q.
  ``v_KxPxTxE`` None: ``k_KxPxTxE`` is a combined [P, T, 2K, E] pool ("ragged_tpu", "xla").
  ``layer``: k and v are stacked split [L, K, P, T, E] pools and this layer is read ("pallas_gpu"
  in place, `gpu_stacked_paged_attention`; the others from the layer's slice)."""
  impl = resolve_paged_impl(impl, head_dim=q_NxHxE.shape[-1], dtype=k_KxPxTxE.dtype)
  if layer is not None:
    if impl == "pallas_gpu":
      return gpu_stacked_paged_attention(q_NxHxE, k_KxPxTxE, v_KxPxTxE, table_NxM, length_N,
                                         layer).astype(q_NxHxE.dtype)
    k_KxPxTxE, v_KxPxTxE = k_KxPxTxE[layer], v_KxPxTxE[layer]
  if (v_KxPxTxE is None) != (impl == "ragged_tpu") and impl != "xla":
    raise ValueError(f"paged attention impl={impl!r} takes "
                     f"{'a combined' if impl == 'ragged_tpu' else 'split K and V'} pool; the "
                     "pool's layout comes from the same impl (`uses_combined_pool`).")
  if impl == "ragged_tpu":
    return ragged_tpu_attention(q_NxHxE, k_KxPxTxE, table_NxM, length_N).astype(q_NxHxE.dtype)
  fn = {"xla": reference_paged_attention, "pallas_tpu": tpu_paged_attention,
        "pallas_gpu": gpu_paged_attention}[impl]
  return fn(q_NxHxE, k_KxPxTxE, v_KxPxTxE, table_NxM, length_N).astype(q_NxHxE.dtype)


def attend_shards(q_SxNxHxE: jax.Array, k_pool: jax.Array, v_pool: jax.Array | None,
                  table_SxNxM: jax.Array, length_SxN: jax.Array, *, impl: str = "auto",
                  layer: jax.Array | None = None) -> jax.Array:
  """`paged_decode_attention` on each of S shards' pools (leading axis S on every argument;
  with ``layer``, stacked split pools [S, L, K, P, T, E]).

  The reference is vmapped over S and left to XLA's partitioner. A kernel (a custom call XLA
  cannot partition: it would gather every operand, the whole pool included) runs under the
  active activation mesh in a `shard_map`: shards over the batch axes, KV heads (and their
  query heads) over `tensor` when both divide; a stacked pool goes in whole, so that each
  device reads its own [L, K/tensor, P, T, E] in place."""
  impl = resolve_paged_impl(impl, head_dim=q_SxNxHxE.shape[-1], dtype=k_pool.dtype)
  stacked = layer is not None
  attend = lambda q, k, v, table, length: paged_decode_attention(q, k, v, table, length,
                                                                 impl=impl, layer=layer)
  ctx = shd._ACTIVATION_CTX.get()  # pylint: disable=protected-access
  if impl == "xla" or ctx is None or ctx.mesh.size == 1:
    return jax.vmap(attend)(q_SxNxHxE, k_pool, v_pool, table_SxNxM, length_SxN)
  s, _, h, _ = q_SxNxHxE.shape
  kh = k_pool.shape[-2] // 2 if v_pool is None else k_pool.shape[1 + stacked]
  spec = lambda names, shape: shd.logical_to_spec(names, ctx.rules, shape, ctx.mesh)[0]
  batch, heads = spec(("batch",), (s,)), spec(("act_heads",), (h,))
  if heads != spec(("act_heads",), (kh,)):
    heads = None  # heads split only where whole query groups stay with their KV head
  q_spec = PartitionSpec(batch, None, heads, None)
  pool_spec = (PartitionSpec(batch, None, None, heads, None) if v_pool is None
               else PartitionSpec(batch, *((None,) * stacked), heads, None, None, None))

  def local(q, table, length, at, k, v=None):  # one device's shards (one, on the engine's mesh)
    one = lambda q, k, v, table, length: paged_decode_attention(
        q, k, v, table, length, impl=impl, layer=at if stacked else None)
    if q.shape[0] == 1:
      first = lambda x: None if x is None else x[0]
      return one(*map(first, (q, k, v, table, length)))[None]
    return jax.vmap(one)(q, k, v, table, length)

  pools = (k_pool,) if v_pool is None else (k_pool, v_pool)
  at = jnp.asarray(0 if layer is None else layer, jnp.int32)  # replicated
  return jax.shard_map(local, mesh=ctx.mesh,
                       in_specs=(q_spec, PartitionSpec(batch, None, None),
                                 PartitionSpec(batch, None), PartitionSpec())
                       + (pool_spec,) * len(pools),
                       out_specs=q_spec, check_vma=False)(
                           q_SxNxHxE, table_SxNxM, length_SxN, at, *pools)
