"""The project's own Table 1 on CPU: DAPO vs naive GRPO (and ablations) on the arithmetic task.

  python bench/table1_cpu.py --variants dapo,naive_grpo --seeds 0,1,2 --out workdirs/table1

Each (variant, seed) is a full `dapo-train --config configs/tiny_cpu.py:VARIANT` run (supervised
warm start, then RL) in its own workdir; the table reports held-out avg@4 after the warm start
(= before RL) and after RL, as mean +- std over seeds. Runs sequentially (about 5-10 min each on
2 cores); finished runs are reused, so an interrupted table resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_one(variant: str, seed: int, out: str, extra: list[str]) -> dict:
  workdir = os.path.join(out, f"{variant}_seed{seed}")
  final = os.path.join(workdir, "final_metrics.json")
  if not os.path.exists(final):
    cmd = [sys.executable, "-m", "dapo_jax.main",
           f"--config={os.path.join(ROOT, 'configs', 'tiny_cpu.py')}:{variant}",
           f"--workdir={workdir}", f"--config.seed={seed}", *extra]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
  rows = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  evals = [r for r in rows if "eval/avg@4" in r]
  return {"before": evals[0]["eval/avg@4"], "after": evals[-1]["eval/avg@4"],
          "pass4_after": evals[-1]["eval/pass@4"]}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--variants", default="dapo,naive_grpo")
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--out", default=os.path.join(ROOT, "workdirs", "table1"))
  p.add_argument("extra", nargs="*", help="extra --config.x=y flags for every run")
  args = p.parse_args()
  seeds = [int(s) for s in args.seeds.split(",")]
  print("| variant | held-out avg@4 before RL | after RL | gain (points) | seeds |")
  print("|---|---|---|---|---|")
  for variant in args.variants.split(","):
    res = [run_one(variant, s, args.out, args.extra) for s in seeds]
    b = np.array([r["before"] for r in res]) * 100
    a = np.array([r["after"] for r in res]) * 100
    g = a - b
    print(f"| {variant} | {b.mean():.1f} +- {b.std():.1f} | {a.mean():.1f} +- {a.std():.1f} | "
          f"{g.mean():+.1f} +- {g.std():.1f} | {len(seeds)} |", flush=True)


if __name__ == "__main__":
  main()
