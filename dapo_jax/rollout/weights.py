"""The policy as the rollout reads it: trained params cast and moved once per training step."""

from __future__ import annotations

import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from dapo_jax.infra import sharding as shd
from dapo_jax.models import cast_params

_log = logging.getLogger(__name__)


class RolloutWeights:
  """The policy as the rollout reads it: the trained params (fp32 master weights of a bf16
  model) cast to the model's dtype, then moved to the rollout layout.

  The cast happens first, on each device's training shard, so the move carries the model's
  bytes, never the fp32 copy: this is the reshard ``dapo-plan`` compiles and prices. The trainer
  makes one copy per step, shared by every rollout call (``rollout.prompts_per_call``) and
  evaluation of that step, and drops it before the update.

  The hand-off has two halves: `send` (the trainer's side: what crosses to the rollout's
  devices, or to a rollout process of its own) and `receive` (the rollout's side: what the
  samplers read, made from what crossed). Calling the object does both.
  """

  def __init__(self, dtype: Any, mesh: Mesh | None):
    self.dtype, self.mesh = dtype, mesh
    self._fn = None

  def __call__(self, params):
    return self.receive(self.send(params))

  def receive(self, moved: Any) -> Any:
    """The rollout's weights from what `send` moved: the same tree."""
    return moved

  def send(self, params):
    """``params`` cast to the model's dtype in the rollout layout: every weight crosses."""
    floats = [x for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)]
    if self.mesh is None and all(x.dtype == self.dtype for x in floats):
      return params  # one device, already the model's dtype: nothing to cast or move
    if self._fn is None:
      out = (None if self.mesh is None else
             shd.state_shardings(params, self.mesh, shd.SAMPLE_RULES))
      self._fn = _cast_and_move(self.dtype, out, params)
    return self._fn(params)


class MergedRolloutWeights(RolloutWeights):
  """A LoRA run's policy as the rollout reads it: the frozen base with the trained adapters
  merged in (``W + alpha / rank * A @ B``, models/lora.py), in the model's dtype and the rollout
  layout, once per training step. The samplers then decode a plain model: nothing
  adapter-specific runs per token. ``base`` is the train state's ``rest`` (never donated or
  replaced by a step).

  Only adapter bytes move per step. When the base's training layout is not the rollout layout
  (a ``config.rollout_mesh``, or ``SAMPLE_RULES`` replicating what training splits over
  ``fsdp``), a copy of the base in the rollout layout is made on the first call and kept for
  the run (``resident_bytes`` per device). Each step then moves the adapters (fp32) to the
  rollout layout and merges there. The merged copy holds new arrays for the adapted kernels
  only; every other leaf (embeddings, norms, biases) is the rollout base's own array.
  """

  def __init__(self, dtype: Any, mesh: Mesh | None, scale: float, base: Any = None):
    super().__init__(dtype, mesh)
    self.scale = scale
    self._base = self._rollout_base = None
    self.base = base

  @property
  def base(self) -> Any:
    return self._base

  @base.setter
  def base(self, base: Any) -> None:
    """A new base (``Run.fresh_optimizer``) gets its rollout copy on the next call."""
    self._base, self._rollout_base = base, None

  def rollout_shardings(self, tree: Any) -> Any:
    """``tree``'s rollout layout; None (wherever it is) on one device."""
    return None if self.mesh is None else shd.state_shardings(tree, self.mesh, shd.SAMPLE_RULES)

  def rollout_base(self) -> Any:
    """The base in the model's dtype and the rollout layout: the train state's own arrays when
    they are laid out so already, else the resident copy (made once)."""
    if self._rollout_base is None:
      base, want = self._base, self.rollout_shardings(self._base)
      same = want is None or all(
          x.sharding.is_equivalent_to(s, x.ndim)
          for x, s in zip(jax.tree.leaves(base), jax.tree.leaves(want)))
      if same and all(x.dtype == self.dtype for x in _floats(base)):
        self._rollout_base = base
      else:
        self._rollout_base = _cast_and_move(self.dtype, want, base)(base)
        _log.info("LoRA rollout: the frozen base is kept in the rollout layout too (%.1f MiB "
                  "per device, for the run); each step moves only the adapters and merges there.",
                  self.resident_bytes / 2**20)
    return self._rollout_base

  @property
  def resident_bytes(self) -> int:
    """Bytes per device of the rollout copy of the base kept for the run (0: none kept)."""
    rb = self.rollout_base()
    if rb is self._base:
      return 0
    return shd.per_device_bytes(rb, jax.tree.map(lambda x: x.sharding, rb))

  def split_kernels(self, base: Any, adapters: Any) -> tuple[nnx.State, list]:
    """(the adapted kernels of ``base``, ``base``'s flat state)."""
    adapted = {p[:-1] for p, _ in nnx.to_flat_state(adapters)}
    flat = list(nnx.to_flat_state(base))
    kernels = [(p, v) for p, v in flat if p[-1] == "kernel" and p[:-1] in adapted]
    return nnx.from_flat_state(kernels), flat

  def send(self, adapters: Any) -> Any:
    """The adapters (fp32) in the rollout layout: the only bytes that move per step."""
    want = self.rollout_shardings(adapters)
    return adapters if want is None else jax.device_put(adapters, want)

  def receive(self, moved: Any) -> Any:
    """The merged weights, made on the rollout's devices from the adapters `send` moved."""
    from dapo_jax.models import lora  # pylint: disable=g-import-not-at-top
    base = self.rollout_base()
    kernels, flat = self.split_kernels(base, moved)
    if self._fn is None:
      def merge(adapters, kernels):
        return cast_params(lora.merge_adapters(kernels, adapters, self.scale), self.dtype)
      self._fn = jax.jit(merge, out_shardings=self.rollout_shardings(kernels))
    merged = dict(nnx.to_flat_state(self._fn(moved, kernels)))
    return nnx.from_flat_state([(p, merged.get(p, v)) for p, v in flat])


def _cast_and_move(dtype: Any, out_shardings: Any, like: Any):
  """A function casting a tree like ``like`` to ``dtype`` and laying it out as
  ``out_shardings`` (None: where it is). On the same devices it is one compiled program (the
  cast, then the reshard); onto other devices (``rollout_devices``: rollout and training on
  disjoint sets) the cast runs where the tree is, so only the model's bytes move, then
  ``jax.device_put`` carries them across."""
  cast = jax.jit(functools.partial(cast_params, dtype=dtype))
  if out_shardings is None:
    return cast
  want = {d for s in jax.tree.leaves(out_shardings) for d in s.device_set}
  have = {d for x in jax.tree.leaves(like) for d in x.sharding.device_set}
  if want == have:
    return jax.jit(functools.partial(cast_params, dtype=dtype), out_shardings=out_shardings)
  return lambda tree: jax.device_put(cast(tree), out_shardings)


def _floats(tree: Any) -> list:
  return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
