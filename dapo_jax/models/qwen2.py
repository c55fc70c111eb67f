"""Qwen2 / Qwen2.5 decoder in Flax NNX, with a full-sequence forward and a KV-cache path.

Shapes in names: B batch, T new tokens, S cache slots, D hidden, H query heads, K kv heads,
G = H // K query heads per kv head, E head dim, F MLP width, V vocab.
Every parameter carries ``logical_axes`` metadata (see ``dapo_jax.sharding``).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from dapo_jax.models import attention
from dapo_jax.models.config import Qwen2Config
from dapo_jax.sharding import constrain

_INIT_STD = 0.02


@flax.struct.dataclass
class KVCache:
  """Per-layer keys and values plus slot bookkeeping.

  ``index[b]`` is the next slot sequence b writes; ``valid[b, s]`` marks slots holding real
  tokens (left padding of prompts stays invalid), so sequences of a batch may sit at different
  lengths (as JetStream's decode slots do).
  """
  k: tuple[jax.Array, ...]  # L x [B, S, K, E]
  v: tuple[jax.Array, ...]  # L x [B, S, K, E]
  valid: jax.Array  # [B, S] bool
  index: jax.Array  # [B] int32

  @property
  def max_length(self) -> int:
    return self.valid.shape[1]


class RMSNorm(nnx.Module):
  """RMSNorm computed in fp32, scaled in the input dtype (as Qwen2RMSNorm does)."""

  def __init__(self, dim: int, eps: float, param_dtype: Any):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("norm",))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.scale.value.astype(x.dtype) * y.astype(x.dtype)


class Dense(nnx.Module):
  """``x[..., *in] @ kernel[*in, *out] (+ bias[*out])`` with logical axes on the kernel."""

  def __init__(self, in_shape: tuple[int, ...], out_shape: tuple[int, ...],
               axes: tuple[str, ...], *, use_bias: bool, param_dtype: Any, rngs: nnx.Rngs):
    self.n_in = len(in_shape)
    init = nnx.initializers.normal(_INIT_STD)
    self.kernel = nnx.Param(init(rngs.params(), in_shape + out_shape, param_dtype),
                            logical_axes=axes)
    self.bias = (nnx.Param(jnp.zeros(out_shape, param_dtype), logical_axes=axes[self.n_in:])
                 if use_bias else None)

  def __call__(self, x: jax.Array, dtype: Any) -> jax.Array:
    n = self.n_in
    dims = ((tuple(range(x.ndim - n, x.ndim)), tuple(range(n))), ((), ()))
    y = jax.lax.dot_general(x.astype(dtype), self.kernel.value.astype(dtype), dims)
    if self.bias is not None:
      y = y + self.bias.value.astype(dtype)
    return y


def apply_rope(x_BxTxHxE: jax.Array, positions_BxT: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding in the non-interleaved (rotate-half) layout of HF Qwen2, in fp32."""
  e = x_BxTxHxE.shape[-1]
  half = e // 2
  inv_freq = 1.0 / (theta ** (jnp.arange(0, half, dtype=jnp.float32) * 2.0 / e))
  ang_BxTxE2 = positions_BxT[..., None].astype(jnp.float32) * inv_freq
  cos = jnp.cos(ang_BxTxE2)[:, :, None, :]
  sin = jnp.sin(ang_BxTxE2)[:, :, None, :]
  x = x_BxTxHxE.astype(jnp.float32)
  x1, x2 = x[..., :half], x[..., half:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxHxE.dtype)


def _write_slots(cache_BxSxKxE: jax.Array, new_BxTxKxE: jax.Array, index_B: jax.Array):
  """Writes each sequence's new keys/values at its own slot offset."""
  upd = lambda c, n, i: jax.lax.dynamic_update_slice(c, n.astype(c.dtype), (i, 0, 0))
  return jax.vmap(upd)(cache_BxSxKxE, new_BxTxKxE, index_B)


class Attention(nnx.Module):
  """Grouped-query attention with q/k/v bias and no output bias."""

  def __init__(self, cfg: Qwen2Config, rngs: nnx.Rngs):
    d, h, k, e = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                  cfg.dim_per_head)
    pd = cfg.jnp_param_dtype
    self.q_proj = Dense((d,), (h, e), ("embed", "heads", "head_dim"), use_bias=True,
                        param_dtype=pd, rngs=rngs)
    self.k_proj = Dense((d,), (k, e), ("embed", "kv_heads", "head_dim"), use_bias=True,
                        param_dtype=pd, rngs=rngs)
    self.v_proj = Dense((d,), (k, e), ("embed", "kv_heads", "head_dim"), use_bias=True,
                        param_dtype=pd, rngs=rngs)
    self.o_proj = Dense((h, e), (d,), ("heads", "head_dim", "embed"), use_bias=False,
                        param_dtype=pd, rngs=rngs)
    self.rope_theta = cfg.rope_theta
    self.impl = cfg.attention_impl

  def __call__(self, x_BxTxD, positions_BxT, mask: attention.Mask, layer_cache=None,
               index_B=None):
    dtype = x_BxTxD.dtype
    q = apply_rope(self.q_proj(x_BxTxD, dtype), positions_BxT, self.rope_theta)
    k = apply_rope(self.k_proj(x_BxTxD, dtype), positions_BxT, self.rope_theta)
    v = self.v_proj(x_BxTxD, dtype)
    q = constrain(q, ("batch", "length", "act_heads", None))
    if layer_cache is not None:
      k = _write_slots(layer_cache[0], k, index_B)
      v = _write_slots(layer_cache[1], v, index_B)
      new_cache = (k, v)
    else:
      new_cache = None
    out_BxTxHxE = attention.dot_product_attention(q, k.astype(dtype), v.astype(dtype), mask,
                                                  impl=self.impl)
    out_BxTxHxE = checkpoint_name(out_BxTxHxE, "attention")
    return self.o_proj(out_BxTxHxE, dtype), new_cache


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: Qwen2Config, rngs: nnx.Rngs):
    d, f, pd = cfg.hidden_size, cfg.intermediate_size, cfg.jnp_param_dtype
    self.gate_proj = Dense((d,), (f,), ("embed", "mlp"), use_bias=False, param_dtype=pd,
                           rngs=rngs)
    self.up_proj = Dense((d,), (f,), ("embed", "mlp"), use_bias=False, param_dtype=pd, rngs=rngs)
    self.down_proj = Dense((f,), (d,), ("mlp", "embed"), use_bias=False, param_dtype=pd,
                           rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    dtype = x.dtype
    h = jax.nn.silu(self.gate_proj(x, dtype)) * self.up_proj(x, dtype)
    h = constrain(h, ("batch", "length", "act_mlp"))
    return self.down_proj(h, dtype)


class DecoderLayer(nnx.Module):
  """Pre-norm attention block and pre-norm MLP block, each with a residual."""

  def __init__(self, cfg: Qwen2Config, rngs: nnx.Rngs):
    pd = cfg.jnp_param_dtype
    self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd)
    self.self_attn = Attention(cfg, rngs)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x, positions, mask, layer_cache=None, index=None):
    attn_out, new_cache = self.self_attn(self.input_layernorm(x), positions, mask,
                                         layer_cache, index)
    x = x + attn_out
    x = x + self.mlp(self.post_attention_layernorm(x))
    return constrain(x, ("batch", "length", "act_embed")), new_cache


