"""A LoRA run's adapters as a peft adapter directory (``dapo-export --peft``).

    save_peft_adapter(adapters, lcfg, out_dir, base_model="Qwen/Qwen2.5-Math-7B")
    # then, in PyTorch: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out)

Writes ``adapter_config.json`` and ``adapter_model.safetensors`` with peft's tensor names
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``: A as [r, in], B as
[out, r], HF's ``nn.Linear`` layout). Our A is [*in, r] and B [r, *out] over the kernel's
multi-axis in/out shapes (q: out (heads, head_dim); o: in (heads, head_dim)), flattened in the
order HF flattens them; a scanned model's stacked "layers" axis is split into one entry per layer.
peft scales by ``lora_alpha / r`` as we do.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
from flax import nnx

from dapo_jax.checkpoints.hf import hf_name
from dapo_jax.models import lora

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def peft_tensors(adapters: nnx.State) -> dict[str, np.ndarray]:
  """peft tensor name -> fp32 array, for every adapter in ``adapters`` (an `Adapter` state)."""
  out = {}
  for path, var in nnx.to_flat_state(adapters):
    x = np.asarray(var.value, np.float32)
    axes = var.get_metadata().get("logical_axes") or ()
    stacked = bool(axes) and axes[0] == "layers"
    per_layer = ([(path[:1] + (i,) + path[1:], x[i]) for i in range(x.shape[0])] if stacked
                 else [(path, x)])
    for p, w in per_layer:
      module = hf_name(p[:-1] + ("kernel",))[:-len(".weight")]
      if p[-1] == "lora_a":  # [*in, r] -> [r, in]
        key, w = "lora_A", w.reshape(-1, w.shape[-1]).T
      else:  # [r, *out] -> [out, r]
        key, w = "lora_B", w.reshape(w.shape[0], -1).T
      out[f"base_model.model.{module}.{key}.weight"] = np.ascontiguousarray(w)
  return out


def save_peft_adapter(adapters: nnx.State, lcfg: lora.LoRAConfig, out_dir: str, *,
                      base_model: str = "") -> dict[str, Any]:
  """Writes the adapter directory; returns its adapter_config.json."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  tensors = peft_tensors(adapters)
  modules = sorted({name.split(".")[-3] for name in tensors})
  config = {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
      "r": lcfg.rank, "lora_alpha": lcfg.alpha, "target_modules": modules,
      "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
      "inference_mode": True, "init_lora_weights": True,
  }
  os.makedirs(out_dir, exist_ok=True)
  save_file(tensors, os.path.join(out_dir, WEIGHTS_FILE), metadata={"format": "pt"})
  with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
    json.dump(config, f, indent=2)
  return config
