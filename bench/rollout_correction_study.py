"""The rollout corrections' effect on the tiny task (issue 29), resumable.

  python bench/rollout_correction_study.py              # 3 corrections x 3 seeds x 160 RL steps
  python bench/rollout_correction_study.py --dry_run    # what is done, what is left, the table
  python bench/rollout_correction_study.py --max_runs 2 # one sitting's share

Every run is `dapo-train --config configs/tiny_cpu.py:dapo` in bf16 compute
(``model.dtype=bfloat16``, where the sampler/trainer gap is ~1e-3 per token, against ~5e-7 in
fp32) with ``algorithm.rollout_is`` = none / token_truncated / sequence_mask (caps and bands at
their defaults), from the supervised warm start of bench/table1_cpu.py (the same weights for
every correction of a seed; made once per seed if missing, see ``table1_cpu.ensure_warm_start``).

Each finished run writes ``<results>/<correction>/seed<S>.json`` (held-out avg@k before/after RL
and its curve, the per-step rollout/* gap figures, wall time, host); runs with a JSON are
skipped (one made with other settings is an error), and an interrupted run resumes from its
checkpoint in ``--scratch``. Every invocation prints and writes ``<results>/table.md``: held-out
before/after RL per correction (mean +- std over seeds), and the paired per-seed difference of
the final accuracy against no correction (95% t interval).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, Sequence

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ablation_stats as st  # noqa: E402  # pylint: disable=wrong-import-position
import table1_cpu as t1  # noqa: E402  # pylint: disable=wrong-import-position

CORRECTIONS = ("none", "token_truncated", "sequence_mask")
GAP_KEYS = ("rollout/bit_equal", "rollout/logprob_diff_max", "rollout/kl_k3",
            "rollout/is_weight_min", "rollout/is_weight_max", "rollout/seq_outside_band")
DTYPE = "bfloat16"


def spec_of(steps: int, sft_steps: int, eval_every: int) -> t1.Spec:
  return t1.Spec(steps=steps, sft_steps=sft_steps, eval_every=eval_every,
                 base=f"configs/tiny_cpu.py:dapo model.dtype={DTYPE}")


def train_run(correction: str, seed: int, spec: t1.Spec, warm_start: str, workdir: str
              ) -> list[dict[str, Any]]:
  """One dapo-train run (resumes from ``workdir``); its metrics rows."""
  from dapo_jax.infra.metrics import read_jsonl  # pylint: disable=import-outside-toplevel
  cmd = [sys.executable, "-m", "dapo_jax.main", f"--config={t1.TINY}:dapo",
         f"--workdir={workdir}", f"--config.seed={seed}", f"--config.model.dtype={DTYPE}",
         f"--config.model.checkpoint={warm_start}", "--config.sft.steps=0",
         f"--config.num_steps={spec.steps}", f"--config.eval.every={spec.eval_every}",
         f"--config.algorithm.rollout_is={correction}", "--config.logging.console=lines"]
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "run.log"), "a", encoding="utf-8") as log:
    log.write("+ " + " ".join(cmd) + "\n")
    log.flush()
    t1.subprocess.run(cmd, cwd=ROOT, check=True, stdout=log, stderr=t1.subprocess.STDOUT)
  return read_jsonl(os.path.join(workdir, "metrics.jsonl"))


def gap_summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
  """Per rollout/* key: its mean, min and max over the RL steps that logged it."""
  out = {}
  for key in GAP_KEYS:
    vals = [float(r[key]) for r in rows if r.get("step", 0) > 0 and r.get(key) is not None]
    if vals:
      out[key] = {"mean": float(np.mean(vals)), "min": min(vals), "max": max(vals)}
  return out


def run_all(seeds: Sequence[int], spec: t1.Spec, results: str, scratch: str,
            warm_results: str, *, max_runs: int = 0, dry_run: bool = False,
            train=train_run, warm=t1.ensure_warm_start) -> dict[str, int]:
  """Runs every (correction, seed) without a result yet; returns counts."""
  jobs = [(c, s) for s in seeds for c in CORRECTIONS]
  todo = [(c, s) for c, s in jobs
          if t1.load_result(t1.result_path(results, c, s), spec) is None]
  print(f"planned: {len(jobs)} runs ({len(CORRECTIONS)} corrections x {len(seeds)} seeds) of "
        f"{spec.steps} RL steps; {len(jobs) - len(todo)} done, {len(todo)} to go", flush=True)
  ran = 0
  for correction, seed in todo:
    if dry_run or (max_runs and ran >= max_runs):
      break
    ws_dir, ws_hash = warm(warm_results, seed, spec.sft_steps)
    workdir = os.path.join(scratch, ws_hash[:12], f"steps{spec.steps}_eval{spec.eval_every}",
                           f"{correction}_seed{seed}")
    resumed = os.path.exists(os.path.join(workdir, "metrics.jsonl"))
    start = time.perf_counter()
    rows = train(correction, seed, spec, ws_dir, workdir)
    res = {"name": correction, "seed": seed, "spec": spec.to_json(),
           "warm_start_sha256": ws_hash, "wall_s": time.perf_counter() - start,
           "resumed": resumed, "host": t1.host_info(), "gap": gap_summary(rows),
           **t1.summarize_run(rows)}
    path = t1.result_path(results, correction, seed)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
      json.dump(res, f, indent=1, allow_nan=False)
    os.replace(path + ".tmp", path)
    ran += 1
    print(f"{correction} seed {seed}: {res['metric']} {res['before']:.3f} -> {res['after']:.3f} "
          f"in {res['wall_s']:.0f} s [{ran}/{len(todo)}]", flush=True)
  return {"planned": len(jobs), "done": len(jobs) - len(todo) + ran, "ran": ran,
          "left": len(todo) - ran}


def table(seeds: Sequence[int], spec: t1.Spec, results: str) -> str:
  """Held-out before/after per correction and the paired difference of `after` to none."""
  res = {c: {s: r for s in seeds
             if (r := t1.load_result(t1.result_path(results, c, s), spec)) is not None}
         for c in CORRECTIONS}
  lines = ["| rollout_is | held-out before RL | after RL | after - none: paired [95% CI] | "
           "max abs dlogp (mean of steps) | seeds |", "|---|---|---|---|---|---|"]
  base = {s: 100 * r["after"] for s, r in res["none"].items()}
  for c in CORRECTIONS:
    runs = res[c]
    if not runs:
      lines.append(f"| {c} | | | | | 0 |")
      continue
    before = st.mean_ci([100 * r["before"] for r in runs.values()])
    after_s = {s: 100 * r["after"] for s, r in runs.items()}
    after = st.mean_ci(list(after_s.values()))
    diff = ""
    if c != "none" and set(base) & set(after_s):
      d = st.paired_difference(after_s, base)
      diff = f"{d.mean:+.1f}" + (f" [{d.lo:+.1f}, {d.hi:+.1f}]" if math.isfinite(d.lo) else "")
    gap = [r["gap"].get("rollout/logprob_diff_max", {}).get("mean") for r in runs.values()]
    gap = [g for g in gap if g is not None]
    lines.append(f"| {c} | {t1._pm(before, '')} | {t1._pm(after, '')} | {diff} | "  # pylint: disable=protected-access
                 f"{np.mean(gap) if gap else float('nan'):.2g} | {len(runs)} |")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--steps", type=int, default=None, help="RL steps (default: tiny_cpu's, 160)")
  p.add_argument("--sft_steps", type=int, default=None, help="default: tiny_cpu's sft.steps")
  p.add_argument("--eval_every", type=int, default=None, help="default: tiny_cpu's eval.every")
  p.add_argument("--results", default=os.path.join(ROOT, "bench", "results",
                                                   "rollout_correction"))
  p.add_argument("--warm_starts", default=os.path.join(ROOT, "bench", "results", "ablation"),
                 help="results directory of bench/table1_cpu.py whose warm_starts/ to use")
  p.add_argument("--scratch", default=os.path.join(ROOT, "workdirs", "rollout_correction"))
  p.add_argument("--max_runs", type=int, default=0, help="stop after this many new runs (0: all)")
  p.add_argument("--dry_run", action="store_true", help="print the plan and the table only")
  args = p.parse_args(argv)
  base = t1.tiny_config()
  spec = spec_of(base.num_steps if args.steps is None else args.steps,
                 base.sft.steps if args.sft_steps is None else args.sft_steps,
                 base.eval.every if args.eval_every is None else args.eval_every)
  seeds = [int(s) for s in args.seeds.split(",")]
  start = time.perf_counter()
  counts = run_all(seeds, spec, args.results, args.scratch, args.warm_starts,
                   max_runs=args.max_runs, dry_run=args.dry_run)
  text = table(seeds, spec, args.results)
  os.makedirs(args.results, exist_ok=True)
  with open(os.path.join(args.results, "table.md"), "w", encoding="utf-8") as f:
    f.write(f"{spec.to_json()}\n\n{text}\n")
  print(text)
  print(f"{counts}; this sitting {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
  main()
