r"""``dapo-plan``: will a config fit a slice? Per-device memory and FLOPs before renting it.

  dapo-plan --config configs/dapo_qwen2_5_32b.py --target tpu:v5p:4x4x4 \
      --config.optim.micro_batch_size=8 --config.rollout.prompts_per_call=48
  dapo-plan --config configs/dapo_qwen2_5_32b.py --target gpu:h100:16x8 \
      --config.optim.micro_batch_size=16 --config.mesh=data=1,fsdp=-1,tensor=8
  dapo-plan --config configs/tiny_cpu.py --target cpu:8

Overrides are dapo-train's ``--config.x=y`` (``--set x=y`` is a deprecated alias of it).

TPU and CPU targets compile the real train step, rollout program and train->rollout reshard
ahead of time (TPU through libtpu on compile-only devices, so a CPU-only host suffices) and read
XLA's memory and cost analyses. GPU targets get an analytic estimate, labelled as such.

Where the chip's datasheet peaks are known (TPU targets; `plan_estimates.CHIPS`), the plan also
compiles the old-log-prob forward, the static sampler's prefill and decode step and the
continuous engine's programs, and prints a roofline ESTIMATE of one RL step by phase: each
program's FLOPs and HBM bytes (XLA's cost analysis, which counts a loop body once, so the runs
are multiplied out explicitly) at peak compute or bandwidth, whichever binds; and the update's
implied MFU. It leaves out communication and host time.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import glob
import json
import math
import os
import re
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_collections
from absl import flags
from etils import epath
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dapo_jax import cli
from dapo_jax import config as config_lib
from dapo_jax import libtpu_flags
from dapo_jax import plan_estimates as est
from dapo_jax import plan_paged
from dapo_jax import run_setup
from dapo_jax import sharding as shd
from dapo_jax.models import attention
from dapo_jax.models import Qwen2Config, abstract_model, default_positions, get_preset, lora
from dapo_jax.models.qwen2 import Qwen2ForCausalLM
from dapo_jax.rollout import slots as sl
from dapo_jax.rollout.sampler import Sampler
from dapo_jax.rollout.sampling import SamplingParams, sample_logits
from dapo_jax.train_step import (LogProbForward, TrainBatch, TrainState, TrainStep,
                                 make_optimizer, master_params)

GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class Target:
  """Where the config would run: ``tpu:v5p:4x4x4``, ``gpu:h100:16x8`` or ``cpu:8``."""
  kind: str
  name: str
  num_devices: int
  hbm_bytes: int | None  # None: unknown (CPU)
  devices: tuple | None  # compile-capable devices; None: analytic only

  @property
  def analytic(self) -> bool:
    return self.devices is None

  @property
  def chip(self) -> est.Chip | None:
    """The chip's datasheet peaks (None: unknown, e.g. a CPU)."""
    return est.CHIPS.get(self.name.split(":")[0].lower()) if self.kind != "cpu" else None


def parse_target(spec: str) -> Target:
  kind, _, rest = spec.partition(":")
  if kind == "tpu":
    gen = rest.split(":")[0].lower()
    if gen not in est.TPU_HBM_GIB:
      raise ValueError(f"Unknown TPU generation {gen!r} in {spec!r}; known: "
                       f"{sorted(est.TPU_HBM_GIB)} (e.g. tpu:v5p:4x4x4).")
    devices = tpu_devices(rest)
    return Target("tpu", rest, len(devices), int(est.TPU_HBM_GIB[gen] * GiB), tuple(devices))
  if kind == "gpu":
    gen, _, shape = rest.partition(":")
    if gen.lower() not in est.GPU_HBM_GB or not shape:
      raise ValueError(f"Use gpu:<{'|'.join(est.GPU_HBM_GB)}>:<nodes>x<gpus per node>, got "
                       f"{spec!r}.")
    n = math.prod(int(s) for s in shape.split("x"))
    usable = est.GPU_HBM_GB[gen.lower()] * 1e9 * est.GPU_MEM_FRACTION
    return Target("gpu", rest, n, int(usable), None)
  if kind == "cpu":
    n = int(rest or jax.device_count("cpu"))
    cpus = jax.devices("cpu")
    if len(cpus) < n:
      raise ValueError(f"Target {spec!r} needs {n} CPU devices, this process has {len(cpus)}: "
                       f"set XLA_FLAGS=--xla_force_host_platform_device_count={n}.")
    return Target("cpu", str(n), n, None, tuple(cpus[:n]))
  raise ValueError(f"Target {spec!r}: use tpu:<gen>:<topology>, gpu:<gpu>:<NxM> or cpu:<n>.")


def tpu_devices(topology: str) -> list:
  """Compile-only devices of a TPU topology (``v5p:4x4x4``), from libtpu on any host."""
  # Compile-only use opens no chip: let it run next to another libtpu user (a training job,
  # a second plan) instead of failing on libtpu's one-process lockfile.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  try:
    from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
    dims = [int(x) for x in topology.partition(":")[2].split("x") if x.isdigit()]
    # A slice smaller than libtpu's default 2x2x1 host (v5e-1, a notebook's chip) is one host.
    host = ({"chips_per_host_bounds": tuple(dims + [1] * (3 - len(dims)))}
            if dims and math.prod(dims) < 4 else {})
    return list(topologies.get_topology_desc(topology, "tpu", **host).devices)
  except Exception as err:  # pylint: disable=broad-except
    raise RuntimeError(
        f"Cannot describe TPU topology {topology!r} ({err}). TPU planning compiles with libtpu: "
        "pip install 'jax[tpu]' (any host, no TPU needed) or use a gpu:/cpu: target.") from err


class _VocabOnly:
  """Planning needs the vocabulary size, not the tokenizer files."""

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size


