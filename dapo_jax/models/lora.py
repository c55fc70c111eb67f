"""Low-rank adapters (LoRA) on the model's `Dense` projections (``config.model.lora``).

    lcfg = LoRAConfig(rank=8, alpha=16)
    add_adapters(model, lcfg, seed=0, mesh=mesh)   # q/k/v/o/gate/up/down get lora_a, lora_b
    y = x @ W + b + (alpha / rank) * (x @ A) @ B   # every forward, prefill and decode step
    merged = merge_adapters(base_state, adapter_state, lcfg)   # W + (alpha / rank) * A @ B

The adapters are `Adapter` variables, not `nnx.Param`s: ``nnx.split(model, Adapter, ...)``
gives the trained state and the frozen base (every Param) apart, and code that reads a model's
Params (HF export, checkpoint loading) keeps seeing the base alone. A is drawn like peft's
default (Kaiming-uniform), B starts at zero, so a fresh adapter leaves the model's function
unchanged, bit for bit. The kernel's logical axes carry over (A: the kernel's input axes and
"lora_rank"; B: "lora_rank" and its output axes; "lora_rank" is never sharded), including the
stacked "layers" axis of a scanned model. docs/lora.md says why this is not qwix.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from dapo_jax.models.qwen2 import Dense

RANK_AXIS = "lora_rank"
# Short target names and the projections they mean.
SHORT_TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
                 "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
ALL_TARGETS = tuple(SHORT_TARGETS)
QUANTIZE_BASE = ("none",)


class Adapter(nnx.Variable):
  """A LoRA factor (lora_a or lora_b): the only trained state of a LoRA run."""


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
  rank: int = 0  # 0: no adapters (full fine-tuning)
  alpha: float = 16.0  # the update is scaled by alpha / rank (peft's lora_alpha)
  # Short names (q k v o gate up down) or fnmatch patterns over module paths such as
  # "layers.3.self_attn.q_proj" ("layers.self_attn.q_proj" for scanned layers).
  targets: tuple[str, ...] = ALL_TARGETS
  quantize_base: str = "none"

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  @classmethod
  def from_config(cls, lora: Any) -> LoRAConfig:
    """From ``config.model.lora`` (None, or an older config without it: off)."""
    if not lora:
      return cls()
    return cls(rank=int(lora.rank), alpha=float(lora.alpha),
               targets=tuple(lora.targets), quantize_base=str(lora.quantize_base))


def validate(lcfg: LoRAConfig) -> str | None:
  """Why ``lcfg`` cannot be used ("field=value: fix"), or None."""
  if lcfg.rank < 0:
    return f"rank={lcfg.rank}: must be >= 0 (0 turns adapters off)"
  if lcfg.rank and lcfg.alpha <= 0:
    return f"alpha={lcfg.alpha}: must be > 0 (the update is scaled by alpha / rank)"
  if lcfg.quantize_base not in QUANTIZE_BASE:
    return f"quantize_base={lcfg.quantize_base!r}: choose one of {QUANTIZE_BASE}"
  if lcfg.rank and not lcfg.targets:
    return f"targets=(): name at least one of {ALL_TARGETS} or a module-path pattern"
  # Every module path of a model with up to 512 layers (unscanned "layers.N.", scanned "layers.").
  paths = [f"layers{i}{parent}.{name}" for i in ["", *(f".{n}" for n in range(512))]
           for name in SHORT_TARGETS.values()
           for parent in (".self_attn" if name[0] in "qkvo" else ".mlp",)]
  for t in lcfg.targets:
    if t not in SHORT_TARGETS and not any(fnmatch.fnmatchcase(p, t) for p in paths):
      return (f"targets: {t!r} matches no projection; use {ALL_TARGETS} or a pattern such as "
              "'*.self_attn.q_proj'")
  return None


def _matches(path: str, targets: tuple[str, ...]) -> bool:
  name = path.rsplit(".", 1)[-1]
  return any(SHORT_TARGETS.get(t) == name or fnmatch.fnmatchcase(path, t) for t in targets)


def _is_dense(module: Any) -> bool:
  return isinstance(module, Dense)


def _lead(kernel: nnx.Variable) -> int:
  """1 for a scanned model's stacked kernel (leading "layers" axis), else 0."""
  axes = kernel.get_metadata().get("logical_axes") or ()
  return int(bool(axes) and axes[0] == "layers")


def target_paths(model: nnx.Module, lcfg: LoRAConfig) -> list[str]:
  """Dotted paths of the Dense modules ``lcfg.targets`` select."""
  out = []
  for path, module in model.iter_modules():
    dotted = ".".join(str(p) for p in path)
    if _is_dense(module) and _matches(dotted, lcfg.targets):
      out.append(dotted)
  return out


