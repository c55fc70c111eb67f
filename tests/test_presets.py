"""Presets: public parameter counts from abstract shapes (nothing allocated), config round trips."""

import jax
import pytest
from flax import nnx

from dapo_jax.models import Qwen2Config, abstract_model, get_preset, PRESETS


def _count(cfg):
  state = nnx.state(abstract_model(cfg))
  leaves = jax.tree.leaves(state)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)  # abstract: no memory
  return sum(x.size for x in leaves)


@pytest.mark.parametrize("name,expected,tol", [
    ("qwen2.5-32b", 32_763_876_352, 0),  # the public Qwen2.5-32B count
    ("qwen2.5-0.5b", 494_032_768, 0),  # the public Qwen2.5-0.5B count (tied embeddings)
    ("qwen2.5-7b", 7.62e9, 0.01e9),
    ("qwen2.5-72b", 72.7e9, 0.1e9),
    ("qwen2.5-math-1.5b", 1.54e9, 0.01e9),
    # Qwen3 model cards: 0.6B (0.44B non-embedding; head_dim 128, not 1024 / 16), 8.2B (6.95B).
    ("qwen3-0.6b", 0.596e9, 0.001e9),
    ("qwen3-8b", 8.19e9, 0.01e9),
])
def test_abstract_parameter_counts(name, expected, tol):
  cfg = get_preset(name)
  n = _count(cfg)
  assert abs(n - expected) <= tol, f"{name}: {n:,}"
  assert n == cfg.num_params()


def test_hf_config_round_trip():
  for name, cfg in PRESETS.items():
    back = Qwen2Config.from_hf(cfg.to_hf())
    assert back == cfg, name


def test_bad_values_raise():
  with pytest.raises(KeyError, match="Unknown model preset"):
    get_preset("qwen9")
  with pytest.raises(ValueError, match="remat"):
    get_preset("test", remat="sometimes")
  with pytest.raises(ValueError, match="multiple of"):
    get_preset("test", num_key_value_heads=3)
  with pytest.raises(ValueError, match="Unsupported architecture"):
    Qwen2Config.from_hf({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
