"""8-bit KV caches (``rollout.kv_cache_dtype``): int8 or float8_e4m3fn keys and values with a
scale per token and KV head, stored beside the values in the head-dim axis.

    kv_XxE4 = encode(kv_XxE, jnp.int8)       # [..., E] float -> [..., E + 4] int8
    vals_XxE, scale_Xx1 = split(kv_XxE4)     # int8 values, fp32 scale (size 1 on that axis)
    kv_XxE ~= decode(kv_XxE4, jnp.float32)   # vals * scale

Layout: a quantized cache array has ``E + SCALE_BYTES`` entries on its head-dim axis; the last
four hold the fp32 scale's bytes (`jax.lax.bitcast_convert_type`), so the scale of every token
and KV head travels with its values through every copy the caches make (admission's row
copies, copy-on-write of a shared prompt page, preemption, `grow`, `repeat`): none of that code
knows the cache is quantized. Only the writes (`encode`) and the attention reads (`split`) do.

Scale per token and KV head (absmax / 127 for int8, / 448 for e4m3): a decode step writes one
token, so its scale is final when written; a scale per page and head would have to be known
before the page's later tokens arrive (re-quantizing the page when one exceeds it). It is also
the more accurate: `bench/kv_int8_decode.py --granularity` measures both (docs/kv_int8.md).

The dtype IS the flag: a cache stored as int8 or float8_e4m3fn is quantized (no model computes
in either), any other dtype is a plain cast, so the default cache is today's bit for bit.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

# rollout.kv_cache_dtype values besides "" and the model's compute dtype.
QUANTIZED = {"int8": jnp.int8, "float8_e4m3fn": jnp.float8_e4m3fn}
_QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}
SCALE_BYTES = 4  # one fp32 scale per token and KV head, as 4 one-byte entries


def is_quantized(dtype: Any) -> bool:
  return jnp.dtype(dtype) in _QMAX


def resolve(kv_cache_dtype: str, model_dtype: str) -> jnp.dtype:
  """The cache's storage dtype: "" or the model's compute dtype -> that dtype; "int8",
  "float8_e4m3fn" -> the quantized one."""
  if kv_cache_dtype in ("", model_dtype):
    return jnp.dtype(model_dtype)
  if kv_cache_dtype in QUANTIZED:
    return jnp.dtype(QUANTIZED[kv_cache_dtype])
  raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}; choose '' (the model's dtype, "
                   f"{model_dtype!r}), {model_dtype!r}, 'int8' or 'float8_e4m3fn'.")


def stored_dim(head_dim: int, dtype: Any) -> int:
  """Entries on a cache array's head-dim axis: E, or E + SCALE_BYTES quantized."""
  return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim


def bytes_per_token_head(head_dim: int, dtype: Any) -> int:
  """Bytes of one token's key (or value) for one KV head, its scale included."""
  return stored_dim(head_dim, dtype) * jnp.dtype(dtype).itemsize


def encode(x: jax.Array, dtype: Any, axis: int = -1) -> jax.Array:
  """``x`` as a cache of ``dtype`` stores it, ``axis`` being its head-dim axis. A plain cast
  unless ``dtype`` is quantized; an array already stored as ``dtype`` is returned as it is."""
  dtype = jnp.dtype(dtype)
  if not is_quantized(dtype):
    return x.astype(dtype)
  if x.dtype == dtype:
    return x
  qmax = _QMAX[dtype]
  x32 = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
  amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
  scale = jnp.where(amax > 0, amax / qmax, 1.0)
  q = jnp.clip(x32 / scale, -qmax, qmax)
  q = (jnp.rint(q) if dtype == jnp.int8 else q).astype(dtype)
  scale_bytes = jax.lax.bitcast_convert_type(scale[..., 0], dtype)  # [..., SCALE_BYTES]
  return jnp.moveaxis(jnp.concatenate([q, scale_bytes], axis=-1), -1, axis)


def split(xs: jax.Array, axis: int = -1) -> tuple[jax.Array, jax.Array]:
  """A quantized array's values (stored dtype, E on ``axis``) and fp32 scales (size 1 on
  ``axis``)."""
  e = xs.shape[axis] - SCALE_BYTES
  vals = jax.lax.slice_in_dim(xs, 0, e, axis=axis % xs.ndim)
  raw = jnp.moveaxis(jax.lax.slice_in_dim(xs, e, e + SCALE_BYTES, axis=axis % xs.ndim), axis, -1)
  scale = jax.lax.bitcast_convert_type(raw, jnp.float32)  # [...] (the byte axis folded)
  return vals, jnp.expand_dims(scale, axis)


def decode(xs: jax.Array, dtype: Any, axis: int = -1) -> jax.Array:
  """The values ``xs`` stores, in ``dtype``: a cast unless ``xs`` is quantized."""
  if not is_quantized(xs.dtype):
    return xs.astype(dtype)
  vals, scale = split(xs, axis)
  return (vals.astype(jnp.float32) * scale).astype(dtype)