def add_adapters(model: nnx.Module, lcfg: LoRAConfig, seed: int = 0,
                 mesh: Mesh | None = None) -> nnx.Module:
  """Puts lora_a / lora_b on every targeted Dense of ``model`` (in place; returns it).

  Adapters take the kernel's dtype (the train state keeps an fp32 master copy of them); with
  ``mesh`` they are placed by the training rules, as the base kernels are. All of them are drawn
  by one compiled program (a program per shape would compile several times per model).
  """
  from dapo_jax.infra import sharding as shd  # pylint: disable=g-import-not-at-top
  if lcfg.rank <= 0:
    return model
  specs = []  # (module, A's Adapter metadata, B's, A shape, B shape, init bound, dtype)
  for path, module in model.iter_modules():
    dotted = ".".join(str(p) for p in path)
    if not (_is_dense(module) and _matches(dotted, lcfg.targets)):
      continue
    kernel = module.kernel
    axes = tuple(kernel.get_metadata().get("logical_axes") or (None,) * kernel.value.ndim)
    shape = kernel.value.shape
    lead, n_in = _lead(kernel), module.n_in
    in_shape, out_shape = shape[lead:lead + n_in], shape[lead + n_in:]
    # peft's default init of A: kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    specs.append((module, axes[:lead + n_in] + (RANK_AXIS,),
                  axes[:lead] + (RANK_AXIS,) + axes[lead + n_in:],
                  shape[:lead] + in_shape + (lcfg.rank,), shape[:lead] + (lcfg.rank,) + out_shape,
                  1.0 / math.sqrt(math.prod(in_shape)), kernel.value.dtype))
  if not specs:
    raise ValueError(f"config.model.lora.targets={lcfg.targets!r} selects no projection of "
                     "this model; use short names such as 'q' or patterns like '*.q_proj'.")

  def draw(key):
    # One uniform draw cut into every A (an RNG op per adapter compiles slowly on CPU).
    sizes = [math.prod(a_shape) for _, _, _, a_shape, _, _, _ in specs]
    u = jax.random.uniform(key, (sum(sizes),), jnp.float32, -1.0, 1.0)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [((bound * u[at:at + n]).reshape(a_shape).astype(dtype), jnp.zeros(b_shape, dtype))
            for at, n, (_, _, _, a_shape, b_shape, bound, dtype) in zip(starts, sizes, specs)]

  out = None
  if mesh is not None:
    place = lambda names, shape: shd.state_shardings(
        Adapter(jax.ShapeDtypeStruct(shape, jnp.float32), logical_axes=names), mesh,
        shd.TRAIN_RULES).value
    out = [(place(a_axes, a_shape), place(b_axes, b_shape))
           for _, a_axes, b_axes, a_shape, b_shape, _, _ in specs]
  drawn = jax.jit(draw, out_shardings=out)(jax.random.key(seed + 0x10A))
  for (module, a_axes, b_axes, *_), (a, b) in zip(specs, drawn):
    module.lora_a = Adapter(a, logical_axes=a_axes)
    module.lora_b = Adapter(b, logical_axes=b_axes)
    module.lora_scale = lcfg.scale
  return model


def has_adapters(state_or_model: Any) -> bool:
  if isinstance(state_or_model, nnx.Module):
    state_or_model = nnx.state(state_or_model, Adapter)
  return any(isinstance(v, Adapter) for v in jax.tree.leaves(
      state_or_model, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def kernel_delta(a: jax.Array, b: jax.Array, kernel_shape: tuple[int, ...], scale: float
                 ) -> jax.Array:
  """``scale * A @ B`` shaped like the kernel, in fp32 (A [*lead, *in, r], B [*lead, r, *out])."""
  r = a.shape[-1]
  lead = a.ndim + b.ndim - 2 - len(kernel_shape)  # 1 for a scanned model's stacked layers
  lead_shape = a.shape[:lead]
  a2 = a.astype(jnp.float32).reshape(lead_shape + (-1, r))
  b2 = b.astype(jnp.float32).reshape(lead_shape + (r, -1))
  return (scale * jnp.matmul(a2, b2)).reshape(kernel_shape)


def merge_adapters(base: nnx.State, adapters: nnx.State, scale: float) -> nnx.State:
  """``base`` (the model's state without adapters) with every adapted kernel replaced by
  ``W + scale * A @ B``, in the kernel's dtype; other leaves are ``base``'s own arrays."""
  flat_a = dict(nnx.to_flat_state(adapters))
  flat = []
  for path, var in nnx.to_flat_state(base):
    if path[-1] == "kernel" and path[:-1] + ("lora_a",) in flat_a:
      a = flat_a[path[:-1] + ("lora_a",)].value
      b = flat_a[path[:-1] + ("lora_b",)].value
      w = var.value
      var = var.replace((w.astype(jnp.float32) + kernel_delta(a, b, w.shape, scale)
                         ).astype(w.dtype))
    flat.append((path, var))
  return nnx.from_flat_state(flat)
