r"""The CPU demo (configs/tiny_cpu.py) with the paged vs the dense KV cache, same seed: rollout
time, decoded tokens per kept group and held-out accuracy per step. Resumable: a finished run's
workdir is read, not run again.

    python bench/paged_demo.py --num_steps 160     # the full demo (two runs of ~10 min alone)
    python bench/paged_demo.py --num_steps 40 --eval_every 20
    python bench/paged_demo.py --warm_start bench/results/ablation/warm_starts/seed0_sft600 \
        --out bench/results/paged_demo_160.json   # 160 steps from the committed warm start

Both runs draw the same tokens (the engines sample with the same keys; log-probs agree to
~1e-6 and the trainer recomputes them), so every learning metric must match; what differs is
the rollout's time. Writes bench/results/paged_demo.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _metrics(workdir: str) -> list[dict]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _run(kv: str, args) -> list[dict]:
  start = "ws" if args.warm_start else f"sft{args.sft_steps}"
  workdir = os.path.join(args.workdir, f"{kv}_{args.num_steps}_{start}")
  rows = _metrics(workdir)
  if rows and rows[-1].get("step") == args.num_steps:
    return rows
  cmd = [sys.executable, "-m", "dapo_jax.main", "--config=configs/tiny_cpu.py",
         f"--workdir={workdir}", f"--config.rollout.kv_cache={kv}",
         f"--config.num_steps={args.num_steps}", f"--config.eval.every={args.eval_every}"]
  if args.warm_start:  # a saved warm start (HF directory) instead of the config's SFT steps
    cmd += [f"--config.model.checkpoint={os.path.abspath(args.warm_start)}",
            "--config.sft.steps=0"]
  elif args.sft_steps >= 0:
    cmd.append(f"--config.sft.steps={args.sft_steps}")
  print(" ".join(cmd), flush=True)
  subprocess.run(cmd, cwd=ROOT, check=True)
  return _metrics(workdir)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--num_steps", type=int, default=160)
  ap.add_argument("--eval_every", type=int, default=20)
  ap.add_argument("--sft_steps", type=int, default=-1, help="warm-start steps (-1: the config's)")
  ap.add_argument("--warm_start", default="",
                  help="an HF directory to start RL from (e.g. bench/results/ablation/"
                       "warm_starts/seed0_sft600), skipping the SFT steps")
  ap.add_argument("--workdir", default="/tmp/paged_demo")
  ap.add_argument("--out", default="bench/results/paged_demo.json")
  args = ap.parse_args()
  runs = {kv: _run(kv, args) for kv in ("dense", "paged")}
  keys = ("sampling/decoded_tokens_per_kept_group", "train/reward_mean", "actor/pg_loss")
  summary = {"command": f"python bench/paged_demo.py --num_steps {args.num_steps} "
                        f"--eval_every {args.eval_every}"
                        + (f" --warm_start {args.warm_start}" if args.warm_start else "")}
  for kv, rows in runs.items():
    train = [r for r in rows if "time/rollout" in r]
    evals = {r["step"]: {k: v for k, v in r.items() if k.startswith("eval/")}
             for r in rows if any(k.startswith("eval/") for k in r)}
    summary[kv] = {"rollout_s": sum(r["time/rollout"] for r in train),
                   "step_s": sum(r["time/step"] for r in train),
                   "decoded_tokens_per_kept_group": [r.get(keys[0]) for r in train],
                   "eval": evals}
  d, p = runs["dense"], runs["paged"]
  same = all(a.get(k) == b.get(k) for a, b in zip(d, p) for k in keys) and len(d) == len(p)
  summary["same_learning_metrics"] = same and summary["dense"]["eval"] == summary["paged"]["eval"]
  rollout = {kv: summary[kv]["rollout_s"] for kv in runs}
  summary["rollout_paged_over_dense"] = rollout["paged"] / rollout["dense"]
  print(json.dumps({k: v for k, v in summary.items() if k not in ("dense", "paged")}, indent=1))
  print("held-out:", {kv: summary[kv]["eval"] for kv in runs})
  os.makedirs(os.path.dirname(os.path.join(ROOT, args.out)), exist_ok=True)
  with open(os.path.join(ROOT, args.out), "w") as f:
    json.dump(summary, f, indent=1)


if __name__ == "__main__":
  main()
