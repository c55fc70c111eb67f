"""Device meshes and logical-axis sharding rules.

Every parameter of the model carries logical axis names (``logical_axes`` metadata on its
``nnx.Param``). A rules table, which is plain config data, maps each logical name onto zero, one
or several mesh axes. One model therefore runs FSDP, tensor parallel or both, and rollout may use
a different table than training (the model is resharded between the two).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import math
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxis = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxis], ...]

MESH_AXES = ("data", "fsdp", "tensor")

# Training: parameters and optimizer state sharded over `fsdp` (ZeRO-3 style) and `tensor`
# (Megatron style: heads, MLP columns and vocab); the batch over `data` x `fsdp`.
TRAIN_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_vocab", "tensor"),
    ("act_mlp", "tensor"),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
)

# Sampling: no FSDP gather on every decode step, so parameters are replicated across the data
# axes and only split over `tensor`; prompts (and the KV cache) are split over `data` x `fsdp`.
SAMPLE_RULES: Rules = tuple(
    (name, None if name in ("embed",) else axis) for name, axis in TRAIN_RULES)

_log = logging.getLogger(__name__)


def make_mesh(axes: Sequence[tuple[str, int]] | None = None,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds a mesh from ``[(name, size), ...]``; one size may be -1 (all remaining devices).

  The default ``None`` puts every device on ``fsdp``.
  """
  devices = list(jax.devices() if devices is None else devices)
  if axes is None:
    axes = [("data", 1), ("fsdp", -1), ("tensor", 1)]
  names = [a for a, _ in axes]
  sizes = [int(s) for _, s in axes]
  unknown = [n for n in names if n not in MESH_AXES]
  if unknown:
    raise ValueError(f"Unknown mesh axis {unknown}; valid axes are {MESH_AXES}.")
  if sizes.count(-1) > 1:
    raise ValueError(f"At most one mesh axis may be -1, got {list(axes)}.")
  known = math.prod(s for s in sizes if s != -1)
  if known <= 0 or len(devices) % known:
    raise ValueError(
        f"Mesh {list(axes)} does not divide the {len(devices)} available devices.")
  sizes = [len(devices) // known if s == -1 else s for s in sizes]
  if math.prod(sizes) != len(devices):
    raise ValueError(
        f"Mesh {dict(zip(names, sizes))} uses {math.prod(sizes)} devices but "
        f"{len(devices)} are available; use -1 for one axis to absorb the rest.")
  try:
    from jax.experimental import mesh_utils  # pylint: disable=g-import-not-at-top
    arr = mesh_utils.create_device_mesh(sizes, devices=devices)
  except Exception:  # Simulated CPU devices have no physical topology.
    arr = np.asarray(devices).reshape(sizes)
  return Mesh(arr, tuple(names))


def logical_to_spec(names: Sequence[str | None], rules: Rules,
                    shape: Sequence[int] | None = None,
                    mesh: Mesh | None = None) -> PartitionSpec:
  """Maps logical axis names to a PartitionSpec.

  With ``shape`` and ``mesh`` given, a dimension that the mesh axes do not divide is left
  replicated (e.g. 2 KV heads on a tensor axis of 4) instead of failing at compile time, and a
  mesh axis is never used twice in one spec.
  """
  table = dict(rules)
  used: set[str] = set()
  out = []
  for i, name in enumerate(names):
    axis = table.get(name) if name is not None else None
    if axis is None:
      out.append(None)
      continue
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    if mesh is not None:
      axes = tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1 and a not in used)
      if shape is not None and axes:
        size = math.prod(mesh.shape[a] for a in axes)
        if shape[i] % size:
          _log.debug("Leaving dim %d (%s, size %d) unsharded: not divisible by %s", i, name,
                     shape[i], axes)
          axes = ()
    used.update(axes)
    out.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
  return PartitionSpec(*out)


