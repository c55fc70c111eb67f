"""Held-out gain of LoRA (ranks 1, 8, 32) vs full fine-tuning on the CPU task, resumable.

  python bench/lora_study.py                       # sweep, then 3 seeds x 160 RL steps a variant
  python bench/lora_study.py --max_runs 4          # one sitting's share
  python bench/lora_study.py --steps 2 --sweep_steps 2 --seeds 0 --ranks 1 --lr_mults 10 \
      --sft_steps 2 --eval_every 2 --smoke --results /tmp/lora_smoke --warm_starts /tmp/lora_smoke

Every run is `dapo-train --config configs/tiny_cpu.py:dapo` from the warm start of its seed
(bench/table1_cpu.py's, shared with the ablation: `<--warm_starts>/warm_starts/`), with
`model.lora.rank=r` (alpha = 2r) or full fine-tuning. LoRA needs a larger learning rate: first
a sweep on seed 0 (`--sweep_steps` steps, lr = config lr x each of `--lr_mults`) picks each
rank's rate by held-out avg@k after the sweep; the sweep results stay in `<results>/sweep/`.
Then every variant runs `--steps` steps for each seed in `--seeds`. A run whose JSON exists is
skipped, and an interrupted run resumes from its workdir's checkpoint (`--scratch`).
A run whose policy collapses (dynamic sampling stops: every group all wrong) is a result, not a
crash: it is recorded with held-out `after` = 0 and `collapsed`, so the sweep never picks it.
`<results>/summary.md` gives each variant's gain (after - before) over seeds, and whether it is
within the seed spread of full fine-tuning's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import table1_cpu as t1  # noqa: E402  pylint: disable=wrong-import-position

ROOT = t1.ROOT


def variant_name(rank: int, lr: float) -> str:
  return "full" if rank == 0 else f"lora_r{rank}_lr{lr:g}"


SMOKE = []  # --smoke: dynamic sampling off (a 2-step warm start answers everything wrong)


def run_one(results: str, group: str, rank: int, lr: float, seed: int, spec: t1.Spec,
            scratch: str, warm_starts: str) -> dict[str, Any]:
  """One run's result JSON (made now unless it exists)."""
  name = variant_name(rank, lr)
  path = t1.result_path(os.path.join(results, group), name, seed)
  done = t1.load_result(path, spec)
  if done is not None:
    return done
  warm, warm_hash = t1.ensure_warm_start(warm_starts, seed, spec.sft_steps)
  workdir = os.path.join(scratch, group, name, f"seed{seed}")
  extra = [f"--config.optim.lr={lr}", *SMOKE]
  if rank:
    extra += [f"--config.model.lora.rank={rank}", f"--config.model.lora.alpha={2.0 * rank}"]
  start = time.perf_counter()
  rows, stopped = _train(seed, spec, warm, workdir, extra)
  res = {"spec": spec.to_json(), "variant": name, "rank": rank, "lr": lr, "seed": seed,
         "warm_start_sha256": warm_hash, "wall_s": time.perf_counter() - start,
         "host": t1.host_info(), **t1.summarize_run(rows)}
  if stopped:  # the policy collapsed: dynamic sampling found no mixed group (all wrong)
    res.update(collapsed=True, stopped=stopped, after=0.0, pass_after=0.0)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(res, f, indent=1)
  print(f"{group}/{name} seed {seed}: {res['metric']} {res['before']:.3f} -> {res['after']:.3f}",
        flush=True)
  return res


def _train(seed, spec, warm, workdir, extra):
  import subprocess  # pylint: disable=g-import-not-at-top
  from dapo_jax.infra.metrics import read_jsonl  # pylint: disable=g-import-not-at-top
  cmd = [sys.executable, "-m", "dapo_jax.main", f"--config={t1.TINY}:dapo",
         f"--workdir={workdir}", f"--config.seed={seed}", f"--config.model.checkpoint={warm}",
         "--config.sft.steps=0", f"--config.num_steps={spec.steps}",
         f"--config.eval.every={spec.eval_every}", "--config.logging.console=lines", *extra]
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "run.log"), "a", encoding="utf-8") as log:
    log.write("+ " + " ".join(cmd) + "\n")
    log.flush()
    done = subprocess.run(cmd, cwd=ROOT, check=False, stdout=log, stderr=subprocess.STDOUT)
  stopped = ""
  if done.returncode:
    with open(os.path.join(workdir, "run.log"), encoding="utf-8") as f:
      stopped = next((line.strip() for line in f if "SamplingStoppedError:" in line), "")
    if not stopped:  # any other failure is a bug, not a result
      raise subprocess.CalledProcessError(done.returncode, cmd)
  return read_jsonl(os.path.join(workdir, "metrics.jsonl")), stopped


