"""Which changes of the XLA:CPU setting change a run's numbers (docs/fidelity.md, "Determinism").

  python bench/determinism_cpu.py --out workdirs/determinism

Runs the CPU demo shortened (`configs/tiny_cpu.py`, 100 warm-start steps, 3 RL steps, held-out
avg@4 before and after) once per setting: the default, the default again, XLA:CPU on one thread,
and two host devices (the batch split over a 2-way `fsdp` axis). Then compares every logged value
but timings (`time/*`, `perf/*`) with the first run's, bit for bit. Finished runs are reused.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = {
    "default": "",
    "default_again": "",
    "one_thread": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
    "two_devices": "--xla_force_host_platform_device_count=2",
}
FLAGS = ["--config.sft.steps=100", "--config.num_steps=3", "--config.eval.every=3",
         "--config.checkpoint.async_save=False", "--config.checkpoint.save_every=3"]


def run(name: str, out: str) -> list[dict]:
  workdir = os.path.join(out, name)
  metrics = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(os.path.join(workdir, "final_metrics.json")):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=SETTINGS[name])
    subprocess.run([sys.executable, "-m", "dapo_jax.main",
                    f"--config={os.path.join(ROOT, 'configs', 'tiny_cpu.py')}",
                    f"--workdir={workdir}", *FLAGS], cwd=ROOT, env=env, check=True)
  return [json.loads(line) for line in open(metrics)]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="workdirs/determinism")
  parser.add_argument("--settings", default=",".join(SETTINGS))
  args = parser.parse_args()
  names = args.settings.split(",")
  runs = {n: run(n, args.out) for n in names}
  base = runs[names[0]]
  for name in names:
    same, diff = 0, []
    for r1, r2 in zip(base, runs[name]):
      for k, v in r1.items():
        if k.startswith(("time/", "perf/")):
          continue
        if r2.get(k) == v:
          same += 1
        else:
          diff.append((r1["step"], k, v, r2.get(k)))
    held_out = [(r["step"], r["eval/avg@4"]) for r in runs[name] if "eval/avg@4" in r]
    print(f"{name}: {same} values equal to {names[0]}'s, {len(diff)} differ; avg@4 {held_out}")
    for d in diff[:5]:
      print("   step %d %s: %r vs %r" % d)


if __name__ == "__main__":
  main()
