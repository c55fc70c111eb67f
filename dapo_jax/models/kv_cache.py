"""The one KV cache of the decoder: prefill writes it, `Qwen2ForCausalLM.decode_step` reads it.

Shapes in names: N rows, K kv heads, E head dim, S cache slots, M inserted rows.
Keys are [N, K, E, S] (slots minor) and values [N, K, S, E], so both attention products of a
one-token step are plain batched matmuls over (N, K). A [N, S, K, E] layout made XLA CPU
transpose the whole cache of every layer on every step (a quarter of the decode time at
S = 160).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from dapo_jax import sharding as shd


@flax.struct.dataclass
class KVCache:
  """Per-layer keys and values plus slot bookkeeping.

  ``index[n]`` is the next slot row n writes; ``valid[n, s]`` marks slots holding real tokens
  (prompt padding stays invalid), so rows may sit at different lengths (JetStream's decode
  slots) or all at one (the static sampler's batch).
  """
  k: tuple[jax.Array, ...]  # L x [N, K, E, S]
  v: tuple[jax.Array, ...]  # L x [N, K, S, E]
  valid: jax.Array  # [N, S] bool
  index: jax.Array  # [N] int32

  @property
  def max_length(self) -> int:
    return self.valid.shape[1]

  @classmethod
  def zeros(cls, num_layers: int, rows: int, length: int, kv_heads: int, head_dim: int,
            dtype: Any) -> KVCache:
    k = lambda: jnp.zeros((rows, kv_heads, head_dim, length), dtype)
    v = lambda: jnp.zeros((rows, kv_heads, length, head_dim), dtype)
    return cls(k=tuple(k() for _ in range(num_layers)), v=tuple(v() for _ in range(num_layers)),
               valid=jnp.zeros((rows, length), bool), index=jnp.zeros((rows,), jnp.int32))

  @classmethod
  def from_pass(cls, ks_NxSxKxE: list[jax.Array], vs_NxSxKxE: list[jax.Array],
                valid_NxS: jax.Array, dtype: Any) -> KVCache:
    """The keys and values of a full pass (prefill) over S tokens; every row ends at slot S."""
    n, s = valid_NxS.shape
    return cls(k=tuple(x.transpose(0, 2, 3, 1).astype(dtype) for x in ks_NxSxKxE),
               v=tuple(x.transpose(0, 2, 1, 3).astype(dtype) for x in vs_NxSxKxE),
               valid=valid_NxS, index=jnp.full((n,), s, jnp.int32))

  def grow(self, extra_slots: int) -> KVCache:
    """Appends invalid slots (one copy of the cache)."""
    pad = lambda x, axis: jnp.pad(x, [(0, extra_slots) if a == axis else (0, 0)
                                      for a in range(x.ndim)])
    return self.replace(k=tuple(pad(x, 3) for x in self.k), v=tuple(pad(x, 2) for x in self.v),
                        valid=pad(self.valid, 1))

  def repeat(self, num_samples: int) -> KVCache:
    """Each row `num_samples` times (row = n * num_samples + g), laid out over the batch axes."""
    rep = lambda x: jnp.repeat(x, num_samples, axis=0)
    kv = lambda x: shd.constrain(rep(x), ("batch", "kv_heads", None, None))
    return KVCache(k=tuple(map(kv, self.k)), v=tuple(map(kv, self.v)),
                   valid=shd.constrain(rep(self.valid), ("batch", None)), index=rep(self.index))

  def insert(self, src: KVCache, rows_M: jax.Array) -> KVCache:
    """Copies `src`'s M rows (P <= S slots) into rows `rows_M`, slots [0, P); the rows' slots
    past P turn invalid. Out-of-range rows are dropped (batch padding)."""
    p = src.max_length
    put_k = lambda dst, x: dst.at[rows_M, :, :, :p].set(x.astype(dst.dtype), mode="drop")
    put_v = lambda dst, x: dst.at[rows_M, :, :p].set(x.astype(dst.dtype), mode="drop")
    valid_MxS = jnp.zeros((rows_M.shape[0], self.max_length), bool).at[:, :p].set(src.valid)
    put = lambda dst, x: dst.at[rows_M].set(x, mode="drop")
    return KVCache(k=tuple(map(put_k, self.k, src.k)), v=tuple(map(put_v, self.v, src.v)),
                   valid=put(self.valid, valid_MxS), index=put(self.index, src.index))


def write_step(k_NxKxExS: jax.Array, v_NxKxSxE: jax.Array, kn_NxKxE: jax.Array,
               vn_NxKxE: jax.Array, slot: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Writes one token's key and value per row at `slot`.

  `slot` is a scalar (every row writes the same slot: one in-place dynamic_update_slice) or
  [N] (each row its own slot: a scatter; a slot past the end overwrites the last one, as
  dynamic_update_slice clamps).
  """
  kn, vn = kn_NxKxE.astype(k_NxKxExS.dtype), vn_NxKxE.astype(v_NxKxSxE.dtype)
  if jnp.ndim(slot) == 0:
    return (jax.lax.dynamic_update_slice(k_NxKxExS, kn[..., None], (0, 0, 0, slot)),
            jax.lax.dynamic_update_slice(v_NxKxSxE, vn[:, :, None], (0, 0, slot, 0)))
  n, s = k_NxKxExS.shape[0], k_NxKxExS.shape[3]
  rows_N, slot_N = jnp.arange(n), jnp.minimum(slot, s - 1)
  return (k_NxKxExS.at[rows_N, :, :, slot_N].set(kn, unique_indices=True),
          v_NxKxSxE.at[rows_N, :, slot_N].set(vn, unique_indices=True))


def mark_valid(valid_NxS: jax.Array, slot: jax.Array) -> jax.Array:
  """`valid` with each row's `slot` (scalar or [N], clamped like `write_step`) set."""
  n, s = valid_NxS.shape
  if jnp.ndim(slot) == 0:
    return jax.lax.dynamic_update_slice(valid_NxS, jnp.ones((n, 1), bool), (0, slot))
  return valid_NxS.at[jnp.arange(n), jnp.minimum(slot, s - 1)].set(True, unique_indices=True)