def summary(results: str, full: list[dict], by_rank: dict[int, list[dict]]) -> str:
  gain = lambda rs: np.array([r["after"] - r["before"] for r in rs])
  g_full = gain(full)
  lo, hi = (g_full.min(), g_full.max()) if len(g_full) else (np.nan, np.nan)
  lines = ["| variant | lr | seeds | gain mean | gain min..max | within full's seed range | "
           "collapsed |", "|---|---|---|---|---|---|---|"]
  rows = [("full", full)] + [(f"LoRA r{r}", rs) for r, rs in sorted(by_rank.items())]
  for label, rs in rows:
    if not rs:
      continue
    g = gain(rs)
    within = "-" if label == "full" else str(bool(lo <= g.mean() <= hi))
    lines.append(f"| {label} | {rs[0]['lr']:g} | {len(rs)} | {g.mean():+.3f} | "
                 f"{g.min():+.3f}..{g.max():+.3f} | {within} | "
                 f"{sum(bool(r.get('collapsed')) for r in rs)} |")
  text = "\n".join(lines) + "\n"
  with open(os.path.join(results, "summary.md"), "w", encoding="utf-8") as f:
    f.write(text)
  return text


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--results", default=os.path.join(ROOT, "bench", "results", "lora_study"))
  p.add_argument("--scratch", default="/tmp/dapo_lora_study")
  p.add_argument("--warm_starts", default=os.path.join(ROOT, "bench", "results", "ablation"),
                 help="results dir whose warm_starts/ to train from (the ablation's by default, "
                      "so LoRA and the Table-1 rows start from the same weights)")
  p.add_argument("--ranks", default="1,8,32")
  p.add_argument("--lr_mults", default="3,10,30", help="LoRA lr = config lr x each")
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--steps", type=int, default=160)
  p.add_argument("--sweep_steps", type=int, default=40)
  p.add_argument("--sft_steps", type=int, default=t1.tiny_config().sft.steps)
  p.add_argument("--eval_every", type=int, default=20)
  p.add_argument("--max_runs", type=int, default=0, help="stop after this many new runs (0: all)")
  p.add_argument("--smoke", action="store_true", help="dynamic sampling off (smoke runs only)")
  args = p.parse_args(argv)
  if args.smoke:
    SMOKE[:] = ["--config.algorithm.dynamic_sampling=False",
                f"--config.algorithm.gen_batch_size={t1.tiny_config().optim.train_batch_size}"]
  base_lr = t1.tiny_config().optim.lr
  ranks = [int(r) for r in args.ranks.split(",")]
  seeds = [int(s) for s in args.seeds.split(",")]
  mults = [float(m) for m in args.lr_mults.split(",")]
  sweep = t1.Spec(steps=args.sweep_steps, sft_steps=args.sft_steps,
                  eval_every=min(args.eval_every, args.sweep_steps))
  main_spec = t1.Spec(steps=args.steps, sft_steps=args.sft_steps, eval_every=args.eval_every)
  budget = [args.max_runs or 10 ** 9]

  def run(group, rank, lr, seed, spec):
    path = t1.result_path(os.path.join(args.results, group), variant_name(rank, lr), seed)
    if not os.path.exists(path):
      if budget[0] <= 0:
        return None
      budget[0] -= 1
    return run_one(args.results, group, rank, lr, seed, spec, args.scratch, args.warm_starts)

  chosen = {}
  for rank in ranks:  # the learning-rate sweep, seed 0
    swept = [run("sweep", rank, base_lr * m, seeds[0], sweep) for m in mults]
    if any(s is None for s in swept):
      print(f"rank {rank}: sweep unfinished (--max_runs); stopping here.", flush=True)
      return None
    chosen[rank] = max(swept, key=lambda s: s["after"])["lr"]
  full = [run("main", 0, base_lr, s, main_spec) for s in seeds]
  by_rank = {r: [run("main", r, chosen[r], s, main_spec) for s in seeds] for r in ranks}
  full = [r for r in full if r]
  by_rank = {r: [x for x in rs if x] for r, rs in by_rank.items()}
  with open(os.path.join(args.results, "chosen_lr.json"), "w", encoding="utf-8") as f:
    json.dump({str(r): lr for r, lr in chosen.items()}, f, indent=1)
  text = summary(args.results, full, by_rank)
  print(text, flush=True)
  return text


if __name__ == "__main__":
  main()
