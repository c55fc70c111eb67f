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
import re
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
    # The stacked layer axis of a scanned model (config.scan_layers): every device holds every
    # layer's shard, as in the unrolled model; scan slices one layer per step.
    ("layers", None),
)

# Sampling: no FSDP gather on every decode step, so parameters are replicated across the data
# axes and only split over `tensor`; prompts (and the KV cache) are split over `data` x `fsdp`.
SAMPLE_RULES: Rules = tuple(
    (name, None if name in ("embed",) else axis) for name, axis in TRAIN_RULES)

_log = logging.getLogger(__name__)


def resolve_mesh_sizes(axes: Sequence[tuple[str, int]], num_devices: int) -> list[int]:
  """Axis sizes with the one -1 resolved; raises naming the mesh when they cannot fit."""
  names = [a for a, _ in axes]
  sizes = [int(s) for _, s in axes]
  unknown = [n for n in names if n not in MESH_AXES]
  if unknown:
    raise ValueError(f"Unknown mesh axis {unknown}; valid axes are {MESH_AXES}.")
  if sizes.count(-1) > 1:
    raise ValueError(f"At most one mesh axis may be -1, got {list(axes)}.")
  known = math.prod(s for s in sizes if s != -1)
  if known <= 0 or num_devices % known:
    raise ValueError(
        f"Mesh {list(axes)} does not divide the {num_devices} available devices.")
  sizes = [num_devices // known if s == -1 else s for s in sizes]
  if math.prod(sizes) != num_devices:
    raise ValueError(
        f"Mesh {dict(zip(names, sizes))} uses {math.prod(sizes)} devices but "
        f"{num_devices} are available; use -1 for one axis to absorb the rest.")
  return sizes


def parse_dcn(spec: str | Sequence[tuple[str, int]] | None) -> list[tuple[str, int]]:
  """``config.dcn_mesh``: ``"data=2"`` (or ``[("data", 2)]``) -> ``[("data", 2)]``."""
  if not spec:
    return []
  if isinstance(spec, str):
    out = []
    for part in filter(None, spec.split(",")):
      name, eq, size = part.partition("=")
      if not eq or not size.strip().lstrip("-").isdigit():
        raise ValueError(f"config.dcn_mesh={spec!r}: expected 'axis=slices,...', e.g. 'data=2'.")
      out.append((name.strip(), int(size)))
    return out
  return [(str(n), int(k)) for n, k in spec]


def dcn_sizes(names: Sequence[str], sizes: Sequence[int],
              dcn_axes: str | Sequence[tuple[str, int]] | None) -> list[int]:
  """Per-axis slice counts of ``config.dcn_mesh``, aligned with ``names`` (1 where unnamed).

  ``config.mesh`` stays the whole mesh; ``dcn_mesh`` says how many slices (granules joined by
  the data-centre network) each axis spans, so every axis size must be a multiple of it.
  """
  dcn = dict(parse_dcn(dcn_axes))
  stray = [n for n in dcn if n not in names]
  if stray:
    raise ValueError(f"config.dcn_mesh names {stray}, which config.mesh {list(names)} lacks.")
  out = [dcn.get(n, 1) for n in names]
  for n, size, k in zip(names, sizes, out):
    if k < 1 or size % k:
      raise ValueError(f"config.dcn_mesh: axis {n!r} of size {size} cannot span {k} slices; "
                       f"its size must be a multiple of its slice count.")
  return out


def device_grid(sizes: Sequence[int], devices: Sequence[Any],
                dcn: Sequence[int] | None = None) -> np.ndarray:
  """The device array of a mesh: ``mesh_utils`` topology-aware order; with ``dcn`` slice counts
  above 1, the hybrid mesh (each slice a contiguous block, so only the axes named in
  ``config.dcn_mesh`` cross the slow network). Devices without ``slice_index`` (GPU, CPU)
  count one process as one slice."""
  from jax.experimental import mesh_utils  # pylint: disable=g-import-not-at-top
  if dcn is not None and math.prod(dcn) > 1:
    per_slice = [s // k for s, k in zip(sizes, dcn)]
    by_process = not hasattr(devices[0], "slice_index")
    try:
      return mesh_utils.create_hybrid_device_mesh(per_slice, list(dcn), devices,
                                                  process_is_granule=by_process)
    except ValueError as e:
      raise ValueError(f"config.dcn_mesh asks for {math.prod(dcn)} slices of "
                       f"{math.prod(per_slice)} devices: {e}") from e
  slices = {getattr(d, "slice_index", 0) for d in devices}
  if len(slices) > 1:
    _log.warning("The devices span %d slices but config.dcn_mesh is empty: the mesh axes may "
                 "cross the slow data-centre network. Set config.dcn_mesh, e.g. "
                 "'data=%d'.", len(slices), len(slices))
  try:
    return mesh_utils.create_device_mesh(sizes, devices=devices)
  except (ValueError, NotImplementedError, AssertionError) as e:
    _log.warning("mesh_utils cannot map the mesh %s onto the device topology (%s); using the "
                 "devices in id order, which may put an axis across slow links.", list(sizes), e)
    return np.asarray(devices).reshape(sizes)


def make_mesh(axes: Sequence[tuple[str, int]] | None = None,
              devices: Sequence[jax.Device] | None = None,
              dcn_axes: str | Sequence[tuple[str, int]] | None = None) -> Mesh:
  """Builds a mesh from ``[(name, size), ...]``; one size may be -1 (all remaining devices).

  The default ``None`` puts every device on ``fsdp``. ``dcn_axes`` (``config.dcn_mesh``) is
  the multislice layout: how many slices each axis spans.
  """
  devices = list(jax.devices() if devices is None else devices)
  if axes is None:
    axes = [("data", 1), ("fsdp", -1), ("tensor", 1)]
  names = [a for a, _ in axes]
  sizes = resolve_mesh_sizes(axes, len(devices))
  dcn = dcn_sizes(names, sizes, dcn_axes)
  return Mesh(device_grid(sizes, devices, dcn), tuple(names))


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


def batch_axes(mesh: Mesh, rules: Rules) -> dict[str, int]:
  """The mesh axes (name: size) that split the batch under ``rules``."""
  axis = dict(rules).get("batch")
  axes = () if axis is None else ((axis,) if isinstance(axis, str) else tuple(axis))
  return {a: mesh.shape[a] for a in axes if a in mesh.shape and mesh.shape[a] > 1}


def nearest_multiples(value: int, multiple: int) -> list[int]:
  """The multiples of ``multiple`` just below and above ``value`` (for error messages)."""
  below, above = value // multiple * multiple, -(-value // multiple) * multiple
  return [v for v in dict.fromkeys((below, above)) if v > 0]


# The config fields that set the leading dimension of a batch-major array.
BATCH_SETTINGS = ("rollout.prompts_per_call (or algorithm.gen_batch_size)", "eval.batch_size",
                  "optim.mini_batch_size x rollout.n", "sft.batch_size")


def batch_sharding(mesh: Mesh, rules: Rules, ndim: int, batch_size: int | None = None,
                   setting: str | None = None) -> NamedSharding:
  """Sharding for a batch-major array: batch over the data axes, the rest replicated.

  A ``batch_size`` the batch axes do not divide raises: left replicated, every device would
  compute every row. ``setting`` names the config field the size comes from.
  """
  if batch_size is not None:
    axes = batch_axes(mesh, rules)
    shards = math.prod(axes.values())
    if batch_size % shards:
      where = setting or "one of " + ", ".join(BATCH_SETTINGS)
      raise ValueError(
          f"A batch of {batch_size} rows does not split over the mesh's batch axes {axes} "
          f"({shards} shards). Set {where} to a multiple of {shards}, e.g. "
          f"{' or '.join(map(str, nearest_multiples(batch_size, shards)))}, or change "
          "config.mesh / config.rollout_mesh.")
  names = ("batch",) + (None,) * (ndim - 1)
  return NamedSharding(mesh, logical_to_spec(names, rules, None, mesh))


_WARNED_PROMPTS: set[tuple[int, int]] = set()


def prompt_sharding(mesh: Mesh, rules: Rules, num_prompts: int, num_samples: int,
                    ndim: int = 2) -> NamedSharding:
  """Sharding of the prompts of one rollout call, whose ``num_prompts x num_samples`` rows the
  decode loop splits over the batch axes.

  Rows the batch axes do not divide raise (every device would decode every row). Prompts they
  do not divide while the rows are (e.g. 4 prompts x 4 samples on 8 devices) only replicate the
  prefill of the prompts; that is logged once per size, with the settings to change.
  """
  axes = batch_axes(mesh, rules)
  shards = math.prod(axes.values())
  rows = num_prompts * num_samples
  if rows % shards:
    raise ValueError(
        f"A rollout call of {num_prompts} prompts x {num_samples} samples = {rows} rows does "
        f"not split over the mesh's batch axes {axes} ({shards} shards): every device would "
        "decode every row. Set rollout.prompts_per_call (or algorithm.gen_batch_size; "
        f"eval.batch_size for evaluation) so that prompts x samples is a multiple of {shards}, "
        f"e.g. {' or '.join(map(str, nearest_multiples(num_prompts, shards)))} prompts, or change "
        "config.rollout_mesh.")
  if num_prompts % shards and (num_prompts, shards) not in _WARNED_PROMPTS:
    _WARNED_PROMPTS.add((num_prompts, shards))
    _log.warning(
        "%d prompts per rollout call do not split over the batch axes %s (%d shards): every "
        "device prefills all of them (the %d decode rows are split). rollout.prompts_per_call "
        "(or algorithm.gen_batch_size / eval.batch_size) = %s would split the prefill too.",
        num_prompts, axes, shards, rows,
        " or ".join(map(str, nearest_multiples(num_prompts, shards))))
  names = ("batch",) + (None,) * (ndim - 1)
  return NamedSharding(mesh, logical_to_spec(names, rules, (num_prompts,) + (1,) * (ndim - 1),
                                             mesh))


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


_COLLECTIVE = re.compile(r"= (\([^=]*?\)|\S+) (?:all-gather|all-to-all|collective-permute|"
                         r"all-reduce|reduce-scatter)(-start)?\(")
_HLO_ARRAY = re.compile(r"\b(pred|[su]\d+|bf16|f\d+\w*)\[([\d,]*)\]")


def collective_bytes(hlo_text: str) -> int:
  """Bytes per device that a compiled SPMD program's collectives produce (the sum of their
  result arrays): what a layout change moves between devices. An async ``-start`` op counts its
  largest array once (its tuple also holds the operand); the matching ``-done`` is not counted.
  (XLA's CPU backend has no bf16 collectives: it moves bf16 values as f32.)"""
  total = 0
  for m in _COLLECTIVE.finditer(hlo_text):
    sizes = [math.prod(int(d) for d in dims.split(",") if d) * _hlo_itemsize(t)
             for t, dims in _HLO_ARRAY.findall(m.group(1))]
    total += (max(sizes) if m.group(2) else sum(sizes)) if sizes else 0
  return total


def _hlo_itemsize(name: str) -> int:
  """Bytes of one element of an HLO element type (pred, s32, u8, bf16, f32, f8e4m3fn, ...)."""
  return 1 if name == "pred" else max(1, int(re.match(r"[a-z]+(\d+)", name).group(1)) // 8)
