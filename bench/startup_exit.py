"""How long a short `dapo-train` takes to reach its first step and to exit after its last one,
with the persistent compilation cache cold (issue 41, item 10), and which programs it compiles.

  python bench/startup_exit.py                                      # this checkout, 3 runs
  python bench/startup_exit.py --src /tmp/old_tree --label before \\
      --src . --label after                                          # runs alternate

Each run is the console command (`dapo_jax.main.run`) on configs/tiny_cpu.py shrunk by
tests/tiny_run_flags.py (3 steps, no SFT, no evaluation) in a fresh workdir with a fresh
`JAX_COMPILATION_CACHE_DIR`. Times are taken from the arrival of the output lines: process
start to the first step's line, the last step's line to the process's exit. With several
checkouts the runs alternate between them (the host's load falls on each alike). After the
timed runs, one more run per checkout with ``JAX_LOG_COMPILES`` lists every program compiled by
name (a name compiled more than once is one function at several shapes) with its compile
seconds; its times are not used. Writes bench/results/startup_exit.json under each ``--label``
(default: the checkout's commit).
"""

from __future__ import annotations

import argparse
import collections
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
_COMPILED = re.compile(r"Finished XLA compilation of (\S+) in ([0-9.e-]+) sec")


def one_run(src: str, num_steps: int, log_compiles: bool = False) -> dict:
  """One cold launch of ``src``'s dapo-train: its seconds to the first step and to exit (with
  ``log_compiles``, also its compiled programs by name: ``{name: [count, seconds]}``)."""
  with tempfile.TemporaryDirectory() as tmp:
    env = dict(os.environ, PYTHONPATH=src, JAX_PLATFORMS="cpu",
               JAX_COMPILATION_CACHE_DIR=os.path.join(tmp, "cache"))
    cmd = [sys.executable, "-c", _LAUNCH, "--config", os.path.join(src, "configs/tiny_cpu.py"),
           "--workdir", os.path.join(tmp, "run"), f"--config.num_steps={num_steps}",
           *TINY_RUN_FLAGS]
    if log_compiles:
      env["JAX_LOG_COMPILES"] = "1"
      cmd.append("--verbose")  # JAX's compile lines are third-party warnings
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=src, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    first = last = None
    programs = None
    by_name = collections.defaultdict(lambda: [0, 0.0])
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
      m = _COMPILED.search(line)
      if m:
        by_name[m.group(1)][0] += 1
        by_name[m.group(1)][1] += float(m.group(2))
    proc.wait()
    end = time.monotonic() - t0
  if proc.returncode != 0 or first is None or last is None:
    raise RuntimeError(f"run failed (exit {proc.returncode}):\n{''.join(lines[-30:])}")
  out = {"to_first_step_s": round(first, 2), "last_step_to_exit_s": round(end - last, 2),
         "total_s": round(end, 2), "programs_compiled": programs,
         "load_average_at_end": round(os.getloadavg()[0], 2)}
  if log_compiles:
    out["programs_by_name"] = {k: [n, round(s, 3)] for k, (n, s) in
                               sorted(by_name.items(), key=lambda kv: -kv[1][1])}
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--src", action="append", default=None,
                  help="a checkout to run (e.g. a `git worktree`); repeat to alternate")
  ap.add_argument("--label", action="append", default=None,
                  help="each --src's result key (default: its commit)")
  ap.add_argument("--runs", type=int, default=3)
  ap.add_argument("--num_steps", type=int, default=3)
  args = ap.parse_args()
  srcs = args.src or [ROOT]
  labels = args.label or [subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=s,
                                         capture_output=True, text=True).stdout.strip()
                          for s in srcs]
  if len(labels) != len(srcs):
    ap.error(f"{len(srcs)} --src but {len(labels)} --label")
  runs = {label: [] for label in labels}
  for i in range(args.runs):
    for src, label in zip(srcs, labels):
      runs[label].append(one_run(src, args.num_steps))
      print(f"{label} run {i + 1}: {runs[label][-1]}", flush=True)
  results = {}
  if os.path.exists(RESULTS):
    with open(RESULTS) as f:
      results = json.load(f)
  for src, label in zip(srcs, labels):
    med = lambda k, r=runs[label]: statistics.median(x[k] for x in r)
    results[label] = {
        "command": "python " + " ".join(sys.argv), "src": os.path.abspath(src),
        "cpu": cpu_name(), "cores": os.cpu_count(), "runs": runs[label],
        "median_to_first_step_s": med("to_first_step_s"),
        "median_last_step_to_exit_s": med("last_step_to_exit_s"),
        "programs": one_run(src, args.num_steps, log_compiles=True)["programs_by_name"]}
    print(label, json.dumps({k: v for k, v in results[label].items() if k != "runs"}), flush=True)
  with open(RESULTS, "w") as f:
    json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
