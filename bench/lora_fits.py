r"""Which Qwen2.5 sizes fit which single-accelerator notebook runtime, LoRA vs full fine-tuning:
dapo-plan's ANALYTIC estimate (plan_estimates.analytic_memory) for GPU targets, per model size,
runtime and adapter rank, at the largest rollout call (prompts x G rows) that fits with 5% of the
usable memory to spare.

    python bench/lora_fits.py --out bench/results/lora_plan/fits_gpu.json

Every row uses configs/qwen25_1_5b_lora.py (1024 prompt + 3072 response tokens, G = 8,
micro-batch 1, remat full; --config for another) with only the preset and the rank changed.
The rollout is the static sampler's call (the analytic estimate's). This script makes no
compiles: a tpu: target gets the same analytic estimate (dapo-plan itself compiles TPU targets;
docs/lora.md, "What fits where", has both).

    python bench/lora_fits.py --config configs/qwen25_math_7b_lora.py \
        --presets qwen2.5-math-7b --targets tpu:v5e:2x4,tpu:v4:2x2x1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dapo_jax.planner import plan as plan_lib  # noqa: E402  # pylint: disable=wrong-import-position
from dapo_jax.planner import programs as plan_programs  # noqa: E402  # pylint: disable=wrong-import-position
from dapo_jax.planner import targets as plan_targets  # noqa: E402  # pylint: disable=wrong-import-position
from dapo_jax.planner import plan_estimates as est  # noqa: E402  # pylint: disable=wrong-import-position

CONFIG = os.path.join(ROOT, "configs", "qwen25_1_5b_lora.py")
GiB = 1024**3


def analytic_target(spec: str) -> plan_targets.Target:
  """``spec``'s target; a TPU one analytic (no libtpu compile: the GPU targets' estimate)."""
  if not spec.startswith("tpu:"):
    return plan_targets.parse_target(spec)
  gen, topology = spec.split(":")[1:]
  chips = math.prod(int(x) for x in topology.split("x"))
  return plan_targets.Target("tpu", f"{gen}:{topology}", chips,
                         int(est.TPU_HBM_GIB[gen] * GiB), None)


def plan_row(preset: str, target: str, rank: int, prompts_per_call: int,
             config_file: str = CONFIG, extra: tuple[str, ...] = ()) -> dict:
  spec = plan_lib.configure(plan_lib._parse([  # pylint: disable=protected-access
      "--config", config_file, "--target", "cpu:1", f"--config.model.preset={preset}",
      f"--config.model.lora.rank={rank}",
      f"--config.rollout.prompts_per_call={prompts_per_call}", *extra]))
  plan = plan_lib.make_plan(spec, analytic_target(target))
  return {"preset": preset, "target": target, "rank": rank,
          "prompts_per_call": prompts_per_call,
          "rows_per_call": prompts_per_call * spec.rollout.n,
          "fits": plan["fits"], "capacity_gib": plan["hbm_bytes"] / GiB,
          "peak_gib": plan["peak_bytes"] / GiB,
          "phases_gib": {k: v / GiB for k, v in plan["phase_peaks"].items()},
          "train_state_gib": plan["train"]["state_bytes"] / GiB,
          "train_parts_gib": {k: v / GiB for k, v in plan["train"]["parts"].items()},
          "flops_analytic": plan["flops_analytic"]}


def gen_batch_size(config_file: str, extra: tuple[str, ...]) -> int:
  return plan_lib.configure(plan_lib._parse([  # pylint: disable=protected-access
      "--config", config_file, "--target", "cpu:1", *extra])).algorithm.gen_batch_size


def largest_fitting(preset: str, target: str, rank: int, headroom: float,
                    config_file: str = CONFIG, extra: tuple[str, ...] = (),
                    calls=(16, 8, 6, 4, 2, 1)) -> dict:
  """The row at the most prompts per rollout call that fits with ``headroom`` (a share of the
  capacity) to spare, else the row at one prompt."""
  row = None
  for ppc in calls:
    if gen_batch_size(config_file, extra) % ppc:  # a call size must divide the batch
      continue
    row = plan_row(preset, target, rank, ppc, config_file, extra)
    row["fits"] = row["fits"] and row["peak_gib"] <= (1 - headroom) * row["capacity_gib"]
    if row["fits"]:
      return row
  return row


def rederive(path: str, config_file: str, overrides: tuple[str, ...],
             static: bool = False) -> dict:
  """A saved dapo-plan JSON's phase peaks with today's LoRA rollout accounting
  (`plan_estimates.lora_rollout_bytes`), for plans compiled before it (the compiled programs'
  figures are the JSON's own)."""
  with open(path, encoding="utf-8") as f:
    plan = json.load(f)
  spec = plan_lib.configure(plan_lib._parse([  # pylint: disable=protected-access
      "--config", config_file, "--target", "cpu:1", *overrides]))
  rollout = plan["rollout"] if static else plan.get("continuous_rollout", plan["rollout"])
  state = plan["train"]["state_bytes"]
  mcfg = plan_programs.plan_model_config(spec.model, spec.tokenizer)
  extra = est.lora_rollout_bytes(spec, mcfg, plan["num_devices"], rollout["parts"]["params"])
  peaks = dict(plan["phase_peaks"])
  if extra:
    peaks.update(reshard=state + sum(extra.values()),
                 rollout=state + sum(extra.values()) + rollout["peak"] - rollout["parts"]["params"])
  return {"plan": path, "lora_rollout_gib": {k: v / GiB for k, v in (extra or {}).items()},
          "phases_gib": {k: v / GiB for k, v in peaks.items()},
          "peak_gib": max(peaks.values()) / GiB, "capacity_gib": plan["hbm_bytes"] / GiB}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--presets", default="qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-3b,qwen2.5-7b")
  p.add_argument("--targets", default="gpu:t4:1x1,gpu:l4:1x1,gpu:a100-40g:1x1")
  p.add_argument("--ranks", default="32,0")
  p.add_argument("--headroom", type=float, default=0.05,
                 help="share of the usable memory a fitting row leaves free (a margin)")
  p.add_argument("--config", default=os.path.relpath(CONFIG, ROOT), help="config file")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="a config override for every row (dapo-train's --config.KEY=VALUE)")
  p.add_argument("--out", default=None)
  p.add_argument("--rederive", default=None, metavar="PLAN.json",
                 help="print a saved dapo-plan JSON's phases with today's LoRA accounting "
                      "(--config and --set as the plan's command)")
  p.add_argument("--static", action="store_true",
                 help="with --rederive: the rollout phase of the static sampler's call")
  args = p.parse_args()
  if args.rederive:
    print(json.dumps(rederive(args.rederive, os.path.join(ROOT, args.config),
                              tuple(f"--config.{kv}" for kv in args.set), args.static),
                     indent=1))
    return
  rows = []
  for preset in args.presets.split(","):
    for target in args.targets.split(","):
      for rank in (int(r) for r in args.ranks.split(",")):
        row = largest_fitting(preset, target, rank, args.headroom,
                              os.path.join(ROOT, args.config),
                              tuple(f"--config.{kv}" for kv in args.set))
        rows.append(row)
        what = "LoRA r%d" % rank if rank else "full"
        print(f"{preset:14s} {target:20s} {what:9s} "
              f"{'fits' if row['fits'] else 'NO':4s} {row['prompts_per_call']:3d} prompts/call "
              f"peak {row['peak_gib']:6.2f} of {row['capacity_gib']:.1f} GiB "
              f"(train state {row['train_state_gib']:.2f})", flush=True)
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump({"method": "dapo-plan analytic estimate (GPU targets)",
                 "config": args.config, "overrides": args.set, "headroom": args.headroom,
                 "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
