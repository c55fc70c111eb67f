r"""``dapo-plan``: will a config fit a slice? Per-device memory and FLOPs before renting it.

  dapo-plan --config configs/dapo_qwen2_5_32b.py --target tpu:v5p:4x4x4 \
      --config.optim.micro_batch_size=8 --config.rollout.prompts_per_call=48
  dapo-plan --config configs/dapo_qwen2_5_32b.py --target gpu:h100:16x8 \
      --config.optim.micro_batch_size=16 --config.mesh=data=1,fsdp=-1,tensor=8
  dapo-plan --config configs/tiny_cpu.py --target cpu:8

Overrides are dapo-train's ``--config.x=y`` (``--set x=y`` is a deprecated alias of it).

TPU, GPU and CPU targets compile the real train step, rollout program and train->rollout
reshard ahead of time (TPU through libtpu, GPU through the CUDA plugin, both on compile-only
devices, so a CPU-only host suffices) and read XLA's memory and cost analyses. Without the CUDA
plugin a GPU target gets an analytic estimate, labelled as such, with how to get the compiled one.

Where the chip's datasheet peaks are known (TPU and GPU targets; `plan_estimates.CHIPS`), the
plan also compiles the old-log-prob forward, the static sampler's prefill and decode step and the
continuous engine's programs, and prints a roofline ESTIMATE of one RL step by phase: each
program's FLOPs and HBM bytes (XLA's cost analysis, which counts a loop body once, so the runs
are multiplied out explicitly) at peak compute or bandwidth, whichever binds; and the update's
implied MFU. It leaves out communication and host time.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys
import types
from typing import Any, Sequence

from absl import flags
from etils import epath
from jax.sharding import Mesh

from dapo_jax.infra import libtpu_flags
from dapo_jax.infra import sharding as shd
from dapo_jax.models import Qwen2Config, attention
from dapo_jax.planner import gpu_targets
from dapo_jax.planner import plan_estimates as est
from dapo_jax.planner import plan_overlap
from dapo_jax.planner import plan_packing
from dapo_jax.planner import plan_paged
from dapo_jax.planner import plan_split
from dapo_jax.planner.programs import (REFUSAL_HINT, ProgramCompileError, compile_continuous,
                                       compile_continuous_rollout, compile_decode_costs,
                                       compile_logprob, compile_rollout, compile_train_cost,
                                       compile_train_step, plan_model_config, reported,
                                       sampling_params)
from dapo_jax.planner.report import format_plan
from dapo_jax.planner.targets import Target, parse_target, prepare_libtpu_env
from dapo_jax.rollout.sampling import SamplingParams
from dapo_jax.spec import cli
from dapo_jax.spec.run_spec import RunSpec

GiB = 1024**3


# Depths the estimate's programs are compiled at (unrolled) to get their cost at the model's.
COST_DEPTHS = (1, 2)
# The memory programs, by their plan keys: one the compiler refuses (not for HBM) is a row of the
# plan and its one error line (`refusals`), the plan of the others still made and printed.
MEMORY_PROGRAMS = (("train", "train step"), ("rollout", "static sampler's rollout call"),
                   ("continuous_rollout", "continuous engine"))


def _costs_at_depth(compile_fn, *args, spec: RunSpec, mcfg: Qwen2Config) -> dict[str, Any]:
  """``compile_fn(spec, mcfg, *args)`` with every program cost at the model's depth.

  XLA's cost analysis counts a loop body once, so a scanned decoder (``scan_layers``) would
  count one of its layers. A program's cost is affine in the number of layers, so it is compiled
  with ``COST_DEPTHS`` unrolled layers (small, quick compiles) and extrapolated
  (``plan_estimates.costs_at_depth``); the memory figures come from the full programs.
  """
  runs = [reported(compile_fn, spec, mcfg.replace(num_hidden_layers=d, scan_layers=False),
                    *args) for d in COST_DEPTHS]
  return est.costs_at_depth(runs[0], runs[1], COST_DEPTHS, mcfg.num_hidden_layers)


def _resident_bytes(plan: dict[str, Any]) -> int:
  """What stays on a chip through rollout besides the KV: the training state and the rollout
  weights (the paged pool is sized from the rest)."""
  return plan["train"]["state_bytes"] + plan["rollout"]["parts"]["params"]


def _paged_engine(spec: RunSpec, mcfg: Qwen2Config, plan: dict[str, Any], target: Target,
                  mesh: Mesh):
  """The configured continuous engine's `PagedSpec` on the target (None: dense cache)."""
  shards = math.prod(shd.batch_axes(mesh, shd.SAMPLE_RULES).values())
  return plan_paged.engine_spec(spec, mcfg, target.kind, mesh.shape.get("tensor", 1), shards,
                                target.hbm_bytes, _resident_bytes(plan))


