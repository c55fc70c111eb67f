"""Model construction without ever materialising a full-size model on one device.

``abstract_model`` traces the constructor with ``nnx.eval_shape`` (no memory); ``create_model``
then runs the initialiser under ``jax.jit`` with ``out_shardings``, so each device only ever holds
its own shard of every parameter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from dapo_jax.infra import sharding as shd
from dapo_jax.models.config import Qwen2Config
from dapo_jax.models.qwen2 import Qwen2ForCausalLM


def abstract_model(config: Qwen2Config) -> Qwen2ForCausalLM:
  """A model whose parameters are ``ShapeDtypeStruct``s (no allocation)."""
  return nnx.eval_shape(lambda: Qwen2ForCausalLM(config, rngs=nnx.Rngs(0)))


def create_model(config: Qwen2Config, seed: int = 0, mesh: Mesh | None = None,
                 rules: shd.Rules = shd.TRAIN_RULES) -> Qwen2ForCausalLM:
  """A randomly initialised model, created directly in its sharded layout when ``mesh`` is set."""
  if mesh is None:
    return Qwen2ForCausalLM(config, rngs=nnx.Rngs(seed))
  graphdef, abstract_state = nnx.split(abstract_model(config))
  out_shardings = shd.state_shardings(abstract_state, mesh, rules)

  @jax.jit
  def init():
    return nnx.state(Qwen2ForCausalLM(config, rngs=nnx.Rngs(seed)))

  init = jax.jit(init.__wrapped__, out_shardings=out_shardings)
  return nnx.merge(graphdef, init())


def shard_model(model: Qwen2ForCausalLM, mesh: Mesh, rules: shd.Rules = shd.TRAIN_RULES,
                donate: bool = False) -> Qwen2ForCausalLM:
  """The same model with its parameters moved to the layout ``rules`` gives on ``mesh``."""
  graphdef, state = nnx.split(model)
  shardings = shd.state_shardings(state, mesh, rules)
  return nnx.merge(graphdef, shd.reshard(state, shardings, donate=donate))


def cast_params(params: nnx.State, dtype: str | jnp.dtype) -> nnx.State:
  """Floating-point params in `dtype` (others as they are); a no-op where already so.

  With fp32 master weights, a rollout reads half the bytes per decode step from a
  `cast_params(state.params, model.config.param_dtype)` copy made once per rollout step.
  """
  dtype = jnp.dtype(dtype)
  def one(x):
    return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype else x
  return jax.tree.map(one, params)
