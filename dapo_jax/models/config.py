"""Qwen2 / Qwen2.5 / Qwen3 (dense) hyperparameters, read from and written to HF ``config.json``.

One decoder covers both families; Qwen3 differs only in fields of this config (transformers'
``Qwen3ForCausalLM``): ``qk_norm`` (an RMSNorm over each head's queries and keys before RoPE),
``attention_bias`` False (no q/k/v bias), an explicit ``head_dim`` (128 where hidden / heads is
64 on the 0.6B), tied embeddings on the small models and ``rope_theta`` 1e6.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax.numpy as jnp

from dapo_jax.models import kv_quant

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
# model_type -> the architecture `to_hf` writes for it.
_ARCHITECTURE = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Per-layer remat (qwen2.REMAT_POLICIES): what the backward pass keeps from each layer's forward.
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "dots_attn")
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "splash")


@dataclasses.dataclass(frozen=True)
class Qwen2Config:
  """Hyperparameters of a Qwen2-architecture decoder (Qwen2.5, Qwen2.5-Math; Qwen3 dense with
  ``qk_norm=True, attention_bias=False``)."""
  vocab_size: int = 151936
  hidden_size: int = 896
  intermediate_size: int = 4864
  num_hidden_layers: int = 24
  num_attention_heads: int = 14
  num_key_value_heads: int = 2
  head_dim: int = 0  # 0: hidden_size // num_attention_heads (as in every Qwen2.5 checkpoint).
  attention_bias: bool = True  # bias on q/k/v (Qwen2: always; Qwen3: config.json's, false)
  qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE (q_norm, k_norm)
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = True
  max_position_embeddings: int = 32768
  bos_token_id: int | None = 151643
  eos_token_id: int | None = 151643
  # Run-time options (not part of the checkpoint).
  param_dtype: str = "float32"
  dtype: str = "float32"  # compute dtype; log-probs and the loss are always computed in fp32.
  remat: str = "none"  # per-layer rematerialisation policy, one of REMAT_POLICIES.
  attention_impl: str = "xla"  # one of ATTENTION_IMPLS; "auto" picks by platform.
  # One DecoderLayer whose parameters are stacked [layers, ...] and run by `jax.lax.scan`: XLA
  # compiles one layer instead of num_hidden_layers copies (compile time flat in depth). The
  # checkpoint layout differs (orbax paths), the HF export does not.
  scan_layers: bool = False
  # The decode caches' storage (rollout.kv_cache_dtype): "" (the compute dtype), the compute
  # dtype, or an 8-bit one, "int8" / "float8_e4m3fn", with a scale per token and KV head
  # (models/kv_quant.py). Only the caches read it: full-sequence passes never quantize.
  kv_cache_dtype: str = ""

  def __post_init__(self):
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
          f"num_attention_heads={self.num_attention_heads} must be a multiple of "
          f"num_key_value_heads={self.num_key_value_heads}.")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat={self.remat!r}; choose one of {REMAT_POLICIES}.")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"attention_impl={self.attention_impl!r}; choose one of {ATTENTION_IMPLS}.")
    if not (self.qk_norm or self.attention_bias):
      raise ValueError("attention_bias=False needs qk_norm=True: Hugging Face's Qwen2 always has "
                       "q/k/v biases, so only a Qwen3 (qk_norm) decoder may drop them.")
    for name in ("param_dtype", "dtype"):
      if getattr(self, name) not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"{name}={getattr(self, name)!r}; use float32, bfloat16 or float16.")
    kv_quant.resolve(self.kv_cache_dtype, self.dtype)  # raises on an unknown value

  @property
  def dim_per_head(self) -> int:
    return self.head_dim or self.hidden_size // self.num_attention_heads

  @property
  def model_type(self) -> str:
    """The HF family: "qwen3" when the heads are normalised (q_norm, k_norm), else "qwen2"."""
    return "qwen3" if self.qk_norm else "qwen2"

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def kv_dtype(self):
    """The KV caches' storage dtype (`kv_quant.resolve`)."""
    return kv_quant.resolve(self.kv_cache_dtype, self.dtype)

  @property
  def jnp_param_dtype(self):
    return jnp.dtype(self.param_dtype)

  def replace(self, **kwargs) -> "Qwen2Config":
    return dataclasses.replace(self, **kwargs)

  def num_params(self) -> int:
    """Exact parameter count (embeddings counted once when tied)."""
    d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
    hd, h, k = self.dim_per_head, self.num_attention_heads, self.num_key_value_heads
    bias = (h + 2 * k) * hd if self.attention_bias else 0
    qk_norm = 2 * hd if self.qk_norm else 0
    attn = d * h * hd + 2 * d * k * hd + h * hd * d + bias + qk_norm
    layer = attn + 3 * d * f + 2 * d
    head = 0 if self.tie_word_embeddings else d * v
    return v * d + self.num_hidden_layers * layer + d + head

  @classmethod
  def from_hf(cls, hf: dict[str, Any] | str | os.PathLike, **overrides) -> "Qwen2Config":
    """From a HF ``config.json`` dict, file or checkpoint directory."""
    if not isinstance(hf, dict):
      path = os.fspath(hf)
      if os.path.isdir(path):
        path = os.path.join(path, "config.json")
      if not os.path.exists(path):
        raise FileNotFoundError(f"No config.json at {path}: is this a Hugging Face checkpoint?")
      with open(path) as f:
        hf = json.load(f)
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type") or "qwen2"
    if model_type not in _ARCHITECTURE or (
        archs and not set(archs) & set(SUPPORTED_ARCHITECTURES)):
      raise ValueError(
          f"Unsupported architecture {archs or hf.get('model_type')!r}: dapo_jax loads "
          f"{SUPPORTED_ARCHITECTURES} (model_type 'qwen2' or 'qwen3'), which covers Qwen2, "
          "Qwen2.5 and the dense Qwen3 models (not Qwen3-MoE).")
    qwen3 = model_type == "qwen3"
    if hf.get("use_sliding_window"):
      raise ValueError("Sliding-window attention (use_sliding_window=true) is not supported.")
    rope_theta = hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 1e6))
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):
      eos = eos[0]
    head_dim = hf.get("head_dim") or 0  # transformers>=5 omits it when it is the default
    kwargs = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
        # 0 means the default hidden/heads, so configs compare equal whether or not it is written.
        head_dim=0 if head_dim == hf["hidden_size"] // hf["num_attention_heads"] else head_dim,
        # transformers' Qwen2 always has the q/k/v bias (its config.json has no such key).
        attention_bias=bool(hf.get("attention_bias", False)) if qwen3 else True,
        qk_norm=qwen3,
        rope_theta=float(rope_theta),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos,
    )
    kwargs.update(overrides)
    return cls(**kwargs)

  def to_hf(self, torch_dtype: str | None = None) -> dict[str, Any]:
    """A ``config.json`` dict that ``transformers`` loads as ``Qwen2ForCausalLM`` (or
    ``Qwen3ForCausalLM`` with ``qk_norm``)."""
    extra = {"attention_bias": self.attention_bias} if self.qk_norm else {}
    return {
        "architectures": [_ARCHITECTURE[self.model_type]],
        "model_type": self.model_type,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_hidden_layers,
        "num_attention_heads": self.num_attention_heads,
        "num_key_value_heads": self.num_key_value_heads,
        "head_dim": self.dim_per_head,
        "hidden_act": "silu",
        "rope_theta": self.rope_theta,
        "rms_norm_eps": self.rms_norm_eps,
        "tie_word_embeddings": self.tie_word_embeddings,
        "max_position_embeddings": self.max_position_embeddings,
        "bos_token_id": self.bos_token_id,
        "eos_token_id": self.eos_token_id,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "torch_dtype": torch_dtype or self.param_dtype,
        **extra,
    }