def _compile_paged_fit(spec: RunSpec, mcfg: Qwen2Config, plan: dict[str, Any], target: Target,
                       mesh: Mesh, sp: SamplingParams, paged) -> dict[str, Any]:
  """The paged engine's chunk at the slots the closed form says fit its pool (when that is not
  the configured count): the memory of the engine the estimate's "slots that fit" row runs."""
  if target.chip is None or target.hbm_bytes is None:
    return {"skipped": "no datasheet peaks or HBM size for this target"}
  pe = plan_paged.estimate(spec, mcfg, target.chip, target.num_devices, target.hbm_bytes,
                           _resident_bytes(plan))
  slots = pe["slots_fit_per_shard"] * paged.shards
  if not slots or slots == spec.rollout.max_concurrent_decodes:
    return {"skipped": f"{slots} slots fit: the configured engine's compile is that program"}
  fit = dataclasses.replace(spec, rollout=dataclasses.replace(spec.rollout,
                                                              max_concurrent_decodes=slots))
  return reported(compile_continuous_rollout, fit, mcfg, mesh, sp,
                   dataclasses.replace(paged, num_pages=pe["pool_pages"]))


def make_plan(spec: RunSpec, target: Target, estimate: bool | None = None) -> dict[str, Any]:
  """The plan of the run ``spec`` (validated: `RunSpec.from_config`, as `configure` builds it)
  on ``target`` as a JSON-able dict; compiles unless the target is analytic.

  ``estimate`` (default: when the target's chip has datasheet peaks) also compiles the
  programs the step-time estimate needs (old-log-prob forward, the static sampler's prefill
  and decode step, the continuous engine) and adds ``plan["estimate"]``.
  """
  if estimate is None:  # GPU: XLA's cost analysis of a GPU program is empty (`GPU_COST_NOTE`)
    estimate = target.chip is not None and target.kind != "gpu"
  mcfg = plan_model_config(spec.model, spec.tokenizer)
  # optim.packing: one mini-batch of the plan's length mix as the trainer packs it; the
  # attention the packed kernel executes (TPU splash: the blocks it does not skip).
  impl = attention.resolve_impl(spec.model.attention_impl, platform=target.kind,
                                dtype=mcfg.jnp_dtype, head_dim=mcfg.dim_per_head,
                                seq_len=spec.optim.max_tokens_per_row or spec.sizes.max_length)
  packed = plan_packing.packed_shape(spec, plan_packing.num_batch_shards(spec, target.num_devices),
                                     impl)
  plan: dict[str, Any] = {
      "target": f"{target.kind}:{target.name}", "num_devices": target.num_devices,
      "hbm_bytes": target.hbm_bytes, "model_params": mcfg.num_params(),
      "mesh": [list(a) for a in spec.mesh],
      "rollout_mesh": [list(a) for a in (spec.rollout_mesh or spec.mesh)],
      "micro_batch_size": spec.optim.micro_batch_size, "remat": spec.model.remat,
      "prompts_per_call": spec.sizes.prompts_per_call,
      "flops_analytic": est.step_flops(spec, mcfg, packed), "packing": packed}
  plan["warnings"] = est.layout_warnings(spec, mcfg, target.num_devices)
  if target.analytic:
    plan["method"] = ("analytic estimate (no compiler for this target on this host"
                      + (f": {target.why_analytic})" if target.why_analytic else ")"))
    plan.update(est.analytic_memory(spec, mcfg, target.num_devices,
                                    spec.train_config().master_dtype, packed))
  else:
    plan["method"] = f"compiled ahead of time for {target.num_devices} {target.kind} devices"
    if target.kind == "gpu":  # what the compiles assumed, for the launchers to match
      plan["gpu_flags"] = {"XLA_FLAGS": " ".join(gpu_targets.XLA_GPU_FLAGS), **gpu_targets.GPU_ENV,
                           "NCCL": "library defaults (no NCCL_* set; no communication time "
                                   "counted)"}
    devices = list(target.devices)
    train_mesh = shd.make_mesh([tuple(a) for a in spec.mesh], devices=devices)
    rollout_mesh = shd.make_mesh([tuple(a) for a in (spec.rollout_mesh or spec.mesh)],
                                 devices=devices)
    # Kernels as on the target: "auto" attention is Pallas splash on TPU, not the XLA einsums.
    with attention.compile_for(target.kind):
      plan["train"] = compile_train_step(spec, mcfg, train_mesh)
      plan["rollout"] = compile_rollout(spec, mcfg, train_mesh, rollout_mesh)
      sp = sampling_params(spec.rollout, mcfg)
      if spec.rollout.engine == "continuous":  # the rollout phase's program
        paged = _paged_engine(spec, mcfg, plan, target, rollout_mesh)
        plan["continuous_rollout"] = compile_continuous_rollout(spec, mcfg, rollout_mesh, sp,
                                                                paged)
        if paged is not None:  # the same engine at the slots the closed form says fit its pool
          plan["paged_fit_rollout"] = _compile_paged_fit(spec, mcfg, plan, target,
                                                         rollout_mesh, sp, paged)
      if estimate:  # programs the estimate alone needs: one that fails is reported, not fatal
        at_depth = functools.partial(_costs_at_depth, spec=spec, mcfg=mcfg)
        plan["cost_depths"] = list(COST_DEPTHS)
        plan["train_cost"] = at_depth(compile_train_cost, train_mesh)
        if not spec.rollout.use_sampler_logprobs:
          plan["logprob"] = at_depth(compile_logprob, train_mesh)
        plan["decode"] = at_depth(compile_decode_costs, rollout_mesh, sp)
        plan["continuous"] = at_depth(compile_continuous, rollout_mesh, sp)  # dense engine
    plan["attention"] = attention.resolve_impl(
        spec.model.attention_impl, platform=target.kind, dtype=mcfg.jnp_dtype,
        seq_len=spec.sizes.max_length, head_dim=mcfg.dim_per_head)
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
  lora_rollout = est.lora_rollout_bytes(spec, mcfg, target.num_devices,
                                        rollout["parts"]["params"])
  if lora_rollout:  # the rollout reads merged kernels over a base in its layout, not a reshard
    plan["lora_rollout"], extra = lora_rollout, sum(lora_rollout.values())
    plan["phase_peaks"].update(reshard=state + extra, rollout=state + extra + rollout["peak"]
                               - rollout["parts"]["params"])
  plan["peak_bytes"] = max(plan["phase_peaks"].values())
  plan["fits"] = None if target.hbm_bytes is None else plan["peak_bytes"] <= target.hbm_bytes
  if "oom" in plan["train"] or "oom" in rollout:
    plan["fits"] = False
  plan["refused"] = [f"the {name} ({plan[key]['refused']['program']}) for {plan['target']}: "
                     f"{plan[key]['refused']['what']}" for key, name in MEMORY_PROGRAMS
                     if "refused" in plan.get(key, {})]
  if plan["refused"] and plan["fits"]:  # its peak lacks what the refused program needs
    plan["fits"] = None
  if estimate and target.chip is not None and not target.analytic:
    plan["uncounted_flops"] = est.uncounted_flops(
        spec, mcfg, target.num_devices, splash=plan["attention"] == "splash",
        logit_chunk_size=spec.train_config().logit_chunk_size, packed=packed)
    plan["estimate"] = est.step_estimate(spec, plan, target.chip)
  if target.kind == "gpu" and target.chip is not None:
    plan["gpu_compute_floor"] = gpu_compute_floor(plan, target)
  if target.chip is not None and target.hbm_bytes is not None:  # closed form: any such target
    resident = plan["train"]["state_bytes"] + (  # LoRA: merged kernels (+ a base copy)
        sum(plan["lora_rollout"].values()) if "lora_rollout" in plan
        else plan["rollout"]["parts"]["params"])
    plan["paged_estimate"] = plan_paged.estimate(spec, mcfg, target.chip, target.num_devices,
                                                 target.hbm_bytes, resident)
    plan["paged_estimate"]["compiled"] = plan_paged.compiled_engines(plan)
    # The overlapped step (k = 1) on every split, next to the serial one (docs/overlap.md).
    plan["overlap_estimate"] = plan_overlap.for_plan(spec, mcfg, plan, target)
    if not target.analytic:  # the split a run would use, each set's programs compiled
      plan["overlap_estimate"]["compiled_split"] = plan_split.compile_split(
          spec, mcfg, plan["overlap_estimate"], target)
  return plan


