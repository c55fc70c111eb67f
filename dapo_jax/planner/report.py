"""The plan printed: per-device memory by program and phase, FLOPs, the step-time estimate."""

from __future__ import annotations

from typing import Any

from dapo_jax.planner import plan_overlap
from dapo_jax.planner import plan_paged
from dapo_jax.planner.targets import GiB


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
  if "gpu_flags" in plan:  # what the GPU compiles assumed; the launchers set the same
    fl = plan["gpu_flags"]
    lines.insert(2, "  assumes " + "; ".join(f"{k}={v}" if k != "NCCL" else f"NCCL: {v}"
                                             for k, v in fl.items()))
  t, r = plan["train"], plan["rollout"]
  how = lambda part: ("peak (compiled)" if "memory" in part else
                      "peak (compiler OOM)" if "oom" in part else
                      "peak (refused: no temp)" if "refused" in part else "peak (estimate)")
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
             f"fit in {cap / GiB:.1f} GiB unknown: a program was refused" if plan["fits"] is None
             else f"{'FITS' if plan['fits'] else 'DOES NOT FIT'} in {cap / GiB:.1f} GiB")
  lines.append(f"  peak {g(plan['peak_bytes'])} per device: {verdict}")
  pk = plan.get("packing")
  if pk:  # optim.packing, at the plan's length mix (plan_packing)
    lines.append(
        f"  packing: a mini-batch of {pk['rows']} sequences (prompts ~{pk['mean_prompt_tokens']} "
        f"tokens, responses as the rollout estimate) in {pk['packed_rows']} rows of "
        f"{pk['budget']} ({pk['num_micro']} micro-batches x {pk['rows_per_cell']} rows a shard), "
        f"fill {100 * pk['fill']:.0f}%, {pk['positions_vs_padded']:.2f}x the padded positions; "
        f"attention {pk['attention_pairs'] / max(pk['attention_pairs_own_squares'], 1):.2f}x the "
        f"sequences' own causal squares"
        + (f" (blocks of {pk['attention_block']} skipped across segments)"
           if pk["attention_block"] else f" ({pk['attention_impl']}: the packed rows' "
           f"{'causal halves' if pk['attention_impl'] == 'cudnn' else 'whole squares'})"))
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
    if "refused" in part:  # not for HBM: `plan.refusals` gives the command's error line
      lines.append(f"  the compiler refused the {name} ({part['refused']['program']}): "
                   f"{part['refused']['what']}")
  if "compile_seconds" in t:
    extra = (f", continuous engine {plan['continuous_rollout']['compile_seconds']:.0f} s"
             if "continuous_rollout" in plan else "")
    lines.append(f"  compile time: train step {t['compile_seconds']:.0f} s, rollout "
                 f"{r['compile_seconds']:.0f} s{extra}")
  lines += format_estimate(plan)
  if "gpu_compute_floor" in plan:
    fl = plan["gpu_compute_floor"]
    lines += [f"  {fl['note']}.",
              f"  compute floor (analytic FLOPs at {fl['flops_per_s'] / 1e12:.0f} TFLOP/s per "
              f"GPU, {fl['source']}; no memory or communication time): updates "
              f"{_seconds(fl['update_seconds']).strip()}, old log-probs "
              f"{_seconds(fl['old_logprob_seconds']).strip()}, rollout FLOPs "
              f"{_seconds(fl['rollout_compute_seconds']).strip()} (decode is memory-bound: "
              "the paged closed form below)"]
  if "paged_estimate" in plan:
    cont = plan.get("estimate", {}).get("phases", {}).get("rollout_continuous", {})
    lines += plan_paged.format_lines(plan["paged_estimate"], cont.get("seconds"))
  if "overlap_estimate" in plan:
    lines += plan_overlap.format_lines(plan["overlap_estimate"])
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