def plan_model_config(config: ml_collections.ConfigDict) -> Qwen2Config:
  """The run's architecture, without reading tokenizer files (the preset's vocabulary is at
  least the Qwen2.5 tokenizer's, which is what a run uses too)."""
  if config.tokenizer.kind == "char":
    size = run_setup.build_tokenizer(config).vocab_size
  else:
    size = get_preset(config.model.preset).vocab_size
  return run_setup.model_config(config, _VocabOnly(size))


def _abstract(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                      shardings)


def _mem(compiled) -> dict[str, int]:
  m = compiled.memory_analysis()
  keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
          "temp_size_in_bytes", "generated_code_size_in_bytes")
  return {k.replace("_size_in_bytes", ""): int(getattr(m, k)) for k in keys}


def peak_bytes(mem: dict[str, int]) -> int:
  """What a compiled program needs at once: inputs, non-aliased outputs, temporaries."""
  return mem["argument"] + mem["output"] - mem["alias"] + mem["temp"]


def _cost(compiled) -> est.Cost:
  """Per-device FLOPs and HBM bytes of one run of ``compiled`` (a loop body counted once)."""
  cost = compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
  return est.Cost(float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)))


_OOM = re.compile(r"memory required for (.+?) \(([\d.]+)([KMGT]?)\) exceeds available HBM "
                  r"\(([\d.]+)([KMGT]?)\)")


def _to_bytes(number: str, unit: str) -> int:
  return int(float(number) * 1024**"_KMGT".index(unit or "_"))


def _compile(lowered) -> tuple[Any, dict[str, Any] | None, float]:
  """(compiled, None, seconds), or (None, what the compiler lacked, seconds) when libtpu refuses
  a program that cannot fit in HBM (it says by how much)."""
  start = time.perf_counter()
  try:
    compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as err:
    m = _OOM.search(str(err))
    if "RESOURCE_EXHAUSTED" not in str(err) or m is None:
      raise
    return None, {"what": m.group(1), "required": _to_bytes(m.group(2), m.group(3)),
                  "available": _to_bytes(m.group(4), m.group(5))}, time.perf_counter() - start
  return compiled, None, time.perf_counter() - start


def _summary(compiled, oom, seconds: float, parts: dict[str, int], temp_part: str,
             temp_known: int = 0) -> dict[str, Any]:
  """Compiled memory and FLOPs. On a compiler OOM the temporaries it asked for fill
  ``temp_part`` (less ``temp_known``, listed in another part), so the peak is what it needed."""
  out = {"parts": parts, "compile_seconds": round(seconds, 1)}
  if compiled is None:
    if oom["what"] == "HLO temporaries":
      parts[temp_part] = max(oom["required"] - temp_known, 0)
    return out | {"oom": oom, "peak": sum(parts.values()), "flops_compiled": 0.0}
  mem, cost = _mem(compiled), _cost(compiled)
  return out | {"memory": mem, "peak": peak_bytes(mem), "flops_compiled": cost.flops,
                "bytes_compiled": cost.bytes}


def _train_program(config, mcfg: Qwen2Config, mesh: Mesh):
  """The train step lowered for one optimizer update on a mini-batch, with its abstract inputs."""
  tcfg = run_setup.train_config(config)
  lcfg = lora.LoRAConfig.from_config(config.model.get("lora"))
  model = nnx.eval_shape(lambda: lora.add_adapters(Qwen2ForCausalLM(mcfg, rngs=nnx.Rngs(0)),
                                                   lcfg))
  # As `init_train_state`: the trained params (every Param, or the LoRA adapters alone, the base
  # then frozen in `rest`) get fp32 master weights (and so fp32 Adam moments) for a bf16 model.
  graphdef, params, rest = nnx.split(model, lora.Adapter if lcfg.rank else nnx.Param, ...)
  params = jax.eval_shape(functools.partial(master_params, cfg=tcfg), params)
  opt_state = jax.eval_shape(make_optimizer(tcfg).init, params)
  scalar = jax.ShapeDtypeStruct((), jnp.int32)
  state = TrainState(params, rest, opt_state, scalar, scalar)
  rows = config.optim.mini_batch_size * config.rollout.n
  p, r = config.data.max_prompt_length, config.rollout.max_response_length
  sds = jax.ShapeDtypeStruct
  # Only the fields the loss reads: jit drops unused inputs from the compiled program.
  batch = TrainBatch(input_ids=sds((rows, p + r), jnp.int32),
                     attention_mask=sds((rows, p + r), jnp.bool_),
                     response_mask=sds((rows, r), jnp.bool_),
                     old_log_probs=sds((rows, r), jnp.float32),
                     advantages=sds((rows,), jnp.float32),
                     truncated=sds((rows,), jnp.bool_) if tcfg.overlong_filter else None,
                     sampler_log_probs=(sds((rows, r), jnp.float32)
                                        if tcfg.rollout_is != "none" else None))
  return TrainStep(graphdef, tcfg, mesh).lower(state, batch), state, batch, tcfg


def compile_train_step(config, mcfg: Qwen2Config, mesh: Mesh) -> dict[str, Any]:
  """AOT-compiles one optimizer update on a mini-batch; memory split by what holds it."""
  lowered, state, batch, tcfg = _train_program(config, mcfg, mesh)
  params, opt_state = state.params, state.opt_state
  rows = batch.input_ids.shape[0]
  compiled, oom, seconds = _compile(lowered)
  sh = shd.state_shardings(state, mesh, shd.TRAIN_RULES)
  batch_sh = jax.tree.map(lambda x: shd.batch_sharding(mesh, shd.TRAIN_RULES, x.ndim, x.shape[0]),
                          batch)
  parts = {"params": shd.per_device_bytes(params, sh.params),
           "opt_state": shd.per_device_bytes(opt_state, sh.opt_state),
           "frozen_base": shd.per_device_bytes(state.rest, sh.rest),  # LoRA's base; else 0
           "batch": shd.per_device_bytes(batch, batch_sh),
           "activations_and_temp": 0 if compiled is None else _mem(compiled)["temp"]}
  return _summary(compiled, oom, seconds, parts, "activations_and_temp") | {
      "num_micro_batches": tcfg.num_micro_batches, "rows": rows,
      "state_bytes": parts["params"] + parts["opt_state"] + parts["frozen_base"]}


