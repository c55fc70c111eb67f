"""The policy as the rollout reads it: trained params cast and moved once per training step."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from dapo_jax import sharding as shd
from dapo_jax.models import cast_params


class RolloutWeights:
  """The policy as the rollout reads it: the trained params (fp32 master weights of a bf16
  model) cast to the model's dtype, then moved to the rollout layout.

  The cast happens first, on each device's training shard, so the move carries the model's
  bytes, never the fp32 copy: this is the reshard ``dapo-plan`` compiles and prices. The trainer
  makes one copy per step, shared by every rollout call (``rollout.prompts_per_call``) and
  evaluation of that step, and drops it before the update.
  """

  def __init__(self, dtype: Any, mesh: Mesh | None):
    self.dtype, self.mesh = dtype, mesh
    self._fn = None

  def __call__(self, params):
    floats = [x for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)]
    if self.mesh is None and all(x.dtype == self.dtype for x in floats):
      return params  # one device, already the model's dtype: nothing to cast or move
    if self._fn is None:
      cast = functools.partial(cast_params, dtype=self.dtype)
      out = (None if self.mesh is None else
             shd.state_shardings(params, self.mesh, shd.SAMPLE_RULES))
      self._fn = jax.jit(cast, out_shardings=out)
    return self._fn(params)
