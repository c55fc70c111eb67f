"""Attention kernels chosen by platform, with the plain XLA einsum path as the reference.

``mask_BxTxS`` is a boolean mask (True = attend). Fully masked rows (left-padding queries) give
a uniform distribution instead of NaN; their outputs are never used.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def resolve_impl(impl: str) -> str:
  """Maps "auto" to the best implementation for the default backend."""
  if impl != "auto":
    return impl
  platform = jax.default_backend()
  if platform == "gpu":
    return "cudnn"
  return "xla"


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


def dot_product_attention(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask_BxTxS, *, impl: str = "xla"):
  impl = resolve_impl(impl)
  if impl == "xla":
    return xla_attention(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask_BxTxS)
  if impl == "cudnn":
    return jax.nn.dot_product_attention(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE,
                                        mask=mask_BxTxS[:, None], implementation="cudnn")
  raise NotImplementedError(f"attention_impl={impl!r} is not available on this platform.")