def compile_train_cost(config, mcfg: Qwen2Config, mesh: Mesh) -> dict[str, Any]:
  """The train step compiled for its cost alone: one micro-batch loop body (with the
  optimizer update, a small overcount) per run."""
  lowered, _, _, tcfg = _train_program(config, mcfg, mesh)
  return _lower_and_cost(lowered) | {"num_micro_batches": tcfg.num_micro_batches}


def sampling_params(config, mcfg: Qwen2Config) -> SamplingParams:
  return SamplingParams(temperature=config.rollout.temperature, top_p=config.rollout.top_p,
                        top_k=config.rollout.top_k,
                        max_new_tokens=config.rollout.max_response_length,
                        eos_ids=(mcfg.eos_token_id or 0,), pad_id=mcfg.eos_token_id or 0)


def compile_rollout(config, mcfg: Qwen2Config, train_mesh: Mesh, rollout_mesh: Mesh
                    ) -> dict[str, Any]:
  """AOT-compiles one rollout call (prefill + decode loop) and the train -> rollout reshard."""
  graphdef, state = nnx.split(abstract_model(mcfg))
  rollout_sh = shd.state_shardings(state, rollout_mesh, shd.SAMPLE_RULES)
  train_sh = shd.state_shardings(state, train_mesh, shd.TRAIN_RULES)
  b = config.rollout.prompts_per_call or config.algorithm.gen_batch_size
  p = config.data.max_prompt_length
  prompt_sh = shd.prompt_sharding(rollout_mesh, shd.SAMPLE_RULES, b, config.rollout.n)
  key = jax.eval_shape(lambda: jax.random.key(0))
  key = jax.ShapeDtypeStruct(key.shape, key.dtype,
                             sharding=NamedSharding(rollout_mesh, PartitionSpec()))
  sp = sampling_params(config, mcfg)
  sampler = Sampler(graphdef, mesh=rollout_mesh, rules=shd.SAMPLE_RULES)
  ids = jax.ShapeDtypeStruct((b, p), jnp.int32, sharding=prompt_sh)
  mask = jax.ShapeDtypeStruct((b, p), jnp.bool_, sharding=prompt_sh)
  compiled, oom, seconds = _compile(sampler._program.lower(  # pylint: disable=protected-access
      _abstract(state, rollout_sh), ids, mask, key, params=sp, num_samples=config.rollout.n))
  kv = est.kv_cache_bytes_per_device(mcfg, rollout_mesh, b * config.rollout.n,
                                     p + config.rollout.max_response_length)
  mem = None if compiled is None else _mem(compiled)
  parts = {"params": shd.per_device_bytes(state, rollout_sh), "kv_cache_estimate": kv,
           "other_temp": 0 if mem is None else max(mem["temp"] - kv, 0),
           "outputs": 0 if mem is None else mem["output"]}
  summary = _summary(compiled, oom, seconds, parts, "other_temp", temp_known=kv)
  reshard = shd.reshard_cost(state, train_sh, rollout_sh)
  return summary | {"prompts_per_call": b,
                    "reshard": dataclasses.asdict(reshard) | {"peak": reshard.peak}}


def _lower_and_cost(lowered) -> dict[str, Any]:
  compiled, oom, seconds = _compile(lowered)
  if compiled is None:
    return {"oom": oom, "compile_seconds": round(seconds, 1)}
  return {"cost": dataclasses.asdict(_cost(compiled)), "compile_seconds": round(seconds, 1)}


def compile_logprob(config, mcfg: Qwen2Config, mesh: Mesh) -> dict[str, Any]:
  """AOT-compiles the old-log-prob forward over a step's trajectories (the trainer's one call:
  `forward_micro_batch_size` rows at a time, a loop whose body the cost analysis counts once)."""
  tcfg = run_setup.train_config(config)
  graphdef, params, rest = nnx.split(abstract_model(mcfg), nnx.Param, ...)
  params = jax.eval_shape(functools.partial(master_params, cfg=tcfg), params)
  rows = config.optim.train_batch_size * config.rollout.n
  r = config.rollout.max_response_length
  t = config.data.max_prompt_length + r
  ids = jax.ShapeDtypeStruct((rows, t), jnp.int32)
  mask = jax.ShapeDtypeStruct((rows, t), jnp.bool_)
  forward = LogProbForward(graphdef, tcfg, mesh, rest=rest)
  micro = tcfg.forward_micro_batch_size
  loops = rows // micro if 0 < micro < rows else 1
  return _lower_and_cost(forward.lower(params, ids, mask, r)) | {"rows": rows,
                                                                  "loop_runs": loops}


def _rows_layout(tree, rows: int, mesh: Mesh):
  """``tree`` (abstract) laid out as the rollout lays out its KV cache and per-row state
  (`KVCache.repeat`): rows over the batch axes, KV heads over ``tensor`` (per-layer [N, K, ., .]
  key/value arrays or layer-stacked [L, N, K, ., .] ones); anything else replicated."""
  def one(path, x):
    if any(getattr(k, "name", None) in ("k", "v") for k in path) and x.ndim >= 4:
      names = (None,) * (x.ndim - 4) + ("batch", "kv_heads", None, None)
    elif x.ndim and x.shape[0] == rows:
      names = ("batch",) + (None,) * (x.ndim - 1)
    else:
      names = (None,) * x.ndim
    spec = shd.logical_to_spec(names, shd.SAMPLE_RULES, x.shape, mesh)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
  return jax.tree_util.tree_map_with_path(one, tree)


