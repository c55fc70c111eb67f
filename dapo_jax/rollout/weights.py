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


class MergedRolloutWeights(RolloutWeights):
  """A LoRA run's policy as the rollout reads it: the frozen base with the trained adapters
  merged in (``W + alpha / rank * A @ B``, models/lora.py), cast to the model's dtype and laid
  out for the rollout, once per training step. The samplers then decode a plain model: nothing
  adapter-specific runs per token. ``base`` is the train state's ``rest`` (the trainer keeps it
  current: it is never donated or replaced by a step).
  """

  def __init__(self, dtype: Any, mesh: Mesh | None, scale: float, base: Any = None):
    super().__init__(dtype, mesh)
    self.scale, self.base = scale, base

  def __call__(self, adapters):
    if self._fn is None:
      from dapo_jax.models import lora  # pylint: disable=g-import-not-at-top
      def merge(adapters, base):
        return cast_params(lora.merge_adapters(base, adapters, self.scale), self.dtype)
      out = (None if self.mesh is None else shd.state_shardings(
          jax.eval_shape(merge, adapters, self.base), self.mesh, shd.SAMPLE_RULES))
      self._fn = jax.jit(merge, out_shardings=out)
    return self._fn(adapters, self.base)
