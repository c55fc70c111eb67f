"""How long a short `dapo-train` takes to reach its first step and to exit after its last one,
with the persistent compilation cache cold (issue 41, item 10).

  python bench/startup_exit.py                                 # this checkout, 3 runs
  python bench/startup_exit.py --src /tmp/old_tree --label before

Each run is the console command (`dapo_jax.main.run`) on configs/tiny_cpu.py shrunk by
tests/tiny_run_flags.py (3 steps, no SFT, no evaluation) in a fresh workdir with a fresh
`JAX_COMPILATION_CACHE_DIR`. Times are taken from the arrival of the output lines: process
start to the first step's line, the last step's line to the process's exit. Writes
bench/results/startup_exit.json under ``--label`` (default: the checkout's commit).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench._host import cpu_name  # noqa: E402  (needs ROOT on the path)
from tests.tiny_run_flags import TINY_RUN_FLAGS  # noqa: E402  (needs ROOT on the path)

RESULTS = os.path.join(ROOT, "bench", "results", "startup_exit.json")
_LAUNCH = "import sys; sys.argv[0] = 'dapo-train'; from dapo_jax.main import run; run()"


def one_run(src: str, num_steps: int) -> dict:
  """One cold launch of ``src``'s dapo-train: its seconds to the first step and to exit."""
  with tempfile.TemporaryDirectory() as tmp:
    env = dict(os.environ, PYTHONPATH=src, JAX_PLATFORMS="cpu",
               JAX_COMPILATION_CACHE_DIR=os.path.join(tmp, "cache"))
    cmd = [sys.executable, "-c", _LAUNCH, "--config", os.path.join(src, "configs/tiny_cpu.py"),
           "--workdir", os.path.join(tmp, "run"), f"--config.num_steps={num_steps}",
           *TINY_RUN_FLAGS]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=src, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    first = last = None
    programs = None
    lines = []
    for line in proc.stdout:
      now = time.monotonic() - t0
      lines.append(line)
      if re.search(r"console_log: step 1/", line):
        first = now
      if re.search(rf"console_log: step {num_steps}/{num_steps}", line):
        last = now
      m = re.search(r"This launch: (\d+) program\(s\) compiled", line)
      if m:
        programs = int(m.group(1))
    proc.wait()
    end = time.monotonic() - t0
  if proc.returncode != 0 or first is None or last is None:
    raise RuntimeError(f"run failed (exit {proc.returncode}):\n{''.join(lines[-30:])}")
  return {"to_first_step_s": round(first, 2), "last_step_to_exit_s": round(end - last, 2),
          "total_s": round(end, 2), "programs_compiled": programs,
          "load_average_at_end": round(os.getloadavg()[0], 2)}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--src", default=ROOT, help="the checkout to run (e.g. a `git worktree`)")
  ap.add_argument("--label", default=None, help="the result's key (default: src's commit)")
  ap.add_argument("--runs", type=int, default=3)
  ap.add_argument("--num_steps", type=int, default=3)
  args = ap.parse_args()
  label = args.label or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.src,
                                       capture_output=True, text=True).stdout.strip()
  runs = []
  for i in range(args.runs):
    runs.append(one_run(args.src, args.num_steps))
    print(f"{label} run {i + 1}: {runs[-1]}", flush=True)
  med = lambda k: statistics.median(r[k] for r in runs)
  result = {"command": "python " + " ".join(sys.argv), "cpu": cpu_name(), "cores": os.cpu_count(),
            "runs": runs, "median_to_first_step_s": med("to_first_step_s"),
            "median_last_step_to_exit_s": med("last_step_to_exit_s")}
  results = {}
  if os.path.exists(RESULTS):
    with open(RESULTS) as f:
      results = json.load(f)
  results[label] = result
  with open(RESULTS, "w") as f:
    json.dump(results, f, indent=1)
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
