"""How often the 2-rank launch test fails beside CPU-heavy jobs (issue 41, item 12).

  git worktree add /tmp/wt_old 52312a1
  python bench/two_rank_load.py --src /tmp/wt_old --label before-52312a1 \\
      --src . --label after --runs 10 --busy 2

Each run is `tests/test_cloud_launch.py::test_multinode_script_trains_on_two_ranks` of one
checkout under pytest (two `dapo-train` processes through `launch/multinode_gpu.sh`, 4 CPU
devices each), with ``--busy`` Python busy loops running beside it for the whole run. The runs
alternate between the checkouts, so the host's other load falls on each alike. Every finished run
is appended to bench/results/two_rank_load.json at once: the script resumes where it stopped
(``--runs`` is the total per label). A failed run keeps the last lines of its output (each
rank's, and the Python stacks of a hang).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench._host import cpu_name  # noqa: E402  (needs ROOT on the path)

RESULTS = os.path.join(ROOT, "bench", "results", "two_rank_load.json")
TEST = "tests/test_cloud_launch.py::test_multinode_script_trains_on_two_ranks"


def one_run(src: str, busy: int, timeout_s: int) -> dict:
  """One pytest run of the 2-rank test in ``src`` beside ``busy`` busy loops."""
  loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
  env = dict(os.environ, PYTHONPATH=os.path.abspath(src))  # the checkout's dapo_jax, also in ranks
  t0 = time.monotonic()
  try:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", TEST],
                          cwd=src, env=env, capture_output=True, text=True, timeout=timeout_s)
    rc, out = proc.returncode, proc.stdout + proc.stderr
  except subprocess.TimeoutExpired as e:
    partial = e.stdout or ""  # bytes even with text=True
    rc, out = "timeout", partial.decode(errors="replace") if isinstance(partial, bytes) else partial
  finally:
    for p in loops:
      p.kill()
      p.wait()
  run = {"passed": rc == 0, "rc": rc, "wall_s": round(time.monotonic() - t0, 1),
         "load_average_at_end": round(os.getloadavg()[0], 2)}
  if rc != 0:
    run["output_tail"] = out[-6000:]
  return run


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--src", action="append", required=True, help="a checkout; repeat to alternate")
  ap.add_argument("--label", action="append", required=True, help="each --src's result key")
  ap.add_argument("--runs", type=int, default=10, help="runs per label in all (resumes)")
  ap.add_argument("--busy", type=int, default=2, help="busy loops beside each run")
  ap.add_argument("--timeout_s", type=int, default=1800, help="one run's limit")
  args = ap.parse_args()
  if len(args.src) != len(args.label):
    ap.error(f"{len(args.src)} --src but {len(args.label)} --label")
  results = {}
  if os.path.exists(RESULTS):
    with open(RESULTS) as f:
      results = json.load(f)
  for label, src in zip(args.label, args.src):
    entry = results.setdefault(label, {"src": os.path.abspath(src), "runs": []})
    entry.update(command="python " + " ".join(sys.argv), cpu=cpu_name(), cores=os.cpu_count(),
                 busy=args.busy)
  while True:
    todo = [(l, s) for l, s in zip(args.label, args.src) if len(results[l]["runs"]) < args.runs]
    if not todo:
      break
    for label, src in todo:
      run = one_run(src, args.busy, args.timeout_s)
      results[label]["runs"].append(run)
      runs = results[label]["runs"]
      results[label]["failed"] = sum(not r["passed"] for r in runs)
      with open(RESULTS, "w") as f:
        json.dump(results, f, indent=1)
      print(f"{label} run {len(runs)}: passed={run['passed']} rc={run['rc']} "
            f"{run['wall_s']} s", flush=True)
  for label in args.label:
    runs = results[label]["runs"]
    print(f"{label}: {results[label]['failed']} of {len(runs)} failed", flush=True)


if __name__ == "__main__":
  main()