def _is_var(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def state_specs(state: Any, rules: Rules, mesh: Mesh | None = None) -> Any:
  """PartitionSpecs for a pytree of ``nnx.Variable``s (abstract or concrete) from their
  ``logical_axes``; leaves that are not Variables (optax step counts, ...) are replicated."""

  def spec(v):
    if not _is_var(v):
      return PartitionSpec()
    names = v.get_metadata().get("logical_axes")
    if names is None:
      return v.replace(PartitionSpec())
    return v.replace(logical_to_spec(names, rules, v.value.shape, mesh))

  return jax.tree.map(spec, state, is_leaf=_is_var)


def state_shardings(state: Any, mesh: Mesh, rules: Rules) -> Any:
  """NamedShardings for a pytree of an ``nnx.State``, its optax moments or any mix of Variables
  and plain leaves (same structure); the one tree-sharding helper of the package."""
  specs = state_specs(state, rules, mesh)
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)


# --- activation constraints -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _ActivationContext:
  mesh: Mesh
  rules: Rules


_ACTIVATION_CTX: contextvars.ContextVar[_ActivationContext | None] = contextvars.ContextVar(
    "dapo_jax_activation_sharding", default=None)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh | None, rules: Rules):
  """Within this context (at trace time), ``constrain`` pins activations to the mesh."""
  token = _ACTIVATION_CTX.set(None if mesh is None else _ActivationContext(mesh, rules))
  try:
    yield
  finally:
    _ACTIVATION_CTX.reset(token)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """``with_sharding_constraint`` by logical names; a no-op outside ``activation_sharding``."""
  ctx = _ACTIVATION_CTX.get()
  if ctx is None or ctx.mesh.size == 1:
    return x
  spec = logical_to_spec(names, ctx.rules, x.shape, ctx.mesh)
  return jax.lax.with_sharding_constraint(x, NamedSharding(ctx.mesh, spec))


def batch_sharding(mesh: Mesh, rules: Rules, ndim: int, batch_size: int | None = None
                   ) -> NamedSharding:
  """Sharding for a batch-major array: batch over the data axes, the rest replicated."""
  shape = None if batch_size is None else (batch_size,) + (1,) * (ndim - 1)
  names = ("batch",) + (None,) * (ndim - 1)
  return NamedSharding(mesh, logical_to_spec(names, rules, shape, mesh))


def reshard(tree: Any, shardings: Any, donate: bool = False) -> Any:
  """Moves a pytree of arrays to new shardings (e.g. training layout -> rollout layout)."""
  return jax.jit(lambda t: t, out_shardings=shardings, donate_argnums=(0,) if donate else ())(
      tree)


# --- memory of a layout --------------------------------------------------------------------------


def per_device_bytes(tree: Any, shardings: Any) -> int:
  """Bytes one device holds of ``tree`` (arrays or ShapeDtypeStructs) laid out by ``shardings``
  (the largest shard, so uneven layouts are not under-counted)."""
  total = 0
  for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
    shape = s.shard_shape(tuple(x.shape)) if s is not None else tuple(x.shape)
    total += math.prod(shape) * np.dtype(x.dtype).itemsize
  return total


@dataclasses.dataclass(frozen=True)
class ReshardCost:
  """Per-device bytes of moving a tree between two layouts (e.g. training -> rollout).

  The source stays alive (training keeps its state), so the move peaks at
  ``src + dst + temp``: ``temp`` is what XLA adds for the collectives (all-gathers over the axes
  the destination replicates), read from the compiled program.
  """
  src: int
  dst: int
  temp: int

  @property
  def peak(self) -> int:
    return self.src + self.dst + self.temp


def reshard_cost(tree: Any, src: Any, dst: Any) -> ReshardCost:
  """Compiles ``reshard(tree: src -> dst)`` ahead of time (``tree`` may be abstract, the devices
  compile-only ones of a TPU topology) and reads its memory analysis."""
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          tree, src)
  compiled = jax.jit(lambda t: t, out_shardings=dst).lower(abstract).compile()
  mem = compiled.memory_analysis()
  return ReshardCost(src=per_device_bytes(tree, src), dst=per_device_bytes(tree, dst),
                     temp=int(getattr(mem, "temp_size_in_bytes", 0)) if mem else 0)
