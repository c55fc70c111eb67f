"""dapo_jax: DAPO reinforcement learning for LLMs in JAX / Flax NNX."""

__version__ = "0.1.0"
