"""Qwen2.5 policy models."""

from dapo_jax.models.config import Qwen2Config
from dapo_jax.models.presets import PRESETS, get_preset
from dapo_jax.models.kv_cache import KVCache
from dapo_jax.models.qwen2 import Qwen2ForCausalLM, default_positions
from dapo_jax.models.init import abstract_model, cast_params, create_model, shard_model
