"""The one KV cache of the decoder: prefill writes it, `Qwen2ForCausalLM.decode_step` reads it.

Shapes in names: N rows, K kv heads, E head dim, S cache slots, M inserted rows.
Keys are [N, K, E, S] (slots minor) and values [N, K, S, E], so both attention products of a
one-token step are plain batched matmuls over (N, K). A [N, S, K, E] layout made XLA CPU
transpose the whole cache of every layer on every step (a quarter of the decode time at
S = 160).

A scanned model (`Qwen2Config.scan_layers`) keeps each of k and v as ONE array with a leading
layer axis ([L, N, K, E, S], [L, N, K, S, E]); the scanned decode step reads layer l's slice and
writes its one new slot in place. `per_layer` runs the cache's methods on either layout.

An 8-bit cache (int8 / float8_e4m3fn, `kv_quant`) holds E + 4 entries on the head-dim axis (the
values, then each token's scale per KV head): writes go through `kv_quant.encode`, the decode
attention reads the scales, and every copy here moves them with their token unchanged.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from dapo_jax.infra import sharding as shd
from dapo_jax.models import kv_quant
from dapo_jax.infra.profiling import scoped

Layers = tuple[jax.Array, ...] | jax.Array  # L per-layer arrays, or one stacked [L, ...] array


def per_layer(fn, *layers: Layers) -> Layers:
  """`fn` on each layer's array: mapped over a tuple, vmapped over a stacked array."""
  if isinstance(layers[0], (tuple, list)):
    return tuple(map(fn, *layers))
  return jax.vmap(fn)(*layers)


@flax.struct.dataclass
class KVCache:
  """Per-layer keys and values plus slot bookkeeping.

  ``index[n]`` is the next slot row n writes; ``valid[n, s]`` marks slots holding real tokens
  (prompt padding stays invalid), so rows may sit at different lengths (JetStream's decode
  slots) or all at one (the static sampler's batch).
  """
  k: Layers  # L x [N, K, E, S], or [L, N, K, E, S] stacked (8-bit: E + 4, `kv_quant`)
  v: Layers  # L x [N, K, S, E], or [L, N, K, S, E] stacked
  valid: jax.Array  # [N, S] bool
  index: jax.Array  # [N] int32

  @property
  def max_length(self) -> int:
    return self.valid.shape[1]

  @property
  def stacked(self) -> bool:
    return not isinstance(self.k, (tuple, list))

  @classmethod
  def zeros(cls, num_layers: int, rows: int, length: int, kv_heads: int, head_dim: int,
            dtype: Any, stacked: bool = False) -> KVCache:
    head_dim = kv_quant.stored_dim(head_dim, dtype)
    k_shape, v_shape = (rows, kv_heads, head_dim, length), (rows, kv_heads, length, head_dim)
    if stacked:
      k, v = jnp.zeros((num_layers,) + k_shape, dtype), jnp.zeros((num_layers,) + v_shape, dtype)
    else:
      k = tuple(jnp.zeros(k_shape, dtype) for _ in range(num_layers))
      v = tuple(jnp.zeros(v_shape, dtype) for _ in range(num_layers))
    return cls(k=k, v=v, valid=jnp.zeros((rows, length), bool),
               index=jnp.zeros((rows,), jnp.int32))

  @classmethod
  def from_pass(cls, ks_NxSxKxE: Layers, vs_NxSxKxE: Layers, valid_NxS: jax.Array,
                dtype: Any) -> KVCache:
    """The keys and values of a full pass (prefill) over S tokens; every row ends at slot S.
    Per-layer lists give a per-layer cache, stacked [L, N, S, K, E] arrays a stacked one."""
    n, s = valid_NxS.shape
    enc = lambda x: kv_quant.encode(x, dtype)
    return cls(k=per_layer(lambda x: enc(x).transpose(0, 2, 3, 1), ks_NxSxKxE),
               v=per_layer(lambda x: enc(x).transpose(0, 2, 1, 3), vs_NxSxKxE),
               valid=valid_NxS, index=jnp.full((n,), s, jnp.int32))

  def grow(self, extra_slots: int) -> KVCache:
    """Appends invalid slots (one copy of the cache)."""
    pad = lambda x, axis: jnp.pad(x, [(0, extra_slots) if a == axis else (0, 0)
                                      for a in range(x.ndim)])
    return self.replace(k=per_layer(lambda x: pad(x, 3), self.k),
                        v=per_layer(lambda x: pad(x, 2), self.v), valid=pad(self.valid, 1))

  def repeat(self, num_samples: int) -> KVCache:
    """Each row `num_samples` times (row = n * num_samples + g), laid out over the batch axes."""
    rep = lambda x: jnp.repeat(x, num_samples, axis=0)
    kv = lambda x: shd.constrain(rep(x), ("batch", "kv_heads", None, None))
    return KVCache(k=per_layer(kv, self.k), v=per_layer(kv, self.v),
                   valid=shd.constrain(rep(self.valid), ("batch", None)), index=rep(self.index))

  def insert(self, src: KVCache, rows_M: jax.Array) -> KVCache:
    """Copies `src`'s M rows (P <= S slots) into rows `rows_M`, slots [0, P); the rows' slots
    past P turn invalid. Out-of-range rows are dropped (batch padding)."""
    p = src.max_length
    put_k = lambda dst, x: dst.at[rows_M, :, :, :p].set(kv_quant.encode(x, dst.dtype, -2),
                                                        mode="drop")
    put_v = lambda dst, x: dst.at[rows_M, :, :p].set(kv_quant.encode(x, dst.dtype), mode="drop")
    valid_MxS = jnp.zeros((rows_M.shape[0], self.max_length), bool).at[:, :p].set(src.valid)
    put = lambda dst, x: dst.at[rows_M].set(x, mode="drop")
    return KVCache(k=per_layer(put_k, self.k, src.k), v=per_layer(put_v, self.v, src.v),
                   valid=put(self.valid, valid_MxS), index=put(self.index, src.index))

  def copy_row(self, src: KVCache, src_row: jax.Array, dst_row: jax.Array,
               index: jax.Array) -> KVCache:
    """`insert` of ONE row: `src`'s row `src_row` (P <= S slots) into row `dst_row`, slots
    [0, P), the row's later slots invalid, its next write at `index`.

    One dynamic_update_slice per array (a stacked cache's [L, ...] arrays take all layers at
    once), so XLA writes in place inside a loop: admitting a few rows per decode step costs
    those rows, where a scatter of a padded row batch under `lax.cond` copied the whole cache.
    """
    axis = 1 if self.stacked else 0

    def put(dst: jax.Array, x: jax.Array, head_axis: int) -> jax.Array:
      row = kv_quant.encode(jax.lax.dynamic_slice_in_dim(x, src_row, 1, axis), dst.dtype,
                            head_axis)
      start = [0] * dst.ndim
      start[axis] = dst_row
      return jax.lax.dynamic_update_slice(dst, row, tuple(start))

    put_k, put_v = (lambda a, b: put(a, b, -2)), (lambda a, b: put(a, b, -1))
    each = (lambda f, a, b: f(a, b)) if self.stacked else (
        lambda f, a, b: tuple(map(f, a, b)))
    valid_1xS = jax.lax.dynamic_update_slice(
        jnp.zeros((1, self.max_length), bool),
        jax.lax.dynamic_slice_in_dim(src.valid, src_row, 1, 0), (0, 0))
    return KVCache(k=each(put_k, self.k, src.k), v=each(put_v, self.v, src.v),
                   valid=jax.lax.dynamic_update_slice(self.valid, valid_1xS, (dst_row, 0)),
                   index=self.index.at[dst_row].set(index))


