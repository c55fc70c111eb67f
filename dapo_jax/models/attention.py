"""Attention kernels chosen by platform, with the plain XLA einsum path as the reference.

    out_BxTxHxE = dot_product_attention(q, k, v, mask, impl="auto")

``impl`` names the kernel of a full-sequence pass (training, prefill: T == S, query t at key
slot t): "xla" (two einsums, any backend), "cudnn" (cuDNN flash attention through
``jax.nn.dot_product_attention``; NVIDIA GPUs, bf16/fp16), "splash" (the Pallas TPU splash kernel,
``jax.experimental.pallas.ops.tpu.splash_attention``) or "auto" (cudnn on GPU, splash on TPU where
the shapes allow, else xla). A one-token step over the KV cache is bandwidth-bound and always takes
the einsum path (``decode_attention``), whatever ``impl`` says; over an 8-bit cache it applies the
per-token scales to the scores and probabilities (models/kv_quant.py).

Fully masked query rows (left-padding queries) give finite values that are never used.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from dapo_jax.infra import sharding as shd
from dapo_jax.models import kv_quant, segment_attention
from dapo_jax.models.config import ATTENTION_IMPLS as IMPLS
from dapo_jax.infra.profiling import scoped

_SPLASH_BLOCKS = (512, 256, 128)  # splash tiles: the largest that divides the sequence
_INTERPRET = contextvars.ContextVar("dapo_jax_pallas_interpret", default=False)
_TARGET_PLATFORM = contextvars.ContextVar("dapo_jax_target_platform", default=None)


@flax.struct.dataclass
class Mask:
  """Which keys each query attends to.

  ``dense_BxTxS`` is the full boolean mask (True = attend). When ``causal`` is set, it is exactly
  ``tril(T, S) & key_valid_BxS[:, None, :]`` with T == S: the structure the fused kernels take
  (a causal kernel plus per-token segment ids or a bias), so they never read the dense mask.
  ``segment_ids_BxS`` (packed rows, trainer/packing.py): a query attends only to keys of its own
  segment, ``tril & (seg_q == seg_k) & (seg_k > 0)``; segment 0 is padding.
  """
  dense_BxTxS: jax.Array
  key_valid_BxS: jax.Array
  causal: bool = flax.struct.field(pytree_node=False, default=False)
  segment_ids_BxS: jax.Array | None = None


def causal_mask(key_valid_BxT: jax.Array, segment_ids_BxT: jax.Array | None = None) -> Mask:
  """The causal Mask of a full pass (query t at key slot t) over rows whose real tokens are
  ``key_valid``; with ``segment_ids`` (packed rows) each segment attends within itself only."""
  t = key_valid_BxT.shape[1]
  dense_BxTxT = (jnp.arange(t)[None, None, :] <= jnp.arange(t)[None, :, None]) & (
      key_valid_BxT[:, None, :])
  if segment_ids_BxT is not None:
    dense_BxTxT &= segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]
  return Mask(dense_BxTxT, key_valid_BxT, causal=True, segment_ids_BxS=segment_ids_BxT)


@contextlib.contextmanager
def compile_for(platform: str | None):
  """Picks kernels for `platform` ("tpu", "gpu", "cpu") instead of the default backend.

  For ahead-of-time compiles on another platform's devices (`dapo-plan` compiles TPU programs
  with libtpu on a CPU host): "auto" then resolves as it would on that platform, and the fused
  kernels' backend checks accept it.
  """
  token = _TARGET_PLATFORM.set(platform)
  try:
    yield
  finally:
    _TARGET_PLATFORM.reset(token)


def _backend() -> str:
  return _TARGET_PLATFORM.get() or jax.default_backend()


@contextlib.contextmanager
def interpret_pallas():
  """Runs the Pallas kernels (splash) in interpret mode, so tests can run them on CPU."""
  token = _INTERPRET.set(True)
  try:
    yield
  finally:
    _INTERPRET.reset(token)


def _splash_block(seq_len: int | None) -> int | None:
  return next((b for b in _SPLASH_BLOCKS if seq_len and seq_len % b == 0), None)


def _cudnn_fits(dtype, seq_len: int | None, head_dim: int | None) -> bool:
  """cuDNN flash attention: bf16/fp16, head dim a multiple of 8 (<= 128), even length."""
  return (dtype is not None and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
          and (head_dim is None or (head_dim % 8 == 0 and head_dim <= 128))
          and (seq_len is None or seq_len % 2 == 0))


def resolve_impl(impl: str, *, platform: str | None = None, dtype=None,
                 seq_len: int | None = None, head_dim: int | None = None) -> str:
  """The kernel a full-sequence pass uses: an explicit name as given, "auto" by platform."""
  if impl not in IMPLS:
    raise ValueError(f"attention_impl={impl!r}; choose one of {IMPLS}.")
  if impl != "auto":
    return impl
  platform = platform or _backend()
  if platform in ("gpu", "cuda") and _cudnn_fits(dtype, seq_len, head_dim):
    return "cudnn"
  if platform == "tpu" and _splash_block(seq_len):
    return "splash"
  return "xla"


@scoped("attention_core")
def xla_attention(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask_BxTxS):
  """Grouped-query attention as two einsums; scores and softmax in fp32."""
  b, t, h, e = q_BxTxHxE.shape
  k = k_BxSxKxE.shape[2]
  q = q_BxTxHxE.reshape(b, t, k, h // k, e)
  s_BxKxGxTxS = jnp.einsum("btkge,bske->bkgts", q, k_BxSxKxE,
                           preferred_element_type=jnp.float32) * (e ** -0.5)
  s_BxKxGxTxS = jnp.where(mask_BxTxS[:, None, None], s_BxKxGxTxS, jnp.finfo(jnp.float32).min)
  p = jax.nn.softmax(s_BxKxGxTxS, axis=-1).astype(v_BxSxKxE.dtype)
  out = jnp.einsum("bkgts,bske->btkge", p, v_BxSxKxE)
  return out.reshape(b, t, h, e)


@scoped("attention_core")
def decode_attention(q_NxHxE: jax.Array, k_NxKxExS: jax.Array, v_NxKxSxE: jax.Array,
                     valid_NxS: jax.Array) -> jax.Array:
  """One query token per row over a ``KVCache`` layer (see models/kv_cache.py).

  Both products are batched matmuls over (N, K) that read the cache where it lies (no
  transpose); scores and softmax in fp32, as in `xla_attention` (head = kv_head * G + g).
  """
  n, h, e = q_NxHxE.shape
  kh = k_NxKxExS.shape[1]
  dtype = q_NxHxE.dtype
  q_NxKxGxE = q_NxHxE.reshape(n, kh, h // kh, e)
  if kv_quant.is_quantized(k_NxKxExS.dtype):
    return _decode_attention_8bit(q_NxKxGxE, k_NxKxExS, v_NxKxSxE, valid_NxS).reshape(n, h, e)
  s_NxKxGxS = jnp.einsum("nkge,nkes->nkgs", q_NxKxGxE, k_NxKxExS.astype(dtype),
                         preferred_element_type=jnp.float32) * (e ** -0.5)
  s_NxKxGxS = jnp.where(valid_NxS[:, None, None], s_NxKxGxS, jnp.finfo(jnp.float32).min)
  p_NxKxGxS = jax.nn.softmax(s_NxKxGxS, axis=-1).astype(dtype)
  o_NxKxGxE = jnp.einsum("nkgs,nkse->nkge", p_NxKxGxS, v_NxKxSxE.astype(dtype))
  return o_NxKxGxE.reshape(n, h, e)


def _decode_attention_8bit(q_NxKxGxE, k_NxKxE4xS, v_NxKxSxE4, valid_NxS):
  """`decode_attention` over an 8-bit cache (models/kv_quant.py): the int8 / e4m3 values go
  into the matmuls in the query dtype (exact: |q| <= 127 or an e4m3 value), each key's scale
  multiplies its fp32 score and each value's scale its probability, so no dequantized copy of
  the cache is formed."""
  dtype, e = q_NxKxGxE.dtype, q_NxKxGxE.shape[-1]
  k_vals, k_scale_NxKx1xS = kv_quant.split(k_NxKxE4xS, -2)
  v_vals, v_scale_NxKxSx1 = kv_quant.split(v_NxKxSxE4, -1)
  s_NxKxGxS = jnp.einsum("nkge,nkes->nkgs", q_NxKxGxE, k_vals.astype(dtype),
                         preferred_element_type=jnp.float32) * (k_scale_NxKx1xS * e ** -0.5)
  s_NxKxGxS = jnp.where(valid_NxS[:, None, None], s_NxKxGxS, jnp.finfo(jnp.float32).min)
  p_NxKxGxS = jax.nn.softmax(s_NxKxGxS, axis=-1) * jnp.swapaxes(v_scale_NxKxSx1, -1, -2)
  return jnp.einsum("nkgs,nkse->nkge", p_NxKxGxS.astype(dtype), v_vals.astype(dtype),
                    preferred_element_type=jnp.float32).astype(dtype)


def cudnn_attention(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask: Mask):
  """cuDNN flash attention; the causal flag lets it skip the blocks above the diagonal."""
  if _backend() != "gpu":
    raise RuntimeError(f"attention_impl='cudnn' needs an NVIDIA GPU, but the backend is "
                       f"{_backend()!r}; use 'auto' or 'xla'.")
  if jnp.dtype(q_BxTxHxE.dtype) not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"attention_impl='cudnn' needs bf16/fp16 compute, got {q_BxTxHxE.dtype}; "
                     f"set model.dtype='bfloat16' or use 'auto'.")
  if not mask.causal:  # `dot_product_attention` sends only causal masks to a fused kernel
    raise ValueError("cudnn_attention takes a causal Mask; a dense one goes to xla_attention.")
  # cuDNN's causal mask, and the padding (cuDNN has no left-padding mask type) as a bias
  # built from the keys' validity alone. cuDNN takes a bias of [B, 1, T, S], so that one array
  # is materialised; built from the dense mask it cost three more [T, T] arrays a row (int32
  # positions, their comparison and the mask): 0.47 GiB more temporaries a GPU in the 32B's
  # train step at 22,528 tokens (docs/planning.md).
  return jax.nn.dot_product_attention(
      q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, bias=padding_bias(mask, q_BxTxHxE.shape[1],
                                                          q_BxTxHxE.dtype),
      is_causal=True, implementation="cudnn")


def padding_bias(mask: Mask, num_queries: int, dtype) -> jax.Array:
  """[B, 1, T, S]: 0 where the key is real, a large negative number at padding keys (finite, as
  jax.nn's masks), the same for every query. Packed rows (``mask.segment_ids_BxS``): 0 where
  the key is real and of the query's segment; a padding query (segment 0) sees padding keys, so
  its row is finite. The same one [B, 1, T, S] array either way.

  jax 0.10.2's public `jax.nn.dot_product_attention` takes no segments; cuDNN's packed form
  (q/kv offsets) is reachable only through jax._src, and is not used: a packed row on GPU
  still computes its whole causal square (the TPU kernel skips: models/segment_attention.py)."""
  neg = jnp.asarray(0.7 * jnp.finfo(dtype).min, dtype)
  zero = jnp.asarray(0, dtype)
  seg = mask.segment_ids_BxS
  if seg is not None:
    return jnp.where(seg[:, None, :num_queries, None] == seg[:, None, None, :], zero, neg)
  key_bias_BxS = jnp.where(mask.key_valid_BxS, zero, neg)
  b, s = key_bias_BxS.shape
  return jnp.broadcast_to(key_bias_BxS[:, None, None, :], (b, 1, num_queries, s))


@functools.lru_cache(maxsize=32)
def _splash_kernel(seq_len: int, num_heads: int, block: int, interpret: bool):
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu import splash_attention as sa
  sizes = sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                        use_fused_bwd_kernel=True)
  mask = sa.MultiHeadMask([sa.CausalMask((seq_len, seq_len))] * num_heads)
  # Concrete mask tables even when first built inside a trace, so the cache holds no tracer.
  # Residuals named "attention", so a remat policy can keep them (see qwen2.REMAT_POLICIES).
  with jax.ensure_compile_time_eval():
    return sa.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                              residual_checkpoint_name="attention", interpret=interpret)


def _batch_divides_its_mesh_axes(b: int) -> bool:
  """Whether the mesh axes the activation rules put the batch on divide ``b`` (True without an
  activation mesh)."""
  ctx = shd._ACTIVATION_CTX.get()  # pylint: disable=protected-access
  if ctx is None or ctx.mesh.size == 1:
    return True
  axes = shd.logical_to_spec(("batch",), ctx.rules, None, ctx.mesh)[0]
  axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
  return b % math.prod(ctx.mesh.shape[a] for a in axes) == 0


def _head_and_batch_specs(b: int, h: int, kh: int):
  """shard_map specs of [B, heads, L, E] under the active activation mesh, or None without one.

  Heads split over the tensor axis only when both H and K divide, so each shard keeps whole
  query groups with their kv head.
  """
  ctx = shd._ACTIVATION_CTX.get()  # pylint: disable=protected-access
  if ctx is None or ctx.mesh.size == 1:
    return None
  batch = shd.logical_to_spec(("batch",), ctx.rules, (b,), ctx.mesh)[0]
  heads = shd.logical_to_spec(("act_heads",), ctx.rules, (h,), ctx.mesh)[0]
  kv_heads = shd.logical_to_spec(("act_heads",), ctx.rules, (kh,), ctx.mesh)[0]
  if kv_heads != heads:
    heads = None
  return ctx.mesh, PartitionSpec(batch, heads, None, None), PartitionSpec(batch, None)


def splash_attention(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, segment_ids_BxS, *,
                     interpret: bool | None = None, skip_blocks: bool = False):
  """Causal GQA through the Pallas TPU splash kernel. ``segment_ids_BxS`` int: 0 at padding,
  the row's segment (1 for an unpacked row, 1.. for packed sequences) at real tokens; a bool
  key-validity mask is read as segments 0 / 1. ``skip_blocks`` (packed rows): each row's own
  block map, so blocks across two segments are not computed (models/segment_attention.py).

  A padding query attends to padding keys only: finite, and never read.
  """
  interpret = _INTERPRET.get() if interpret is None else interpret
  b, t, h, e = q_BxTxHxE.shape
  kh = k_BxSxKxE.shape[2]
  if not interpret and _backend() != "tpu":
    raise RuntimeError(f"attention_impl='splash' is a TPU kernel, but the backend is "
                       f"{_backend()!r}; use 'auto' or 'xla' (tests: interpret_pallas).")
  block = _splash_block(t)
  if block is None or k_BxSxKxE.shape[1] != t:
    raise ValueError(f"attention_impl='splash' needs T == S, a multiple of 128; got T={t}, "
                     f"S={k_BxSxKxE.shape[1]}. Use 'auto' to fall back to 'xla' there.")
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds
  # Splash does not scale the scores: scale q first (as MaxText does).
  q_BxHxTxE = (q_BxTxHxE * (e ** -0.5)).astype(q_BxTxHxE.dtype).transpose(0, 2, 1, 3)
  k_BxKxSxE, v_BxKxSxE = (x.transpose(0, 2, 1, 3) for x in (k_BxSxKxE, v_BxSxKxE))
  seg_BxS = segment_ids_BxS.astype(jnp.int32)
  specs = _head_and_batch_specs(b, h, kh)

  def run(q, k, v, seg):
    if skip_blocks:
      return jax.vmap(functools.partial(segment_attention.segment_splash, block=block,
                                        interpret=interpret))(q, k, v, seg)
    kernel = _splash_kernel(t, q.shape[1], block, interpret)
    return jax.vmap(lambda *a: kernel(*a[:3], segment_ids=SegmentIds(a[3], a[3])))(q, k, v, seg)

  if specs is not None:
    mesh, heads_spec, seg_spec = specs
    run = jax.shard_map(run, mesh=mesh, in_specs=(heads_spec, heads_spec, heads_spec, seg_spec),
                        out_specs=heads_spec, check_vma=False)
  return run(q_BxHxTxE, k_BxKxSxE, v_BxKxSxE, seg_BxS).transpose(0, 2, 1, 3)


def dot_product_attention(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask: Mask, *, impl: str = "xla"):
  """Attention of q over k/v with ``impl`` (see the module docstring); output like q."""
  t, e = q_BxTxHxE.shape[1], q_BxTxHxE.shape[3]
  if not mask.causal:  # no structure a fused kernel takes: the dense mask
    return xla_attention(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask.dense_BxTxS)
  impl = resolve_impl(impl, dtype=q_BxTxHxE.dtype, seq_len=t, head_dim=e)
  if impl == "cudnn" and not _batch_divides_its_mesh_axes(q_BxTxHxE.shape[0]):
    impl = "xla"  # e.g. a prefill of 6 prompts on 8 GPUs: GSPMD pads, cuDNN's partitioner refuses
  if impl == "xla":
    return xla_attention(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask.dense_BxTxS)
  if impl == "cudnn":
    return cudnn_attention(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask)
  if mask.segment_ids_BxS is None:
    return splash_attention(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE,
                            mask.key_valid_BxS.astype(jnp.int32))
  return splash_attention(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask.segment_ids_BxS,
                          skip_blocks=True)
