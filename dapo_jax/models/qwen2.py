"""Qwen2 / Qwen2.5 / Qwen3 (dense) decoder in Flax NNX: a full-sequence forward and ONE cached
decode step. Qwen3's differences are config fields (`Qwen2Config.qk_norm`, `attention_bias`,
`head_dim`), not a second model.

    h_BxPxD, cache = model.prefill(ids_BxP, positions_BxP, mask_BxP)   # writes a KVCache
    logits_NxV, cache = model.decode_step(tokens_N, positions_N, cache) # one token per row

Every sampler (rollout/sampler.py, continuous.py, jetstream_engine.py) decodes through these two;
nothing outside models/ reaches into the layers.

`config.scan_layers` holds the decoder layers as ONE `DecoderLayer` whose parameters are stacked
on a leading "layers" axis and runs them with `jax.lax.scan` (remat inside the scanned body), so
XLA compiles one layer whatever the depth; the default is a Python loop over `num_hidden_layers`
modules (unrolled into the program). Both layouts compute the same function from the same seed.

Shapes in names: B batch, T new tokens, S cache slots, D hidden, H query heads, K kv heads,
G = H // K query heads per kv head, E head dim, F MLP width, V vocab, N decode rows.
Every parameter carries ``logical_axes`` metadata (see ``dapo_jax.infra.sharding``).

One piece: the layers, the full-sequence forward and the one decode step (dense and paged) share
every weight and must stay exactly equal (the golden and log-prob tests compare them), so they are
kept side by side.
"""

from __future__ import annotations

import functools

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from dapo_jax.models import attention, kv_cache, paged_attention, paged_kv
from dapo_jax.models.config import Qwen2Config
from dapo_jax.models.kv_cache import KVCache
from dapo_jax.models.paged_kv import PagedKVCache
from dapo_jax.infra.profiling import scoped
from dapo_jax.infra.sharding import constrain

_INIT_STD = 0.02
LAYERS_AXIS = "layers"  # logical name of the stacked layer axis (config.scan_layers)


class RMSNorm(nnx.Module):
  """RMSNorm over the last axis computed in fp32, scaled in the input dtype (as Qwen2RMSNorm
  does). `axis`: the scale's logical axis ("head_dim" for Qwen3's per-head q_norm / k_norm)."""

  def __init__(self, dim: int, eps: float, param_dtype: Any, axis: str = "norm"):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=(axis,))
    self.eps = eps

  @scoped("norm")
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

  @scoped("dense")
  def __call__(self, x: jax.Array, dtype: Any) -> jax.Array:
    n = self.n_in
    dims = ((tuple(range(x.ndim - n, x.ndim)), tuple(range(n))), ((), ()))
    y = jax.lax.dot_general(x.astype(dtype), self.kernel.value.astype(dtype), dims)
    if self.bias is not None:
      y = y + self.bias.value.astype(dtype)
    if getattr(self, "lora_a", None) is not None:  # config.model.lora (models/lora.py)
      y = y + self._lora_delta(x, dtype)
    return y

  def _lora_delta(self, x: jax.Array, dtype: Any) -> jax.Array:
    """``scale * (x @ A) @ B`` of the adapter `models/lora.add_adapters` attached, in ``dtype``."""
    n = self.n_in
    a = self.lora_a.value.astype(dtype)
    b = self.lora_b.value.astype(dtype)
    xa = jax.lax.dot_general(x.astype(dtype), a,
                             ((tuple(range(x.ndim - n, x.ndim)), tuple(range(n))), ((), ())))
    y = jax.lax.dot_general(xa, b, (((xa.ndim - 1,), (0,)), ((), ())))
    return y * jnp.asarray(self.lora_scale, dtype)


@scoped("rope")
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