def compile_decode_costs(config, mcfg: Qwen2Config, mesh: Mesh, sp: SamplingParams
                         ) -> dict[str, Any]:
  """The static sampler's pieces, compiled alone for their costs (in the rollout program they
  sit in `while_loop`s whose bodies XLA's cost analysis counts once): the prefill of a call's
  prompts, and one decode step of its B*G rows (the model's `decode_step`, as the sampler runs
  it, then sampling) over the cache lengths of the shortest and the longest decode loop."""
  graphdef, state = nnx.split(abstract_model(mcfg))
  state = _abstract(state, shd.state_shardings(state, mesh, shd.SAMPLE_RULES))
  b = config.rollout.prompts_per_call or config.algorithm.gen_batch_size
  g, p = config.rollout.n, config.data.max_prompt_length
  n = b * g
  prompt_sh = shd.prompt_sharding(mesh, shd.SAMPLE_RULES, b, g)
  row_sh = shd.batch_sharding(mesh, shd.SAMPLE_RULES, 1, n)
  sds = jax.ShapeDtypeStruct

  def prefill(state, ids_BxP, mask_BxP):
    with shd.activation_sharding(mesh, shd.SAMPLE_RULES):
      model = nnx.merge(graphdef, state)
      h_BxPxD, cache = model.prefill(ids_BxP, default_positions(mask_BxP), mask_BxP)
      return model.logits_from_hidden(h_BxPxD[:, -1:])[:, 0], cache

  def decode(state, tok_N, pos_N, cache, key):
    with shd.activation_sharding(mesh, shd.SAMPLE_RULES):
      logits_NxV, cache = nnx.merge(graphdef, state).decode_step(tok_N, pos_N, cache,
                                                                 same_slot=True)
      tok_N, lp_N = sample_logits(logits_NxV, key, temperature=sp.temperature, top_p=sp.top_p,
                                  top_k=sp.top_k)
      return tok_N, lp_N, cache

  out = {"prefill": _lower_and_cost(jax.jit(prefill).lower(
      state, sds((b, p), jnp.int32, sharding=prompt_sh), sds((b, p), jnp.bool_,
                                                             sharding=prompt_sh)))}
  key = jax.eval_shape(lambda: jax.random.key(0))
  key = sds(key.shape, key.dtype, sharding=NamedSharding(mesh, PartitionSpec()))
  segments = Sampler(graphdef, mesh=mesh).cache_segments  # the trainer's default
  lengths = sorted({s for _, s in est.static_decode_steps(sp.max_new_tokens, segments, p)})
  for length in (lengths[0], lengths[-1]) if len(lengths) > 1 else lengths:
    cache = _rows_layout(jax.eval_shape(
        lambda length=length: abstract_model(mcfg).init_cache(n, length)), n, mesh)
    step = jax.jit(decode, donate_argnums=3).lower(
        state, sds((n,), jnp.int32, sharding=row_sh), sds((n,), jnp.int32, sharding=row_sh),
        cache, key)
    out[f"decode_step@{length}"] = _lower_and_cost(step) | {"cache_length": length}
  return out | {"rows": n, "prompts_per_call": b, "cache_segments": segments}


def _continuous_programs(config, mcfg: Qwen2Config, mesh: Mesh, sp: SamplingParams,
                         paged=None):
  """The continuous engine's programs (`rollout/slot_programs.py`) lowered as the trainer's
  `ContinuousSampler` runs them: its state (`init`: the slots' KV cache, or with ``paged`` (a
  `PagedSpec`) the page pools and tables, and the prompt queue),
  an `enqueue` that prefills one prompt into the queue (in steady state the queue frees an
  entry at a time) and a chunk of decode steps with in-loop admission. Returns a dict with the
  slot and queue sizes, the rollout parameters' bytes per device and either the lowered
  `enqueue` and `chunk` with the engine state's bytes per device, or the compiler's OOM for
  the state."""
  from dapo_jax.rollout import continuous  # pylint: disable=g-import-not-at-top
  from dapo_jax.rollout import engine_programs  # pylint: disable=g-import-not-at-top
  from dapo_jax.rollout import slot_programs as prog  # pylint: disable=g-import-not-at-top
  graphdef, state = nnx.split(abstract_model(mcfg))
  state_sh = shd.state_shardings(state, mesh, shd.SAMPLE_RULES)
  state = _abstract(state, state_sh)
  p, r, g = config.data.max_prompt_length, config.rollout.max_response_length, config.rollout.n
  sampler = continuous.ContinuousSampler(
      graphdef, num_slots=config.rollout.max_concurrent_decodes, mesh=mesh,
      max_prefill_length=p)
  prog_mesh = sampler.mesh
  q = sampler.queue_prompts(g)
  prompt_slots = sl.prefill_bucket(p)
  init = prog.init_program.lower(
      state, graphdef=graphdef, num_slots=sampler.num_slots, queue_size=q, num_samples=g,
      prompt_length=prompt_slots, cache_length=prompt_slots + r, mesh=prog_mesh, paged=paged)
  init_compiled, oom, _ = _compile(init)
  info = {"slots": sampler.num_slots, "enqueue_rows": 1, "queue_prompts": q,
          "chunk_steps": sampler.chunk_steps, "params": shd.per_device_bytes(state, state_sh)}
  if init_compiled is None:
    return info | {"oom": oom}
  sds, rep = jax.ShapeDtypeStruct, NamedSharding(mesh, PartitionSpec())
  out_sh = init_compiled.output_shardings
  if mesh.devices.size == 1:  # a one-chip compile reports its outputs on the host's CPU device
    out_sh = jax.tree.map(lambda _: rep, out_sh)
  engine = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                        init.out_info, out_sh)
  i32 = lambda *shape: sds(shape, jnp.int32, sharding=rep)
  enqueue = prog.enqueue_program.lower(
      state, engine, i32(1, prompt_slots), i32(1), i32(1), i32(1), i32(1, g), i32(1),
      graphdef=graphdef, mesh=prog_mesh)
  # As the trainer compiles it: the engine state in the layouts the chunk's compiler picks.
  chunk = engine_programs.lower_chunk(
      state, engine, graphdef=graphdef, params=sp, mesh=prog_mesh,
      chunk_steps=sampler.chunk_steps, max_admit=sampler.max_admit, paged=paged)
  return info | {"enqueue": enqueue, "chunk": chunk, "engine_bytes": shd.per_device_bytes(
      engine, out_sh)}