def _layer_apply(layer, x, positions, mask, layer_cache, index):
  return layer(x, positions, mask, layer_cache, index)


_policies = jax.checkpoint_policies
# What each decoder layer keeps for the backward pass (config.remat); the rest is recomputed.
REMAT_POLICIES = {
    "none": None,  # no remat: everything is kept
    "full": _policies.nothing_saveable,  # only the layer input
    "dots": _policies.checkpoint_dots,  # every matmul, attention's [T, S] scores included
    # The weight matmuls (q/k/v/o, gate/up/down), not the attention scores: "save matmuls".
    "dots_no_batch": _policies.checkpoint_dots_with_no_batch_dims,
    # ... plus the attention output and the splash kernel's residuals (named "attention"), so a
    # flash kernel's forward is not run again in the backward pass.
    "dots_attn": _policies.save_from_both_policies(
        _policies.checkpoint_dots_with_no_batch_dims,
        _policies.save_only_these_names("attention")),
}


def default_positions(attention_mask_BxT: jax.Array) -> jax.Array:
  """Positions for left-padded rows: 0 at the first real token, counting real tokens only."""
  return jnp.maximum(jnp.cumsum(attention_mask_BxT.astype(jnp.int32), axis=-1) - 1, 0)


class Qwen2ForCausalLM(nnx.Module):
  """Qwen2.5 causal LM: ``model(input_ids) -> logits [B, T, V]``."""

  def __init__(self, config: Qwen2Config, *, rngs: nnx.Rngs):
    self.config = config
    cfg, pd = config, config.jnp_param_dtype
    init = nnx.initializers.normal(_INIT_STD)
    self.embed_tokens = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.hidden_size), pd),
                                  logical_axes=("vocab", "embed"))
    self.layers = nnx.List([DecoderLayer(cfg, rngs) for _ in range(cfg.num_hidden_layers)])
    self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd)
    self.lm_head = (None if cfg.tie_word_embeddings else nnx.Param(
        init(rngs.params(), (cfg.hidden_size, cfg.vocab_size), pd),
        logical_axes=("embed", "vocab")))

  # --- pieces the trainer and sampler use directly ---------------------------------------------

  def lm_head_kernel(self) -> jax.Array:
    """The [D, V] output projection (the transposed embedding when tied)."""
    if self.lm_head is None:
      return self.embed_tokens.value.T
    return self.lm_head.value

  def logits_from_hidden(self, h_BxTxD: jax.Array) -> jax.Array:
    """fp32 logits; the matmul runs in the compute dtype with fp32 accumulation."""
    w = self.lm_head_kernel().astype(h_BxTxD.dtype)
    return jnp.einsum("btd,dv->btv", h_BxTxD, w, preferred_element_type=jnp.float32)

  def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> KVCache:
    cfg = self.config
    dtype = dtype or cfg.jnp_dtype
    shape = (batch_size, max_length, cfg.num_key_value_heads, cfg.dim_per_head)
    zeros = lambda: jnp.zeros(shape, dtype)
    n = cfg.num_hidden_layers
    return KVCache(k=tuple(zeros() for _ in range(n)), v=tuple(zeros() for _ in range(n)),
                   valid=jnp.zeros((batch_size, max_length), bool),
                   index=jnp.zeros((batch_size,), jnp.int32))

  def hidden_states(self, input_ids_BxT: jax.Array, positions_BxT: jax.Array | None = None,
                    attention_mask_BxT: jax.Array | None = None,
                    cache: KVCache | None = None) -> tuple[jax.Array, KVCache | None]:
    """Final-norm hidden states [B, T, D] (and the updated cache when one is given)."""
    cfg = self.config
    b, t = input_ids_BxT.shape
    if attention_mask_BxT is None:
      attention_mask_BxT = jnp.ones((b, t), bool)
    attention_mask_BxT = attention_mask_BxT.astype(bool)
    if positions_BxT is None:
      if cache is not None:
        raise ValueError("With a KV cache pass explicit positions (tokens already seen).")
      positions_BxT = default_positions(attention_mask_BxT)

    if cache is None:
      q_slot_BxT = jnp.broadcast_to(jnp.arange(t), (b, t))
      key_valid_BxS = attention_mask_BxT
    else:
      q_slot_BxT = cache.index[:, None] + jnp.arange(t)[None, :]
      write = lambda val, m, i: jax.lax.dynamic_update_slice(val, m, (i,))
      key_valid_BxS = jax.vmap(write)(cache.valid, attention_mask_BxT, cache.index)
    s = key_valid_BxS.shape[1]
    causal_BxTxS = jnp.arange(s)[None, None, :] <= q_slot_BxT[:, :, None]
    # T == S: a full pass (a cache this long is written from slot 0), query t at key slot t, so
    # the fused kernels apply; T < S is a step over the cache.
    mask = attention.Mask(causal_BxTxS & key_valid_BxS[:, None, :], key_valid_BxS,
                          causal=t == s)

    x = jnp.take(self.embed_tokens.value, input_ids_BxT, axis=0).astype(cfg.jnp_dtype)
    x = constrain(x, ("batch", "length", "act_embed"))
    layer_fn = _layer_apply
    if cfg.remat != "none" and cache is None:
      layer_fn = nnx.remat(_layer_apply, policy=REMAT_POLICIES[cfg.remat])
    new_k, new_v = [], []
    for i, layer in enumerate(self.layers):
      layer_cache = None if cache is None else (cache.k[i], cache.v[i])
      x, upd = layer_fn(layer, x, positions_BxT, mask, layer_cache,
                        None if cache is None else cache.index)
      if upd is not None:
        new_k.append(upd[0])
        new_v.append(upd[1])
    h = self.norm(x)
    if cache is None:
      return h, None
    new_cache = KVCache(k=tuple(new_k), v=tuple(new_v), valid=key_valid_BxS,
                        index=cache.index + t)
    return h, new_cache

  def __call__(self, input_ids_BxT: jax.Array, positions_BxT: jax.Array | None = None,
               attention_mask_BxT: jax.Array | None = None, cache: KVCache | None = None):
    """Logits [B, T, V] in fp32; with a cache, ``(logits, new_cache)``."""
    h, new_cache = self.hidden_states(input_ids_BxT, positions_BxT, attention_mask_BxT, cache)
    logits = self.logits_from_hidden(h)
    return logits if cache is None else (logits, new_cache)
