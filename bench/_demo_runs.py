"""What the CPU demo studies share (`overlap_demo.py`, `skip_demo.py`): resumable dapo-train runs
of configs/tiny_cpu.py from the committed warm starts, their metrics, and the result file."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM = "bench/results/ablation/warm_starts/seed{seed}_sft600"
# The studies' recorded runs (docs/overlap.md, docs/skip_filter.md) were made when the demo
# config cut its 3-operand prompts to 24 tokens (issue 41, item 9); their later runs keep that
# limit, so every arm of a study compares like with like.
STUDY_FLAGS = ("--config.data.max_prompt_length=24",)


def rows(workdir: str) -> list[dict]:
  """The run's metrics.jsonl rows ([] before it has any)."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def run(name: str, config: str, seed: int, args, flags: list[str],
        env: dict[str, str] | None = None, peer: str = "",
        cpus: tuple[set[int], set[int]] | None = None) -> str:
  """Runs one demo into ``args.workdir/name`` (its log beside it as ``name.log``) from seed's
  warm start, or only returns the workdir where a finished run already is. ``peer``: the run
  is two processes, ``--role=train`` (logged as above) and ``--role=rollout`` started first
  (``name.rollout.log``), joined at ``peer`` (docs/overlap.md, "Two processes"). ``cpus``:
  the cores the (training, rollout) process may run on (one process: the first set)."""
  workdir = os.path.join(args.workdir, name)
  done = rows(workdir)
  if done and done[-1].get("step") == args.num_steps:
    return workdir  # finished: read, not run again
  cmd = [sys.executable, "-m", "dapo_jax.main", f"--config={config}", f"--workdir={workdir}",
         f"--config.seed={seed}", f"--config.num_steps={args.num_steps}",
         f"--config.eval.every={args.eval_every}", "--config.sft.steps=0",
         f"--config.model.checkpoint={os.path.join(ROOT, WARM.format(seed=seed))}",
         "--config.logging.console=lines", *STUDY_FLAGS, *flags, *args.extra]
  print(" ".join(cmd), flush=True)
  full_env = dict(os.environ, JAX_PLATFORMS="cpu", **(env or {}))
  pin = lambda i: (lambda: os.sched_setaffinity(0, cpus[i])) if cpus else None
  if not peer:
    with open(log_path(name, args), "w") as log:
      subprocess.run(cmd, cwd=ROOT, env=full_env, check=True, stdout=log,
                     stderr=subprocess.STDOUT, preexec_fn=pin(0))
    return workdir
  with open(log_path(name, args).replace(".log", ".rollout.log"), "w") as rlog, \
      open(log_path(name, args), "w") as log:
    rollout = subprocess.Popen(cmd + ["--role=rollout", f"--peer={peer}"], cwd=ROOT,
                               env=full_env, stdout=rlog, stderr=subprocess.STDOUT,
                               preexec_fn=pin(1))
    try:
      subprocess.run(cmd + ["--role=train", f"--peer={peer}"], cwd=ROOT, env=full_env,
                     check=True, stdout=log, stderr=subprocess.STDOUT, preexec_fn=pin(0))
    finally:
      if rollout.wait(timeout=600) != 0:
        raise subprocess.CalledProcessError(rollout.returncode, rollout.args)
  return workdir


def log_path(name: str, args) -> str:
  return os.path.join(args.workdir, f"{name}.log")


def held_out(all_rows: list[dict]) -> tuple[float | None, float | None]:
  """(first, last) held-out avg@4 of a run, None without evaluations."""
  evals = [r["eval/avg@4"] for r in all_rows if "eval/avg@4" in r]
  return (evals[0], evals[-1]) if evals else (None, None)


def parser(doc: str, *, num_steps: int, seeds: str, workdir: str,
           out: str) -> argparse.ArgumentParser:
  """The flags every demo study takes; the caller adds its own before parsing."""
  ap = argparse.ArgumentParser(description=doc.splitlines()[0])
  ap.add_argument("--num_steps", type=int, default=num_steps)
  ap.add_argument("--eval_every", type=int, default=20)
  ap.add_argument("--seeds", default=seeds)
  ap.add_argument("--workdir", default=workdir)
  ap.add_argument("--out", default=out)
  ap.add_argument("extra", nargs="*", help="more dapo-train flags for every run (after --)")
  return ap


def write(result: dict, out: str) -> None:
  """Prints the result and writes it to ``out`` (relative to the repository root)."""
  print(json.dumps(result, indent=1))
  path = os.path.join(ROOT, out)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump(result, f, indent=1)