def compile_continuous(config, mcfg: Qwen2Config, mesh: Mesh, sp: SamplingParams
                       ) -> dict[str, Any]:
  """The continuous engine's enqueue and chunk compiled for their costs (the chunk's loop body,
  one decode step with admission, counted once)."""
  progs = _continuous_programs(config, mcfg, mesh, sp)
  info = {k: progs[k] for k in ("slots", "enqueue_rows", "queue_prompts", "chunk_steps")}
  if "oom" in progs:
    return info | {"oom": progs["oom"]}
  return info | {"enqueue": _lower_and_cost(progs["enqueue"]),
                 "decode_chunk": _lower_and_cost(progs["chunk"])}


def compile_continuous_rollout(config, mcfg: Qwen2Config, mesh: Mesh, sp: SamplingParams,
                               paged=None) -> dict[str, Any]:
  """The continuous engine's memory: its chunk program at the model's depth, whose inputs are
  the rollout parameters and the engine state (the slots' KV cache at the full prompt +
  response length, which never grows, or with ``paged`` the page pools, and the prompt
  queue)."""
  progs = _continuous_programs(config, mcfg, mesh, sp, paged)
  parts = {"params": progs["params"], "engine_state": progs.get("engine_bytes", 0),
           "other_temp": 0, "outputs": 0}
  info = {"slots": progs["slots"], "queue_prompts": progs["queue_prompts"]}
  if paged is not None:
    info["paged"] = {"pages_per_shard": paged.num_pages, "page_size": paged.page_size,
                     "shards": paged.shards, "impl": attention_impl_on_target(paged.impl)}
  if "oom" in progs:  # the state alone does not fit
    return _summary(None, progs["oom"], 0.0, parts, "engine_state", temp_known=0) | info
  compiled, oom, seconds = _compile(progs["chunk"])
  if compiled is not None:
    mem = _mem(compiled)
    parts["other_temp"], parts["outputs"] = mem["temp"], max(mem["output"] - mem["alias"], 0)
    if paged is not None:  # Pallas kernels (TPU custom calls) in the chunk, a scan's body once
      info["kernel_calls"] = compiled.as_text().count('custom_call_target="tpu_custom_call"')
  return _summary(compiled, oom, seconds, parts, "other_temp") | info


def _reported(compile_fn, *args) -> dict[str, Any]:
  """``compile_fn(*args)``, or the error it raised (a program the memory plan does not need)."""
  try:
    return compile_fn(*args)
  except Exception as err:  # pylint: disable=broad-except
    return {"error": f"{type(err).__name__}: {err}"[:500]}


# Depths the estimate's programs are compiled at (unrolled) to get their cost at the model's.
COST_DEPTHS = (1, 2)


def _costs_at_depth(compile_fn, *args, config, mcfg: Qwen2Config) -> dict[str, Any]:
  """``compile_fn(config, mcfg, *args)`` with every program cost at the model's depth.

  XLA's cost analysis counts a loop body once, so a scanned decoder (``scan_layers``) would
  count one of its layers. A program's cost is affine in the number of layers, so it is compiled
  with ``COST_DEPTHS`` unrolled layers (small, quick compiles) and extrapolated
  (``plan_estimates.costs_at_depth``); the memory figures come from the full programs.
  """
  runs = [_reported(compile_fn, config, mcfg.replace(num_hidden_layers=d, scan_layers=False),
                    *args) for d in COST_DEPTHS]
  return est.costs_at_depth(runs[0], runs[1], COST_DEPTHS, mcfg.num_hidden_layers)


def attention_impl_on_target(impl: str) -> str:
  """The paged attention ``impl`` resolved for the platform being compiled for."""
  from dapo_jax.models import paged_attention  # pylint: disable=g-import-not-at-top
  return paged_attention.resolve_paged_impl(impl)


def _resident_bytes(plan: dict[str, Any]) -> int:
  """What stays on a chip through rollout besides the KV: the training state and the rollout
  weights (the paged pool is sized from the rest)."""
  return plan["train"]["state_bytes"] + plan["rollout"]["parts"]["params"]


def _paged_engine(config, mcfg: Qwen2Config, plan: dict[str, Any], target: Target, mesh: Mesh):
  """The configured continuous engine's `PagedSpec` on the target (None: dense cache)."""
  shards = math.prod(shd.batch_axes(mesh, shd.SAMPLE_RULES).values())
  return plan_paged.engine_spec(config, mcfg, target.kind, mesh.shape.get("tensor", 1), shards,
                                target.hbm_bytes, _resident_bytes(plan))


