"""LoRA export: the adapters as a peft adapter directory that peft loads onto the HF base."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dapo_jax.checkpoints import peft_adapter
from dapo_jax.checkpoints.hf import load_pretrained
from dapo_jax.models import lora

pytest.importorskip("transformers")
from tests import hf_fixtures  # pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.mark.parametrize("scan,family", [(True, "qwen2"), (True, "qwen3")])
def test_peft_adapter_loads_onto_the_hf_base_with_our_logits(tmp_path, scan, family):
  """Qwen3 (QK-norm, no q/k/v bias, head_dim 24 != 64 / 4) has Qwen2's module names, so the
  same target_modules land on Qwen3ForCausalLM's projections."""
  peft = pytest.importorskip("peft")
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  extra = {"head_dim": 24} if family == "qwen3" else {}
  base = hf_fixtures.write_tiny_qwen2(str(tmp_path / "base"), seed=4, family=family, **extra)
  model = load_pretrained(base, dtype="float32", scan_layers=scan)
  lcfg = lora.LoRAConfig(rank=3, alpha=6.0, targets=("q", "o", "down", "*.mlp.gate_proj"))
  lora.add_adapters(model, lcfg, seed=2)
  graphdef, adapters, rest = nnx.split(model, lora.Adapter, ...)
  keys = iter(jax.random.split(jax.random.key(0), 100))
  # Trained-looking adapters: B away from 0, so every factor's layout matters.
  adapters = jax.tree.map(lambda x: x + 0.2 * jax.random.normal(next(keys), x.shape), adapters)
  ids = np.random.RandomState(0).randint(0, 128, (2, 9))
  ours = np.asarray(nnx.merge(graphdef, adapters, rest)(jnp.asarray(ids)))
  out = str(tmp_path / "adapter")
  cfg = peft_adapter.save_peft_adapter(adapters, lcfg, out, base_model=base)
  assert cfg["target_modules"] == ["down_proj", "gate_proj", "o_proj", "q_proj"]
  hf = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32,
                                                         attn_implementation="eager").eval()
  assert type(hf).__name__ == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
  plain = hf(torch.tensor(ids)).logits.detach().numpy()
  with_adapter = peft.PeftModel.from_pretrained(hf, out).eval()
  with torch.no_grad():
    theirs = with_adapter(torch.tensor(ids)).logits.numpy()
  assert np.abs(plain - ours).max() > 1e-2  # the adapters change the function
  np.testing.assert_allclose(theirs, ours, atol=2e-4)
