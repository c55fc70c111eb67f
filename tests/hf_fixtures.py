"""Tiny random Qwen2 / Qwen3 checkpoints written by ``transformers`` (the reference)."""

from __future__ import annotations

import os

import numpy as np

TINY_HF = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               rms_norm_eps=1e-6, rope_theta=10000.0)


def write_tiny_qwen2(out_dir: str, *, tie: bool = False, seed: int = 0, family: str = "qwen2",
                     **overrides) -> str:
  """Saves a random ``Qwen2ForCausalLM`` (``family="qwen3"``: ``Qwen3ForCausalLM``, QK-norm
  scales randomised too; pass ``head_dim`` for one other than hidden / heads); biases and
  norm scales randomised too."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  torch.manual_seed(seed)
  config_cls, model_cls = {
      "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
      "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[family]
  cfg = config_cls(**{**TINY_HF, **overrides}, tie_word_embeddings=tie,
                   attn_implementation="eager")
  model = model_cls(cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("bias"):
        p.normal_(0.0, 0.1)
      elif "norm" in name:
        p.uniform_(0.5, 1.5)
      else:
        p.normal_(0.0, 0.05)
  os.makedirs(out_dir, exist_ok=True)
  model.save_pretrained(out_dir, safe_serialization=True)
  return out_dir


def hf_logits(ckpt_dir: str, input_ids: np.ndarray, attention_mask: np.ndarray | None = None,
              positions: np.ndarray | None = None) -> np.ndarray:
  """Reference fp32 logits from ``transformers`` for the checkpoint at ``ckpt_dir``."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  # Auto: the class config.json names (a Qwen3 directory read as Qwen2 would drop its q/k norms).
  model = transformers.AutoModelForCausalLM.from_pretrained(
      ckpt_dir, torch_dtype=torch.float32, attn_implementation="eager").eval()
  kwargs = {}
  if attention_mask is not None:
    kwargs["attention_mask"] = torch.tensor(np.asarray(attention_mask), dtype=torch.long)
  if positions is not None:
    kwargs["position_ids"] = torch.tensor(np.asarray(positions), dtype=torch.long)
  with torch.no_grad():
    out = model(torch.tensor(np.asarray(input_ids), dtype=torch.long), **kwargs)
  return out.logits.float().numpy()