def _compile_paged_fit(config, mcfg: Qwen2Config, plan: dict[str, Any], target: Target,
                       mesh: Mesh, sp: SamplingParams, paged) -> dict[str, Any]:
  """The paged engine's chunk at the slots the closed form says fit its pool (when that is not
  the configured count): the memory of the engine the estimate's "slots that fit" row runs."""
  if target.chip is None or target.hbm_bytes is None:
    return {"skipped": "no datasheet peaks or HBM size for this target"}
  pe = plan_paged.estimate(config, mcfg, target.chip, target.num_devices, target.hbm_bytes,
                           _resident_bytes(plan))
  slots = pe["slots_fit_per_shard"] * paged.shards
  if not slots or slots == config.rollout.max_concurrent_decodes:
    return {"skipped": f"{slots} slots fit: the configured engine's compile is that program"}
  fit = copy.deepcopy(config)
  with fit.unlocked():
    fit.rollout.max_concurrent_decodes = slots
  return _reported(compile_continuous_rollout, fit, mcfg, mesh, sp,
                   dataclasses.replace(paged, num_pages=pe["pool_pages"]))


def make_plan(config: ml_collections.ConfigDict, target: Target,
              estimate: bool | None = None) -> dict[str, Any]:
  """The plan as a JSON-able dict; compiles unless the target is analytic.

  ``estimate`` (default: when the target's chip has datasheet peaks) also compiles the
  programs the step-time estimate needs (old-log-prob forward, the static sampler's prefill
  and decode step, the continuous engine) and adds ``plan["estimate"]``.
  """
  if estimate is None:
    estimate = target.chip is not None
  config_lib.validate(config)
  mcfg = plan_model_config(config)
  plan: dict[str, Any] = {
      "target": f"{target.kind}:{target.name}", "num_devices": target.num_devices,
      "hbm_bytes": target.hbm_bytes, "model_params": mcfg.num_params(),
      "mesh": [list(a) for a in config.mesh],
      "rollout_mesh": [list(a) for a in (config.rollout_mesh or config.mesh)],
      "micro_batch_size": config.optim.micro_batch_size, "remat": config.model.remat,
      "prompts_per_call": config.rollout.prompts_per_call or config.algorithm.gen_batch_size,
      "flops_analytic": est.step_flops(config, mcfg)}
  plan["warnings"] = est.layout_warnings(config, mcfg, target.num_devices)
  if target.analytic:
    plan["method"] = "analytic estimate (no compiler for this target on this host)"
    plan.update(est.analytic_memory(config, mcfg, target.num_devices,
                                    run_setup.train_config(config).master_dtype))
  else:
    plan["method"] = f"compiled ahead of time for {target.num_devices} {target.kind} devices"
    devices = list(target.devices)
    train_mesh = shd.make_mesh([tuple(a) for a in config.mesh], devices=devices)
    rollout_mesh = shd.make_mesh([tuple(a) for a in (config.rollout_mesh or config.mesh)],
                                 devices=devices)
    # Kernels as on the target: "auto" attention is Pallas splash on TPU, not the XLA einsums.
    with attention.compile_for(target.kind):
      plan["train"] = compile_train_step(config, mcfg, train_mesh)
      plan["rollout"] = compile_rollout(config, mcfg, train_mesh, rollout_mesh)
      sp = sampling_params(config, mcfg)
      if config.rollout.engine == "continuous":  # the rollout phase's program
        paged = _paged_engine(config, mcfg, plan, target, rollout_mesh)
        plan["continuous_rollout"] = compile_continuous_rollout(config, mcfg, rollout_mesh, sp,
                                                                paged)
        if paged is not None:  # the same engine at the slots the closed form says fit its pool
          plan["paged_fit_rollout"] = _compile_paged_fit(config, mcfg, plan, target,
                                                         rollout_mesh, sp, paged)
      if estimate:  # programs the estimate alone needs: one that fails is reported, not fatal
        at_depth = functools.partial(_costs_at_depth, config=config, mcfg=mcfg)
        plan["cost_depths"] = list(COST_DEPTHS)
        plan["train_cost"] = at_depth(compile_train_cost, train_mesh)
        if not config.rollout.use_sampler_logprobs:
          plan["logprob"] = at_depth(compile_logprob, train_mesh)
        plan["decode"] = at_depth(compile_decode_costs, rollout_mesh, sp)
        plan["continuous"] = at_depth(compile_continuous, rollout_mesh, sp)  # dense engine
    plan["attention"] = attention.resolve_impl(
        config.model.attention_impl, platform=target.kind, dtype=mcfg.jnp_dtype,
        seq_len=config.data.max_prompt_length + config.rollout.max_response_length,
        head_dim=mcfg.dim_per_head)
  # The training state stays on the devices while rollout runs (with its resharded copy).
  state = plan["train"]["state_bytes"]
  # The move's source is the training shard in the model's dtype: the trained params themselves
  # when they are in that dtype, else a cast copy made next to them (fp32 master weights).
  src = plan["rollout"]["reshard"]["src"]
  held = src if plan["train"]["parts"]["params"] == src else 0
  rollout = plan.get("continuous_rollout", plan["rollout"])  # the configured engine's
  plan["phase_peaks"] = {"train": plan["train"]["peak"],
                         "reshard": state - held + plan["rollout"]["reshard"]["peak"],
                         "rollout": state + rollout["peak"]}
  lora_rollout = est.lora_rollout_bytes(config, mcfg, target.num_devices,
                                        rollout["parts"]["params"])
  if lora_rollout:  # the rollout reads merged kernels over a base in its layout, not a reshard
    plan["lora_rollout"], extra = lora_rollout, sum(lora_rollout.values())
    plan["phase_peaks"].update(reshard=state + extra, rollout=state + extra + rollout["peak"]
                               - rollout["parts"]["params"])
  plan["peak_bytes"] = max(plan["phase_peaks"].values())
  plan["fits"] = None if target.hbm_bytes is None else plan["peak_bytes"] <= target.hbm_bytes
  if "oom" in plan["train"] or "oom" in rollout:
    plan["fits"] = False
  if estimate and target.chip is not None and not target.analytic:
    plan["uncounted_flops"] = est.uncounted_flops(
        config, mcfg, target.num_devices, splash=plan["attention"] == "splash",
        logit_chunk_size=run_setup.train_config(config).logit_chunk_size)
    plan["estimate"] = est.step_estimate(config, plan, target.chip)
  if target.chip is not None and target.hbm_bytes is not None:  # closed form: any such target
    resident = plan["train"]["state_bytes"] + (  # LoRA: merged kernels (+ a base copy)
        sum(plan["lora_rollout"].values()) if "lora_rollout" in plan
        else plan["rollout"]["parts"]["params"])
    plan["paged_estimate"] = plan_paged.estimate(config, mcfg, target.chip, target.num_devices,
                                                 target.hbm_bytes, resident)
    plan["paged_estimate"]["compiled"] = plan_paged.compiled_engines(plan)
  return plan