class Attention(nnx.Module):
  """Grouped-query attention, no output bias; q/k/v bias (`cfg.attention_bias`) and Qwen3's
  per-head RMSNorm on q and k before RoPE (`cfg.qk_norm`)."""

  def __init__(self, cfg: Qwen2Config, rngs: nnx.Rngs):
    d, h, k, e = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                  cfg.dim_per_head)
    pd, bias = cfg.jnp_param_dtype, cfg.attention_bias
    self.q_proj = Dense((d,), (h, e), ("embed", "heads", "head_dim"), use_bias=bias,
                        param_dtype=pd, rngs=rngs)
    self.k_proj = Dense((d,), (k, e), ("embed", "kv_heads", "head_dim"), use_bias=bias,
                        param_dtype=pd, rngs=rngs)
    self.v_proj = Dense((d,), (k, e), ("embed", "kv_heads", "head_dim"), use_bias=bias,
                        param_dtype=pd, rngs=rngs)
    self.o_proj = Dense((h, e), (d,), ("heads", "head_dim", "embed"), use_bias=False,
                        param_dtype=pd, rngs=rngs)
    # One [E] scale shared by every head: logical axis "head_dim" (replicated by every rules
    # table, as the head_dim axis of the kernels is).
    norm = lambda: RMSNorm(e, cfg.rms_norm_eps, pd, axis="head_dim") if cfg.qk_norm else None
    self.q_norm, self.k_norm = norm(), norm()
    self.rope_theta = cfg.rope_theta
    self.impl = cfg.attention_impl

  def __call__(self, x_BxTxD, positions_BxT, mask: attention.Mask, with_kv: bool = False):
    """Output [B, T, D], and this pass's keys and values [B, T, K, E] when `with_kv`."""
    dtype = x_BxTxD.dtype
    q, k, v = self._qkv(x_BxTxD, positions_BxT)
    out_BxTxHxE = attention.dot_product_attention(q, k, v, mask, impl=self.impl)
    out_BxTxHxE = checkpoint_name(out_BxTxHxE, "attention")
    return self.o_proj(out_BxTxHxE, dtype), ((k, v) if with_kv else None)

  def decode(self, x_Nx1xD: jax.Array, positions_Nx1: jax.Array, k_NxKxExS: jax.Array,
             v_NxKxSxE: jax.Array, valid_NxS: jax.Array, slot: jax.Array,
             layer: jax.Array | None = None, attend: int | None = None
             ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """One token per row: writes its key and value at `slot` (scalar or [N]), attends over the
    cache layer (`valid_NxS` already marks the new slot). With `layer`, k and v are the stacked
    cache ([L, ...]) and this is its layer `layer`. With `attend`, only the first `attend`
    slots are attended to (the later ones must be invalid)."""
    dtype = x_Nx1xD.dtype
    q_Nx1xHxE, kn_Nx1xKxE, vn_Nx1xKxE = self._qkv(x_Nx1xD, positions_Nx1)
    k_NxKxExS, v_NxKxSxE = kv_cache.write_step(k_NxKxExS, v_NxKxSxE, kn_Nx1xKxE[:, 0],
                                               vn_Nx1xKxE[:, 0], slot, layer)
    k_l, v_l = (k_NxKxExS, v_NxKxSxE) if layer is None else (k_NxKxExS[layer], v_NxKxSxE[layer])
    if attend is not None:
      k_l, v_l, valid_NxS = k_l[..., :attend], v_l[:, :, :attend], valid_NxS[:, :attend]
    o_NxHxE = attention.decode_attention(q_Nx1xHxE[:, 0], k_l, v_l, valid_NxS)
    return self.o_proj(o_NxHxE[:, None], dtype), (k_NxKxExS, v_NxKxSxE)

  def _qkv(self, x_BxTxD, positions_BxT):
    """Queries [B, T, H, E] and keys [B, T, K, E] (normed when `qk_norm`, then rotated) and
    values [B, T, K, E]: the one projection the full pass and both decode steps share."""
    dtype = x_BxTxD.dtype
    q_BxTxHxE, k_BxTxKxE = self.q_proj(x_BxTxD, dtype), self.k_proj(x_BxTxD, dtype)
    if self.q_norm is not None:  # Qwen3: RMSNorm over head_dim, before RoPE
      q_BxTxHxE, k_BxTxKxE = self.q_norm(q_BxTxHxE), self.k_norm(k_BxTxKxE)
    q_BxTxHxE = apply_rope(q_BxTxHxE, positions_BxT, self.rope_theta)
    q_BxTxHxE = constrain(q_BxTxHxE, ("batch", "length", "act_heads", None))
    k_BxTxKxE = apply_rope(k_BxTxKxE, positions_BxT, self.rope_theta)
    return q_BxTxHxE, k_BxTxKxE, self.v_proj(x_BxTxD, dtype)

  def decode_paged(self, x_Nx1xD, positions_Nx1, k_pool, v_pool, cache: PagedKVCache,
                   app: paged_kv.Append, layer=None, impl: str = "auto"):
    """`decode` over a paged cache: the token goes to `app`'s (page, offset), attention reads
    each slot's live pages (its length after this token). `layer`: stacked pools."""
    q_Nx1xHxE, kn_Nx1xKxE, vn_Nx1xKxE = self._qkv(x_Nx1xD, positions_Nx1)
    n, s = q_Nx1xHxE.shape[0], cache.shards
    # A sharded pool ([S, ...] per layer, `PagedKVCache`): each shard writes and reads its own
    # slots' pages, the [N] rows split [S, N/S].
    split = (lambda x: x) if s is None else (lambda x: x.reshape((s, n // s) + x.shape[1:]))
    shardwise = lambda f, **axes: f if s is None else jax.vmap(f, **axes)
    # (stacked and sharded pools are [S, L, ...]: `layer` indexes each shard's [L, ...] pool)
    write = shardwise(functools.partial(paged_kv.write_token, layer=layer))
    k_pool, v_pool = write(k_pool, v_pool, split(kn_Nx1xKxE[:, 0]), split(vn_Nx1xKxE[:, 0]),
                           jax.tree.map(split, app))
    # v_pool None: a combined K/V pool (`PagedKVCache.combined`), k_pool holds both.
    table, kernel_layer = cache.table, None
    if layer is not None and v_pool is None:
      # The stacked combined pool [(S,) L, P, T, 2K, E] read as one pool of L x P pages (a
      # reshape of adjacent major axes: no copy) with the layer's pages at l x P + page: a
      # layer's slice would be copied for the kernel call every layer and step.
      lead = k_pool.shape[:k_pool.ndim - 5]
      num_pages = k_pool.shape[-4]
      k_l, v_l = k_pool.reshape(lead + (-1,) + k_pool.shape[-3:]), None
      table = jnp.maximum(table, 0) + layer * num_pages
    elif layer is not None and paged_attention.resolve_paged_impl(
        impl, head_dim=q_Nx1xHxE.shape[-1], dtype=k_pool.dtype) == "pallas_gpu":
      # The stacked split pool goes to the kernel whole, read in place at the layer's pages
      # (`paged_attention.gpu_stacked_paged_attention`): a layer's slice would be copied.
      k_l, v_l, kernel_layer = k_pool, v_pool, layer
    else:
      at = lambda pool: pool if layer is None or pool is None else (
          pool[layer] if s is None else pool[:, layer])
      k_l, v_l = at(k_pool), at(v_pool)
    attend = functools.partial(paged_attention.paged_decode_attention if s is None
                               else paged_attention.attend_shards, impl=impl,
                               layer=kernel_layer)
    o_NxHxE = attend(split(q_Nx1xHxE[:, 0]), k_l, v_l, table,
                     cache.length + split(app.ok)).reshape(n, -1, q_Nx1xHxE.shape[-1])
    return self.o_proj(o_NxHxE[:, None], x_Nx1xD.dtype), (k_pool, v_pool)


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

  def __call__(self, x, positions, mask, with_kv: bool = False):
    attn_out, kv = self.self_attn(self.input_layernorm(x), positions, mask, with_kv)
    x = x + attn_out
    x = x + self.mlp(self.post_attention_layernorm(x))
    return constrain(x, ("batch", "length", "act_embed")), kv

  def decode(self, x_Nx1xD: jax.Array, positions_Nx1: jax.Array, k_NxKxExS: jax.Array,
             v_NxKxSxE: jax.Array, valid_NxS: jax.Array, slot: jax.Array,
             layer: jax.Array | None = None, attend: int | None = None
             ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    attn_out, kv = self.self_attn.decode(self.input_layernorm(x_Nx1xD), positions_Nx1,
                                         k_NxKxExS, v_NxKxSxE, valid_NxS, slot, layer, attend)
    return self._finish(x_Nx1xD, attn_out), kv

  def decode_paged(self, x_Nx1xD, positions_Nx1, k_pool, v_pool, cache, app, layer=None,
                   impl: str = "auto"):
    attn_out, kv = self.self_attn.decode_paged(self.input_layernorm(x_Nx1xD), positions_Nx1,
                                               k_pool, v_pool, cache, app, layer, impl)
    return self._finish(x_Nx1xD, attn_out), kv

  def _finish(self, x_Nx1xD, attn_out):
    x_Nx1xD = x_Nx1xD + attn_out
    x_Nx1xD = x_Nx1xD + self.mlp(self.post_attention_layernorm(x_Nx1xD))
    return constrain(x_Nx1xD, ("batch", "length", "act_embed"))


def _layer_apply(layer, x, positions, mask):
  return layer(x, positions, mask)[0]


def stack_layers(layers: list[DecoderLayer]) -> DecoderLayer:
  """One DecoderLayer holding `layers`' parameters stacked on a leading axis whose logical name
  is "layers" (unsharded by every rules table); layer l is index l of each parameter."""
  graphdef, first = nnx.split(layers[0])
  states = [first] + [nnx.split(layer)[1] for layer in layers[1:]]

  def stack(*variables):
    axes = variables[0].get_metadata().get("logical_axes") or ()
    return variables[0].replace(jnp.stack([v[...] for v in variables]),
                                logical_axes=(LAYERS_AXIS,) + tuple(axes))

  return nnx.merge(graphdef, jax.tree.map(stack, *states, is_leaf=_is_variable))


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


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
  """Qwen2.5 / Qwen3 causal LM: ``model(input_ids) -> logits [B, T, V]``."""

  def __init__(self, config: Qwen2Config, *, rngs: nnx.Rngs):
    self.config = config
    cfg, pd = config, config.jnp_param_dtype
    init = nnx.initializers.normal(_INIT_STD)
    self.embed_tokens = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.hidden_size), pd),
                                  logical_axes=("vocab", "embed"))
    layers = [DecoderLayer(cfg, rngs) for _ in range(cfg.num_hidden_layers)]
    # Built one by one either way, so a seed gives the same weights in both layouts.
    self.layers = stack_layers(layers) if cfg.scan_layers else nnx.List(layers)
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

  @scoped("lm_head")
  def logits_from_hidden(self, h_BxTxD: jax.Array) -> jax.Array:
    """fp32 logits; the matmul runs in the compute dtype with fp32 accumulation."""
    w = self.lm_head_kernel().astype(h_BxTxD.dtype)
    return jnp.einsum("btd,dv->btv", h_BxTxD, w, preferred_element_type=jnp.float32)

  def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> KVCache:
    """An empty cache (every slot invalid), e.g. JetStream's decode slots; stored as
    `config.kv_cache_dtype` says (8-bit: models/kv_quant.py) unless `dtype` is given."""
    cfg = self.config
    return KVCache.zeros(cfg.num_hidden_layers, batch_size, max_length, cfg.num_key_value_heads,
                         cfg.dim_per_head, dtype or cfg.kv_dtype, stacked=cfg.scan_layers)

  def _scan_layers(self, body, carry, xs=None, policy=None):
    """``body(layer, carry, x) -> (carry, y)`` over the stacked layer (`config.scan_layers`)
    with one `jax.lax.scan`; a `policy` rematerialises each scanned step under it (what the
    backward pass keeps of each layer, as in the unrolled loop). Returns (carry, stacked ys)."""
    graphdef, state = nnx.split(self.layers)

    def step(carry, state_and_x):
      layer_state, x = state_and_x
      return body(nnx.merge(graphdef, layer_state), carry, x)

    if policy is not None:
      step = jax.checkpoint(step, policy=policy, prevent_cse=False)
    return jax.lax.scan(step, carry, (state, xs))

  def hidden_states(self, input_ids_BxT: jax.Array, positions_BxT: jax.Array | None = None,
                    attention_mask_BxT: jax.Array | None = None, *, with_cache: bool = False,
                    segment_ids_BxT: jax.Array | None = None
                    ) -> tuple[jax.Array, KVCache | None]:
    """Final-norm hidden states [B, T, D] of a causal pass over T tokens, and (`with_cache`) a
    T-slot KVCache of its keys and values, valid where the mask is (see `prefill`).

    `segment_ids_BxT` (packed rows, trainer/packing.py): several sequences a row, each attending
    within itself; 0 marks padding, and the mask defaults to ``segment_ids > 0``. Positions
    must then restart per sequence (the packer's)."""
    cfg = self.config
    b, t = input_ids_BxT.shape
    if attention_mask_BxT is None:
      attention_mask_BxT = (jnp.ones((b, t), bool) if segment_ids_BxT is None
                            else segment_ids_BxT > 0)
    attention_mask_BxT = attention_mask_BxT.astype(bool)
    if positions_BxT is None:
      if segment_ids_BxT is not None:
        raise ValueError("Packed rows (segment_ids) need their per-sequence positions.")
      positions_BxT = default_positions(attention_mask_BxT)
    # Query t at key slot t: the structure the fused kernels take (attention.Mask).
    mask = attention.causal_mask(attention_mask_BxT, segment_ids_BxT)

    x = jnp.take(self.embed_tokens.value, input_ids_BxT, axis=0).astype(cfg.jnp_dtype)
    x = constrain(x, ("batch", "length", "act_embed"))
    if cfg.scan_layers:
      def body(layer, x, _):
        return layer(x, positions_BxT, mask, with_kv=with_cache)
      if with_cache:  # a prefill: no backward pass, so no remat
        x, (ks, vs) = self._scan_layers(body, x)
        return self.norm(x), KVCache.from_pass(ks, vs, attention_mask_BxT, cfg.kv_dtype)
      x, _ = self._scan_layers(body, x, policy=REMAT_POLICIES[cfg.remat])
      return self.norm(x), None
    if with_cache:  # a prefill: no backward pass, so no remat
      ks, vs = [], []
      for layer in self.layers:
        x, (k_BxTxKxE, v_BxTxKxE) = layer(x, positions_BxT, mask, with_kv=True)
        ks.append(k_BxTxKxE)
        vs.append(v_BxTxKxE)
      return self.norm(x), KVCache.from_pass(ks, vs, attention_mask_BxT, cfg.kv_dtype)
    for layer in self.layers:
      if cfg.remat == "none":
        x = _layer_apply(layer, x, positions_BxT, mask)
        continue
      # jax.checkpoint over the layer's state, as the scanned path does: nnx.remat would write
      # the layer's variables back, and a LoRA step's frozen base (traced outside the gradient)
      # cannot be written from inside it (TraceContextError).
      graphdef, state = nnx.split(layer)
      apply = lambda s, h, g=graphdef: _layer_apply(nnx.merge(g, s), h, positions_BxT, mask)
      x = jax.checkpoint(apply, policy=REMAT_POLICIES[cfg.remat])(state, x)
    return self.norm(x), None

  @scoped("prefill")
  def prefill(self, input_ids_BxP: jax.Array, positions_BxP: jax.Array,
              attention_mask_BxP: jax.Array) -> tuple[jax.Array, KVCache]:
    """Hidden states [B, P, D] of the prompts and their P-slot cache (index P on every row).

    The attention is the full-pass kernel (`config.attention_impl`); only the one-token steps
    after it take the cache path.
    """
    return self.hidden_states(input_ids_BxP, positions_BxP, attention_mask_BxP, with_cache=True)

  @scoped("decode_step")
  def decode_step(self, tokens_N: jax.Array, positions_N: jax.Array, cache: KVCache, *,
                  same_slot: bool = False, attend: int | None = None
                  ) -> tuple[jax.Array, KVCache]:
    """Feeds one token per row at slot ``cache.index``; returns fp32 logits [N, V].

    `same_slot`: every row sits at ``cache.index[0]`` (a static batch), so each layer's write is
    one in-place dynamic_update_slice instead of a per-row scatter. A row whose index is past
    the end overwrites its last slot. `attend`: attention reads only the first `attend` cache
    slots (every row's index must be below it), as if the cache were that long.
    """
    cfg = self.config
    slot = cache.index[0] if same_slot else cache.index
    valid_NxS = kv_cache.mark_valid(cache.valid, slot)
    pos_Nx1 = positions_N[:, None]
    x_Nx1xD = self._embed_step(tokens_N)
    if cfg.scan_layers:
      def body(layer, carry, l):
        x_Nx1xD, k, v = carry
        x_Nx1xD, (k, v) = layer.decode(x_Nx1xD, pos_Nx1, k, v, valid_NxS, slot, l, attend)
        return (x_Nx1xD, k, v), None
      (x_Nx1xD, k_LxNxKxExS, v_LxNxKxSxE), _ = self._scan_layers(
          body, (x_Nx1xD, cache.k, cache.v), jnp.arange(cfg.num_hidden_layers))
      logits_NxV = self.logits_from_hidden(self.norm(x_Nx1xD))[:, 0]
      return logits_NxV, KVCache(k=k_LxNxKxExS, v=v_LxNxKxSxE, valid=valid_NxS,
                                 index=cache.index + 1)
    new_k, new_v = [], []
    for layer, k_NxKxExS, v_NxKxSxE in zip(self.layers, cache.k, cache.v):
      x_Nx1xD, (k_NxKxExS, v_NxKxSxE) = layer.decode(x_Nx1xD, pos_Nx1, k_NxKxExS, v_NxKxSxE,
                                                     valid_NxS, slot, attend=attend)
      new_k.append(k_NxKxExS)
      new_v.append(v_NxKxSxE)
    logits_NxV = self.logits_from_hidden(self.norm(x_Nx1xD))[:, 0]
    return logits_NxV, KVCache(k=tuple(new_k), v=tuple(new_v), valid=valid_NxS,
                               index=cache.index + 1)

  def _embed_step(self, tokens_N: jax.Array) -> jax.Array:
    """One decode step's input: each slot's token embedded, [N, 1, D] in the compute dtype."""
    x_Nx1xD = jnp.take(self.embed_tokens.value, tokens_N[:, None], axis=0)
    return constrain(x_Nx1xD.astype(self.config.jnp_dtype), ("batch", "length", "act_embed"))

  @scoped("decode_step")
  def decode_step_paged(self, tokens_N: jax.Array, positions_N: jax.Array, cache: PagedKVCache,
                        active_N: jax.Array, *, impl: str = "auto"
                        ) -> tuple[jax.Array, PagedKVCache, paged_kv.Append]:
    """`decode_step` over a paged cache (models/paged_kv.py): each active slot's token is
    written at its next position (a fresh page, or its own copy of a shared prompt page) and
    attention reads only live pages (`paged_attention`, kernel by `impl`). Returns fp32 logits
    [N, V], the cache (lengths counted) and the `Append`: a slot with ``out_of_pages`` wrote
    nothing and its logits are not to be used."""
    cfg = self.config
    cache, app = paged_kv.on_shards(paged_kv.reserve_append, cache, active_N)
    pos_Nx1 = positions_N[:, None]
    x_Nx1xD = self._embed_step(tokens_N)
    if cfg.scan_layers:
      def body(layer, carry, l):
        x_Nx1xD, k, v = carry
        x_Nx1xD, (k, v) = layer.decode_paged(x_Nx1xD, pos_Nx1, k, v, cache, app, l, impl)
        return (x_Nx1xD, k, v), None
      (x_Nx1xD, k, v), _ = self._scan_layers(body, (x_Nx1xD, cache.k, cache.v),
                                             jnp.arange(cfg.num_hidden_layers))
    else:
      k, v = [], []
      v_pools = (None,) * len(cache.k) if cache.combined else cache.v
      for layer, k_pool, v_pool in zip(self.layers, cache.k, v_pools):
        x_Nx1xD, (k_pool, v_pool) = layer.decode_paged(x_Nx1xD, pos_Nx1, k_pool, v_pool, cache,
                                                       app, impl=impl)
        k.append(k_pool)
        v.append(v_pool)
      k, v = tuple(k), (None if cache.combined else tuple(v))
    logits_NxV = self.logits_from_hidden(self.norm(x_Nx1xD))[:, 0]
    return logits_NxV, paged_kv.on_shards(paged_kv.commit_append, cache.replace(k=k, v=v),
                                          app), app

  def init_paged_cache(self, num_slots: int, num_pages: int, page_size: int,
                       max_pages_per_slot: int, dtype: Any = None, shards: int | None = None,
                       combined: bool = False) -> PagedKVCache:
    """An empty paged cache: every page free, every slot empty (`shards`: S pools of
    `num_pages`; `combined`: K and V in one pool, the ragged kernel's; `PagedKVCache`)."""
    cfg = self.config
    return PagedKVCache.zeros(num_layers=cfg.num_hidden_layers, num_slots=num_slots,
                              num_pages=num_pages, page_size=page_size,
                              max_pages_per_slot=max_pages_per_slot,
                              kv_heads=cfg.num_key_value_heads, head_dim=cfg.dim_per_head,
                              dtype=dtype or cfg.kv_dtype, stacked=cfg.scan_layers,
                              shards=shards, combined=combined)

  def __call__(self, input_ids_BxT: jax.Array, positions_BxT: jax.Array | None = None,
               attention_mask_BxT: jax.Array | None = None) -> jax.Array:
    """Logits [B, T, V] in fp32."""
    h, _ = self.hidden_states(input_ids_BxT, positions_BxT, attention_mask_BxT)
    return self.logits_from_hidden(h)