# Checked with the CUDA plugin (jax 0.10.2): `cost_analysis()` of a compile-only GPU program
# reports no FLOPs and no bytes (its matmuls are cuBLAS calls, its attention cuDNN or Triton
# calls, all custom calls to the analysis), so the compiled roofline of TPU targets cannot be
# made; GPU plans give the analytic compute floor and the paged closed form instead.
GPU_COST_NOTE = ("no compiled step-time estimate on GPU: XLA's cost analysis of a GPU program "
                 "counts nothing (matmuls and attention are cuBLAS, cuDNN and Triton calls)")


def gpu_compute_floor(plan: dict[str, Any], target: Target) -> dict[str, Any]:
  """The update's and old-log-prob forward's time at peak bf16 FLOP/s from the analytic FLOPs
  (a floor: no memory, communication or kernel efficiency), per RL step."""
  f, chip = plan["flops_analytic"], target.chip
  per_s = chip.flops_per_s * target.num_devices
  return {"note": GPU_COST_NOTE, "source": chip.source, "flops_per_s": chip.flops_per_s,
          "update_seconds": f["train"] / per_s, "old_logprob_seconds": f["logprob"] / per_s,
          "rollout_compute_seconds": f["rollout"] / per_s}


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


def configure(fv: flags.FlagValues) -> RunSpec:
  """The run spec of the flags: ``--config`` and its overrides validated once
  (`RunSpec.from_config`), with ``--layers`` as ``model.overrides.num_hidden_layers``."""
  spec = RunSpec.from_config(fv.config)
  if fv.layers:
    overrides = types.MappingProxyType(dict(spec.model.overrides, num_hidden_layers=fv.layers))
    spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, overrides=overrides))
  return spec


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  fv = _parse(sys.argv[1:] if argv is None else argv)
  prepare_libtpu_env(fv.target)  # before parse_target loads the backends (and libtpu)
  gpu_targets.prepare_cuda_env(fv.target)  # ... and the CUDA plugin
  spec = configure(fv)
  # The trainer's compiler options (dapo-train applies the same).
  libtpu_flags.apply(spec.tpu_windowed_einsum)
  target = plan_overlap.analytic_target(fv.target, parse_target)  # TPU, no libtpu: analytic
  plan = make_plan(spec, target, estimate=None if fv.estimate else False)
  print(format_plan(plan))
  if fv.json:
    epath.Path(cli.expand(fv.json)).write_text(json.dumps(plan, indent=2))
  refusals(plan)
  return plan


def refusals(plan: dict[str, Any]) -> None:
  """Raises the one line of the memory programs the compiler refused (not for HBM), if any:
  which, for which target, the compiler's message (exit 2, after the plan of the others)."""
  if plan.get("refused"):
    raise ProgramCompileError(f"The compiler refused {'; and '.join(plan['refused'])} "
                              f"({REFUSAL_HINT}); the plan above has the other programs.")


def run() -> None:
  cli.exit_on_error("dapo-plan", main)


if __name__ == "__main__":
  run()