def human_bytes(b: float) -> str:
  for unit, size in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
    if abs(b) >= size:
      return f"{b / size:8.2f} {unit}"
  return f"{b:8.0f} B  "


def format_plan(plan: dict[str, Any]) -> str:
  g = human_bytes
  lines = [f"dapo-plan: {plan['target']} ({plan['num_devices']} devices), "
           f"{plan['model_params'] / 1e6:,.1f}M params -- {plan['method']}",
           f"  mesh {plan['mesh']}  rollout mesh {plan['rollout_mesh']}  micro-batch "
           f"{plan['micro_batch_size']}  remat {plan['remat']}  prompts/rollout call "
           f"{plan['prompts_per_call']}"
           + (f"  attention {plan['attention']}" if "attention" in plan else ""),
           "  per device:"]
  t, r = plan["train"], plan["rollout"]
  how = lambda part: ("peak (compiled)" if "memory" in part else
                      "peak (compiler OOM)" if "oom" in part else "peak (estimate)")
  programs = [("train  ", t), ("rollout", r)]
  if "continuous_rollout" in plan:  # the configured engine's rollout, then the static sampler's
    c = plan["continuous_rollout"]
    lines.append(f"    (rollout: the continuous engine, {c['slots']} slots; static: the static "
                 f"sampler, {plan['prompts_per_call']} prompts per call)")
    programs = [("train  ", t), ("rollout", c), ("static ", r)]
  for label, part in programs:
    for name, b in part["parts"].items():
      lines.append(f"    {label} {name:<22}{g(b)}")
    lines.append(f"    {label} {how(part):<22}{g(part['peak'])}")
  rs = r["reshard"]
  lines.append(f"    reshard train->rollout peak     {g(rs['peak'])}  (src {g(rs['src'])} + dst "
               f"{g(rs['dst'])} + temp {g(rs['temp'])})")
  if "lora_rollout" in plan:  # no reshard of the weights: the merge (temporaries not counted)
    lr = plan["lora_rollout"]
    lines.append(f"    LoRA rollout weights: merged kernels {g(lr['merged'])} + base copy in the "
                 f"rollout layout {g(lr['resident'])}; phase reshard = the merge")
  for name, b in plan["phase_peaks"].items():
    lines.append(f"    phase {name:<24}{g(b)}")
  cap = plan["hbm_bytes"]
  verdict = ("unknown capacity" if cap is None else
             f"{'FITS' if plan['fits'] else 'DOES NOT FIT'} in {cap / GiB:.1f} GiB")
  lines.append(f"  peak {g(plan['peak_bytes'])} per device: {verdict}")
  f = plan["flops_analytic"]
  lora_part = (f", adapter merge {f['merge']:.3e} (LoRA: {f['adapter_params'] / 1e6:,.1f}M "
               f"adapter params, no base weight gradients)" if f.get("adapter_params") else "")
  lines.append(f"  FLOPs per RL step (analytic, all devices): rollout {f['rollout']:.3e}, "
               f"old log-probs {f['logprob']:.3e}, updates {f['train']:.3e}{lora_part}, "
               f"total {f['total']:.3e} = {f['total'] / plan['num_devices']:.3e} per device")
  if "flops_compiled" in t and t["flops_compiled"]:
    lines.append(f"  compiled FLOPs per device (loop bodies counted once): train step "
                 f"{t['flops_compiled']:.3e} x {t['num_micro_batches']} micro-batches, rollout "
                 f"call {r['flops_compiled']:.3e}")
  for name, part in (("train step", t), ("rollout", r),
                     ("continuous engine", plan.get("continuous_rollout", {}))):
    if "oom" in part:
      o = part["oom"]
      lines.append(f"  the compiler refused the {name}: {o['what']} need "
                   f"{o['required'] / GiB:.2f} GiB, {o['available'] / GiB:.2f} GiB available")
  if "compile_seconds" in t:
    extra = (f", continuous engine {plan['continuous_rollout']['compile_seconds']:.0f} s"
             if "continuous_rollout" in plan else "")
    lines.append(f"  compile time: train step {t['compile_seconds']:.0f} s, rollout "
                 f"{r['compile_seconds']:.0f} s{extra}")
  lines += format_estimate(plan)
  if "paged_estimate" in plan:
    cont = plan.get("estimate", {}).get("phases", {}).get("rollout_continuous", {})
    lines += plan_paged.format_lines(plan["paged_estimate"], cont.get("seconds"))
  lines += [f"  warning: {w}" for w in plan["warnings"]]
  return "\n".join(lines)


_PHASE_NAMES = {"rollout": "rollout (static sampler)", "old_logprob": "old log-probs",
                "update": "updates", "rollout_continuous": "rollout (continuous engine)"}


def _seconds(s: float) -> str:
  return f"{s / 3600:6.2f} h " if s >= 3600 else f"{s:8.1f} s" if s >= 1 else f"{s * 1e3:8.1f} ms"


