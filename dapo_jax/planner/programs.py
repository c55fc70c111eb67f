"""The programs `dapo-plan` compiles for a target: the train step, the rollout (static sampler,
old-log-prob forward, decode step, continuous engine), each with its memory and cost analyses.

One piece: every program is lowered, compiled and summarised through the same `_compile` (HBM
OOMs as rows; other refusals as rows of the memory programs, a plan's one error line, and an error
of a cost program) and `_summary`, so their figures share one basis.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dapo_jax.infra import sharding as shd
from dapo_jax.models import Qwen2Config, abstract_model, default_positions, get_preset, lora
from dapo_jax.models.qwen2 import Qwen2ForCausalLM
from dapo_jax.planner import plan_estimates as est
from dapo_jax.planner import plan_packing
from dapo_jax.rollout import slots as sl
from dapo_jax.rollout.sampler import Sampler
from dapo_jax.rollout.sampling import SamplingParams, sample_logits
from dapo_jax.spec.run_spec import ModelSpec, RolloutSpec, RunSpec, TokenizerSpec
from dapo_jax.trainer import packing, run_setup
from dapo_jax.trainer.train_step import (LogProbForward, PackedRows, TrainBatch, TrainState,
                                         TrainStep, make_optimizer, master_params)


class _VocabOnly:
  """Planning needs the vocabulary size, not the tokenizer files."""

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size


def plan_model_config(m: ModelSpec, tok: TokenizerSpec) -> Qwen2Config:
  """The run's architecture (``spec.model``, ``spec.tokenizer``), without reading tokenizer
  files (the preset's vocabulary is at least the Qwen2.5 tokenizer's, which is what a run uses
  too)."""
  if tok.kind == "char":
    size = run_setup.build_tokenizer(tok, m.checkpoint).vocab_size
  elif m.checkpoint:  # its config.json's vocabulary; dapo-train checks it against the tokenizer
    size = 0
  else:
    size = get_preset(m.preset).vocab_size
  return run_setup.model_config(m, tok.kind, _VocabOnly(size))


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


class ProgramCompileError(ValueError):
  """The compiler refused a program for another reason than HBM (e.g. a kernel's scoped VMEM):
  one line naming the program and the compiler's first words (dapo-plan exits 2 with it)."""


REFUSAL_HINT = "a config this target cannot compile, or a bug to report with the command"


def _refusal(lowered, err: Exception) -> dict[str, str]:
  """``{"program": the module's name, "what": the compiler's message in one line}``."""
  try:
    m = re.search(r"module @(\S+)", lowered.as_text()[:2000])
  except Exception:  # pylint: disable=broad-except
    m = None
  lines = [line.strip() for line in str(err).splitlines() if line.strip()]
  # A Python error raised inside the compiler (a custom partitioner's) is its last "...Error:"
  # line, under a traceback; XLA's own errors say what they are in their first lines.
  raised = [line for line in lines if re.match(r"^\w*(Error|Exception): ", line)]
  what = raised[-1] if raised else " ".join(lines[:2])
  what = what if len(what) <= 400 else what[:400] + " ..."
  return {"program": m.group(1) if m else "(unnamed)", "what": what}


def _refused(lowered, err: Exception) -> ProgramCompileError:
  r = _refusal(lowered, err)
  return ProgramCompileError(
      f"The compiler refused the program {r['program']}: {r['what']} ({REFUSAL_HINT})")


def reported(compile_fn, *args) -> dict[str, Any]:
  """``compile_fn(*args)``, or the error it raised (a program the memory plan does not need)."""
  try:
    return compile_fn(*args)
  except Exception as err:  # pylint: disable=broad-except
    return {"error": f"{type(err).__name__}: {err}"[:500]}


def _compile(lowered, keep_refusal: bool = False) -> tuple[Any, dict[str, Any] | None, float]:
  """(compiled, None, seconds), or (None, what the compiler lacked, seconds) when libtpu refuses
  a program that cannot fit in HBM (it says by how much); any other refusal raises
  `ProgramCompileError`, or with ``keep_refusal`` gives (None, ``{"refused": `_refusal`}``,
  seconds): a memory program's row, so the plan of the others is still made."""
  start = time.perf_counter()
  try:
    compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as err:
    m = _OOM.search(str(err))
    if "RESOURCE_EXHAUSTED" not in str(err) or m is None:
      if keep_refusal:
        return None, {"refused": _refusal(lowered, err)}, time.perf_counter() - start
      raise _refused(lowered, err) from err
    return None, {"what": m.group(1), "required": _to_bytes(m.group(2), m.group(3)),
                  "available": _to_bytes(m.group(4), m.group(5))}, time.perf_counter() - start
  return compiled, None, time.perf_counter() - start


def _summary(compiled, oom, seconds: float, parts: dict[str, int], temp_part: str,
             temp_known: int = 0) -> dict[str, Any]:
  """Compiled memory and FLOPs. On a compiler OOM the temporaries it asked for fill
  ``temp_part`` (less ``temp_known``, listed in another part), so the peak is what it needed;
  on another refusal (``oom`` is ``{"refused": ...}``) the peak is the parts known without it."""
  out = {"parts": parts, "compile_seconds": round(seconds, 1)}
  if compiled is None and "refused" in oom:
    return out | {"refused": oom["refused"], "peak": sum(parts.values()), "flops_compiled": 0.0}
  if compiled is None:
    if oom["what"] == "HLO temporaries":
      parts[temp_part] = max(oom["required"] - temp_known, 0)
    return out | {"oom": oom, "peak": sum(parts.values()), "flops_compiled": 0.0}
  mem, cost = _mem(compiled), _cost(compiled)
  return out | {"memory": mem, "peak": peak_bytes(mem), "flops_compiled": cost.flops,
                "bytes_compiled": cost.bytes}


def _train_program(spec: RunSpec, mcfg: Qwen2Config, mesh: Mesh):
  """The train step lowered for one optimizer update on a mini-batch, with its abstract inputs."""
  tcfg = spec.train_config()
  lcfg = lora.LoRAConfig.from_config(spec.model.lora)
  model = nnx.eval_shape(lambda: lora.add_adapters(Qwen2ForCausalLM(mcfg, rngs=nnx.Rngs(0)),
                                                   lcfg))
  # As `init_train_state`: the trained params (every Param, or the LoRA adapters alone, the base
  # then frozen in `rest`) get fp32 master weights (and so fp32 Adam moments) for a bf16 model.
  graphdef, params, rest = nnx.split(model, lora.Adapter if lcfg.rank else nnx.Param, ...)
  params = jax.eval_shape(functools.partial(master_params, cfg=tcfg), params)
  opt_state = jax.eval_shape(make_optimizer(tcfg).init, params)
  scalar = jax.ShapeDtypeStruct((), jnp.int32)
  state = TrainState(params, rest, opt_state, scalar, scalar)
  rows = spec.sizes.rows_per_update
  p, r = spec.data.max_prompt_length, spec.rollout.max_response_length
  sds = jax.ShapeDtypeStruct
  packed = packed_rows_abstract(spec, mesh)
  if packed is not None:  # optim.packing: the plan's mix packed, in sequence slots
    rows = packed.token_index.shape[0]
  # Only the fields the loss reads: jit drops unused inputs from the compiled program.
  batch = TrainBatch(input_ids=None if packed else sds((rows, p + r), jnp.int32),
                     attention_mask=None if packed else sds((rows, p + r), jnp.bool_),
                     response_mask=sds((rows, r), jnp.bool_),
                     old_log_probs=sds((rows, r), jnp.float32),
                     advantages=sds((rows,), jnp.float32),
                     truncated=sds((rows,), jnp.bool_) if tcfg.overlong_filter else None,
                     sampler_log_probs=(sds((rows, r), jnp.float32)
                                        if tcfg.rollout_is != "none" else None),
                     packed=packed)
  if packed is not None:
    tcfg = tcfg.replace(num_micro_batches=packed.num_micro)
  return TrainStep(graphdef, tcfg, mesh).lower(state, batch), state, batch, tcfg


def packed_rows_abstract(spec: RunSpec, mesh: Mesh) -> PackedRows | None:
  """Abstract `PackedRows` of one mini-batch of the plan's length mix (`plan_packing`), packed
  for the mesh's batch shards; None when the run does not pack."""
  shape = plan_packing.packed_shape(spec, packing.num_batch_shards(mesh), "xla")
  if shape is None:
    return None
  sds = jax.ShapeDtypeStruct
  tokens = sds((shape["packed_rows"], shape["budget"]), jnp.int32)
  return PackedRows(input_ids=tokens, positions=tokens, segment_ids=tokens,
                    token_index=sds((shape["slots"], spec.rollout.max_response_length),
                                    jnp.int32),
                    num_shards=shape["num_shards"], num_micro=shape["num_micro"])


def compile_train_step(spec: RunSpec, mcfg: Qwen2Config, mesh: Mesh) -> dict[str, Any]:
  """AOT-compiles one optimizer update on a mini-batch; memory split by what holds it."""
  lowered, state, batch, tcfg = _train_program(spec, mcfg, mesh)
  params, opt_state = state.params, state.opt_state
  rows = batch.response_mask.shape[0]  # trajectories (packed: sequence slots)
  compiled, oom, seconds = _compile(lowered, keep_refusal=True)
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


def compile_train_cost(spec: RunSpec, mcfg: Qwen2Config, mesh: Mesh) -> dict[str, Any]:
  """The train step compiled for its cost alone: one micro-batch loop body (with the
  optimizer update, a small overcount) per run."""
  lowered, _, _, tcfg = _train_program(spec, mcfg, mesh)
  return _lower_and_cost(lowered) | {"num_micro_batches": tcfg.num_micro_batches}


def sampling_params(rollout: RolloutSpec, mcfg: Qwen2Config) -> SamplingParams:
  """The rollout's sampling settings (``spec.rollout``), stopping at the model's EOS."""
  return SamplingParams(temperature=rollout.temperature, top_p=rollout.top_p,
                        top_k=rollout.top_k, max_new_tokens=rollout.max_response_length,
                        eos_ids=(mcfg.eos_token_id or 0,), pad_id=mcfg.eos_token_id or 0)


def compile_rollout(spec: RunSpec, mcfg: Qwen2Config, train_mesh: Mesh, rollout_mesh: Mesh
                    ) -> dict[str, Any]:
  """AOT-compiles one rollout call (prefill + decode loop) and the train -> rollout reshard."""
  graphdef, state = nnx.split(abstract_model(mcfg))
  rollout_sh = shd.state_shardings(state, rollout_mesh, shd.SAMPLE_RULES)
  train_sh = shd.state_shardings(state, train_mesh, shd.TRAIN_RULES)
  b, g = spec.sizes.prompts_per_call, spec.rollout.n
  p = spec.data.max_prompt_length
  prompt_sh = shd.prompt_sharding(rollout_mesh, shd.SAMPLE_RULES, b, g)
  key = jax.eval_shape(lambda: jax.random.key(0))
  key = jax.ShapeDtypeStruct(key.shape, key.dtype,
                             sharding=NamedSharding(rollout_mesh, PartitionSpec()))
  sp = sampling_params(spec.rollout, mcfg)
  sampler = Sampler(graphdef, mesh=rollout_mesh, rules=shd.SAMPLE_RULES)
  ids = jax.ShapeDtypeStruct((b, p), jnp.int32, sharding=prompt_sh)
  mask = jax.ShapeDtypeStruct((b, p), jnp.bool_, sharding=prompt_sh)
  compiled, oom, seconds = _compile(sampler._program.lower(  # pylint: disable=protected-access
      _abstract(state, rollout_sh), ids, mask, key, params=sp, num_samples=g), keep_refusal=True)
  kv = est.kv_cache_bytes_per_device(mcfg, rollout_mesh, b * g, spec.sizes.max_length)
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


def compile_logprob(spec: RunSpec, mcfg: Qwen2Config, mesh: Mesh) -> dict[str, Any]:
  """AOT-compiles the old-log-prob forward over a step's trajectories (the trainer's one call:
  `forward_micro_batch_size` rows at a time, a loop whose body the cost analysis counts once)."""
  tcfg = spec.train_config()
  graphdef, params, rest = nnx.split(abstract_model(mcfg), nnx.Param, ...)
  params = jax.eval_shape(functools.partial(master_params, cfg=tcfg), params)
  rows = spec.sizes.rows_per_step
  r = spec.rollout.max_response_length
  t = spec.sizes.max_length
  ids = jax.ShapeDtypeStruct((rows, t), jnp.int32)
  mask = jax.ShapeDtypeStruct((rows, t), jnp.bool_)
  forward = LogProbForward(graphdef, tcfg, mesh, rest=rest)
  packed = packed_rows_abstract(spec, mesh)
  if packed is not None:  # one mini-batch's packed forward, once per mini-batch of the step
    loops = packed.num_micro * (spec.sizes.rows_per_step // spec.sizes.rows_per_update)
    return _lower_and_cost(forward.lower_packed(params, packed)) | {
        "rows": packed.input_ids.shape[0], "loop_runs": loops}
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


def compile_decode_costs(spec: RunSpec, mcfg: Qwen2Config, mesh: Mesh, sp: SamplingParams
                         ) -> dict[str, Any]:
  """The static sampler's pieces, compiled alone for their costs (in the rollout program they
  sit in `while_loop`s whose bodies XLA's cost analysis counts once): the prefill of a call's
  prompts, and one decode step of its B*G rows (the model's `decode_step`, as the sampler runs
  it, then sampling) over the cache lengths of the shortest and the longest decode loop."""
  graphdef, state = nnx.split(abstract_model(mcfg))
  state = _abstract(state, shd.state_shardings(state, mesh, shd.SAMPLE_RULES))
  b = spec.sizes.prompts_per_call
  g, p = spec.rollout.n, spec.data.max_prompt_length
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


def _continuous_programs(spec: RunSpec, mcfg: Qwen2Config, mesh: Mesh, sp: SamplingParams,
                         paged=None, keep_refusal: bool = False):
  """The continuous engine's programs (`rollout/slot_programs.py`) lowered as the trainer's
  `ContinuousSampler` runs them: its state (`init`: the slots' KV cache, or with ``paged`` (a
  `PagedSpec`) the page pools and tables, and the prompt queue),
  an `enqueue` that prefills one prompt into the queue (in steady state the queue frees an
  entry at a time) and a chunk of decode steps with in-loop admission. Returns a dict with the
  slot and queue sizes, the rollout parameters' bytes per device and either the lowered
  `enqueue` and `chunk` with the engine state's bytes per device, or the compiler's OOM for
  the state (with ``keep_refusal``, `_compile`'s refusal too)."""
  from dapo_jax.rollout import (
    continuous,  # pylint: disable=g-import-not-at-top
    engine_programs,  # pylint: disable=g-import-not-at-top
  )
  from dapo_jax.rollout import slot_programs as prog  # pylint: disable=g-import-not-at-top
  graphdef, state = nnx.split(abstract_model(  # its caches as rollout.kv_cache_dtype
      mcfg.replace(kv_cache_dtype=spec.rollout.kv_cache_dtype)))
  state_sh = shd.state_shardings(state, mesh, shd.SAMPLE_RULES)
  state = _abstract(state, state_sh)
  p, r, g = spec.data.max_prompt_length, spec.rollout.max_response_length, spec.rollout.n
  sampler = continuous.ContinuousSampler(
      graphdef, num_slots=spec.rollout.max_concurrent_decodes, mesh=mesh,
      max_prefill_length=p)
  prog_mesh = sampler.mesh
  q = sampler.queue_prompts(g)
  prompt_slots = sl.prefill_bucket(p)
  init = prog.init_program.lower(
      state, graphdef=graphdef, num_slots=sampler.num_slots, queue_size=q, num_samples=g,
      prompt_length=prompt_slots, cache_length=prompt_slots + r, mesh=prog_mesh, paged=paged)
  init_compiled, oom, _ = _compile(init, keep_refusal)
  info = {"slots": sampler.num_slots, "enqueue_rows": 1, "queue_prompts": q,
          "chunk_steps": sampler.chunk_steps, "params": shd.per_device_bytes(state, state_sh)}
  if init_compiled is None:
    return info | {"failure": oom}
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


def compile_continuous(spec: RunSpec, mcfg: Qwen2Config, mesh: Mesh, sp: SamplingParams
                       ) -> dict[str, Any]:
  """The continuous engine's enqueue and chunk compiled for their costs (the chunk's loop body,
  one decode step with admission, counted once)."""
  progs = _continuous_programs(spec, mcfg, mesh, sp)
  info = {k: progs[k] for k in ("slots", "enqueue_rows", "queue_prompts", "chunk_steps")}
  if "failure" in progs:
    return info | {"oom": progs["failure"]}
  return info | {"enqueue": _lower_and_cost(progs["enqueue"]),
                 "decode_chunk": _lower_and_cost(progs["chunk"])}


def compile_continuous_rollout(spec: RunSpec, mcfg: Qwen2Config, mesh: Mesh, sp: SamplingParams,
                               paged=None) -> dict[str, Any]:
  """The continuous engine's memory: its chunk program at the model's depth, whose inputs are
  the rollout parameters and the engine state (the slots' KV cache at the full prompt +
  response length, which never grows, or with ``paged`` the page pools, and the prompt
  queue)."""
  progs = _continuous_programs(spec, mcfg, mesh, sp, paged, keep_refusal=True)
  parts = {"params": progs["params"], "engine_state": progs.get("engine_bytes", 0),
           "other_temp": 0, "outputs": 0}
  info = {"slots": progs["slots"], "queue_prompts": progs["queue_prompts"]}
  if paged is not None:
    info["paged"] = {"pages_per_shard": paged.num_pages, "page_size": paged.page_size,
                     "shards": paged.shards,
                     "impl": attention_impl_on_target(paged.impl, mcfg.dim_per_head)}
  if "failure" in progs:  # the state alone does not fit (or its program is refused)
    return _summary(None, progs["failure"], 0.0, parts, "engine_state", temp_known=0) | info
  compiled, oom, seconds = _compile(progs["chunk"], keep_refusal=True)
  if compiled is not None:
    mem = _mem(compiled)
    parts["other_temp"], parts["outputs"] = mem["temp"], max(mem["output"] - mem["alias"], 0)
    if paged is not None:  # Pallas kernels (TPU or Triton custom calls), a scan's body once
      info["kernel_calls"] = kernel_calls(compiled.as_text())
  return _summary(compiled, oom, seconds, parts, "other_temp") | info


# The custom-call targets of a Pallas kernel: Mosaic on TPU, Triton on GPU.
PALLAS_CALL_TARGETS = ("tpu_custom_call", "__gpu$xla.gpu.triton")


def kernel_calls(hlo_text: str) -> int:
  """Pallas kernel calls in a compiled program's HLO text."""
  return sum(hlo_text.count(f'custom_call_target="{t}"') for t in PALLAS_CALL_TARGETS)


def attention_impl_on_target(impl: str, head_dim: int | None = None) -> str:
  """The paged attention ``impl`` resolved for the platform being compiled for and the model's
  ``head_dim``."""
  from dapo_jax.models import paged_attention  # pylint: disable=g-import-not-at-top
  return paged_attention.resolve_paged_impl(impl, head_dim=head_dim)