@scoped("kv_cache_write")
def write_step(k_NxKxExS: jax.Array, v_NxKxSxE: jax.Array, kn_NxKxE: jax.Array,
               vn_NxKxE: jax.Array, slot: jax.Array, layer: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array]:
  """Writes one token's key and value per row at `slot`.

  `slot` is a scalar (every row writes the same slot: one in-place dynamic_update_slice) or
  [N] (each row its own slot: a scatter; a slot past the end overwrites the last one, as
  dynamic_update_slice clamps). With `layer`, k and v are a stacked cache's [L, ...] arrays and
  only that layer's slot is written.
  """
  kn, vn = kv_quant.encode(kn_NxKxE, k_NxKxExS.dtype), kv_quant.encode(vn_NxKxE, v_NxKxSxE.dtype)
  lead = () if layer is None else (layer,)
  if jnp.ndim(slot) == 0:
    kn, vn = kn[..., None], vn[:, :, None]
    if layer is not None:
      kn, vn = kn[None], vn[None]
    return (jax.lax.dynamic_update_slice(k_NxKxExS, kn, lead + (0, 0, 0, slot)),
            jax.lax.dynamic_update_slice(v_NxKxSxE, vn, lead + (0, 0, slot, 0)))
  n, s = k_NxKxExS.shape[-4], k_NxKxExS.shape[-1]
  rows_N, slot_N = jnp.arange(n), jnp.minimum(slot, s - 1)
  return (k_NxKxExS.at[lead + (rows_N, slice(None), slice(None), slot_N)].set(
              kn, unique_indices=True),
          v_NxKxSxE.at[lead + (rows_N, slice(None), slot_N)].set(vn, unique_indices=True))


def mark_valid(valid_NxS: jax.Array, slot: jax.Array) -> jax.Array:
  """`valid` with each row's `slot` (scalar or [N], clamped like `write_step`) set."""
  n, s = valid_NxS.shape
  if jnp.ndim(slot) == 0:
    return jax.lax.dynamic_update_slice(valid_NxS, jnp.ones((n, 1), bool), (0, slot))
  return valid_NxS.at[jnp.arange(n), jnp.minimum(slot, s - 1)].set(True, unique_indices=True)