def format_estimate(plan: dict[str, Any]) -> list[str]:
  """The step-time estimate's lines (none when the plan has none)."""
  e = plan.get("estimate")
  if e is None:
    return []
  chip, a = e["chip"], e["assumptions"]
  lines = [f"  step time ESTIMATE (roofline from the compiled programs' cost analysis at "
           f"{chip['flops_per_s'] / 1e12:.0f} TFLOP/s and {chip['hbm_bytes_per_s'] / 1e9:.0f} "
           f"GB/s per chip, {chip['source']}; one generation batch; no communication time):"]
  for phase, v in e["phases"].items():
    parts = ", ".join(f"{name} x{p['runs']:,.0f} {p['seconds']:.3g} s ({p['bound']})"
                      for name, p in v["programs"].items())
    lines.append(f"    {_PHASE_NAMES.get(phase, phase):<29}{_seconds(v['seconds'])}  [{parts}]")
  if e["step_seconds"] is not None:
    label = f"RL step ({e.get('rollout_engine', 'static')} rollout)"
    lines.append(f"    {label:<29}{_seconds(e['step_seconds'])}  "
                 f"update MFU {100 * e['update_mfu']:.0f}% (estimate)")
  for phase in e["missing"]:  # its programs did not compile: their errors are in the plan
    key = {"rollout": "decode", "old_logprob": "logprob", "update": "train_cost",
           "rollout_continuous": "continuous"}[phase]
    why = plan.get(key, {}).get("error") or plan.get(key, {}).get("oom") or "not compiled"
    lines.append(f"    {_PHASE_NAMES[phase]:<29}not estimated: {why}")
  if "rollout_continuous" in e["phases"]:
    lines.append(f"    (continuous engine: mean response {a['mean_response_fraction']:.2f} x "
                 f"max_response_length, {100 * a['slot_utilization']:.0f}% of slot-steps busy)")
  return lines


def _define(fv) -> None:
  flags.DEFINE_string("target", None, "tpu:v5p:4x4x4 | gpu:h100:16x8 | cpu:8", flag_values=fv)
  flags.DEFINE_integer("layers", None, "compile only this many decoder layers (quick what-ifs: "
                       "two runs give the memory per layer); not a plan for the full model",
                       flag_values=fv)
  flags.DEFINE_string("json", None, "also write the plan as JSON here", flag_values=fv)
  flags.DEFINE_bool("estimate", True, "with --noestimate, memory only: no step-time estimate "
                    "(skips its 1- and 2-layer compiles)", flag_values=fv)
  flags.mark_flag_as_required("target", flag_values=fv)


def _parse(argv: Sequence[str]) -> flags.FlagValues:
  """The flags; ``--set x=y`` (the old syntax, deprecated) is read as ``--config.x=y``."""
  argv, old = list(argv), []
  while "--set" in argv:
    i = argv.index("--set")
    old.append(argv[i + 1] if i + 1 < len(argv) else "")
    argv[i:i + 2] = [f"--config.{old[-1]}"]
  argv = [f"--config.{a.split('=', 1)[1]}" if a.startswith("--set=") else a for a in argv]
  if old:
    print(f"dapo-plan: --set is deprecated; write --config.{old[0]}", file=sys.stderr)
  return cli.parse("dapo-plan", __doc__, argv, _define)


def configure(fv: flags.FlagValues) -> ml_collections.ConfigDict:
  config = fv.config
  if fv.layers:
    with config.model.overrides.unlocked():  # a config file may leave it empty (and locked)
      config.model.overrides.num_hidden_layers = fv.layers
  return config


# What libtpu reads at start-up on a TPU VM; on a host without TPU chips it logs errors for each
# one it misses (and queries the GCE metadata server). AOT compiles only need them present.
_TPU_NAMES = {"v4": "v4-{cores}", "v5p": "v5p-{cores}", "v5e": "v5litepod-{chips}",
              "v5litepod": "v5litepod-{chips}", "v6e": "v6e-{chips}"}


def libtpu_compile_env(target: str) -> dict[str, str]:
  """The libtpu environment of a compile-only client for ``target`` (``tpu:v5p:2x2x1``)."""
  kind, _, rest = target.partition(":")
  if kind != "tpu":
    return {}
  gen, _, topo = rest.partition(":")
  try:
    chips = math.prod(int(s) for s in topo.split("x"))
  except ValueError:
    chips = 1
  name = _TPU_NAMES.get(gen.lower(), gen.lower() + "-{cores}").format(chips=chips,
                                                                      cores=2 * chips)
  return {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": name,
          "TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0"}


def _has_local_tpu() -> bool:
  return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def prepare_libtpu_env(target: str, environ=None) -> dict[str, str]:
  """Sets ``libtpu_compile_env`` before libtpu loads, on hosts without TPU chips only and never
  over a value the user set; returns what it set."""
  environ = os.environ if environ is None else environ
  if _has_local_tpu():
    return {}
  added = {k: v for k, v in libtpu_compile_env(target).items() if k not in environ}
  environ.update(added)
  return added


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  fv = _parse(sys.argv[1:] if argv is None else argv)
  prepare_libtpu_env(fv.target)  # before parse_target loads the backends (and libtpu)
  config = configure(fv)
  libtpu_flags.apply(config)  # the trainer's compiler options (dapo-train applies the same)
  target = parse_target(fv.target)
  plan = make_plan(config, target, estimate=None if fv.estimate else False)
  print(format_plan(plan))
  if fv.json:
    epath.Path(cli.expand(fv.json)).write_text(json.dumps(plan, indent=2))
  return plan


def run() -> None:
  cli.exit_on_error("dapo-plan", main)


if __name__ == "__main__":
  run()
