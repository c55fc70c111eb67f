"""dapo_jax: DAPO reinforcement learning for LLMs in JAX / Flax NNX."""

__version__ = "0.1.0"


def load_pretrained(*args, **kwargs):
  """Loads a HF Qwen2 / Qwen2.5 checkpoint; see ``dapo_jax.checkpoints.hf.load_pretrained``."""
  from dapo_jax.checkpoints.hf import load_pretrained as _load  # pylint: disable=g-import-not-at-top
  return _load(*args, **kwargs)
