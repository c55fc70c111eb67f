"""Storage outages in real time: a tiny `dapo-train` run on a ``gs://`` workdir (fake-gcs-server
on 127.0.0.1, stopped and started again), no time scaling (tests/test_storage_outages.py replays
the same outages scaled down).

  python bench/storage_outages.py                  # every scenario not yet in the results
  python bench/storage_outages.py --redo 60s       # run one again

Scenarios: outages of 5 s, 60 s and 5 min starting once checkpoint step 2 is committed (save
every step, 12 steps), and a launch while storage is down (the default
checkpoint.storage_wait_s=300). Per scenario: the exit code, the steps lost (trained but not in
the newest checkpoint), the time from storage back (or from giving up) to the exit, the output
lines (all, and those that are not step lines) and the last line. Results go to
bench/results/storage_outages.json (one entry per scenario, kept between runs) and a markdown
table is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench._host import cpu_name  # noqa: E402  # pylint: disable=wrong-import-position
from tests import outage_run  # noqa: E402  # pylint: disable=wrong-import-position
from tests.gcs_emulator import GcsEmulator  # noqa: E402  # pylint: disable=wrong-import-position

RESULTS = os.path.join(ROOT, "bench", "results", "storage_outages.json")
NUM_STEPS = 12
SCENARIOS = {  # name -> (outage seconds, None: never back; after checkpoint step; launch flags)
    "5s": (5.0, 2), "60s": (60.0, 2), "5min": (300.0, 2), "launch_down": (None, 0)}
_STEP = re.compile(r"console_log: step (\d+)/\d+")


def run_one(name: str, tmp: str) -> dict:
  seconds, after = SCENARIOS[name]
  gcs = GcsEmulator(os.path.join(tmp, f"gcs_{name}"))
  gcs.start()
  try:
    bucket = f"run-{uuid.uuid4().hex[:8]}"
    gcs.create_bucket(bucket)
    t0 = time.time()
    r = outage_run.run(gcs, bucket, tmp, num_steps=NUM_STEPS, scale=1.0, timeout_s=1800,
                       outages=[outage_run.Outage(after, seconds)])
    try:
      committed = outage_run.committed_steps(gcs, bucket)
      logged = outage_run.logged_steps(gcs, bucket)
    except OSError as e:  # (seen once: the bucket listed as missing after the restart)
      print(f"reading the bucket after the run failed: {e}; buckets: "
            f"{os.listdir(os.path.join(tmp, f'gcs_{name}'))}", flush=True)
      committed, logged = [], []
  finally:
    gcs.stop()
  trained = max([int(s) for _, t in r.lines for s in _STEP.findall(t)] or [0])
  newest = committed[-1] if committed else 0
  stopped, back = r.outages[0] if r.outages else (None, None)
  if r.gave_up_at is not None:
    exit_after, after_what = r.exited_at - r.gave_up_at, "giving up"
  elif back is not None and back < r.exited_at:
    exit_after, after_what = r.exited_at - back, "storage back"
  else:
    exit_after, after_what = (r.exited_at - stopped if stopped else None), "outage start"
  noise = [t for _, t in r.lines if not _STEP.search(t)]
  return {
      "scenario": name, "outage_s": seconds, "returncode": r.returncode,
      "completed": r.returncode == 0 and newest == NUM_STEPS,
      "steps_trained": trained, "newest_checkpoint": newest,
      "steps_lost": trained - newest if r.returncode else 0,
      "metrics_steps_exactly_once": logged == list(range(1, len(logged) + 1)),
      "metrics_rows": len(logged),
      "exit_after_s": None if exit_after is None else round(exit_after, 1),
      "exit_after": after_what, "run_wall_s": round(r.exited_at - t0, 1),
      "log_lines": len(r.lines), "log_lines_not_steps": len(noise),
      "tracebacks": sum("Traceback" in t for _, t in r.lines),
      "last_line": r.lines[-1][1][:400] if r.lines else "",
      # What went wrong, when something did: the output's last non-step lines.
      "output_tail": [] if r.returncode == 0 and "Traceback" not in r.text else noise[-80:],
  }


def table(results: dict) -> str:
  rows = ["| outage | exit code | steps lost | exit after | log lines (not step lines) | "
          "tracebacks | last line |", "|---|---|---|---|---|---|---|"]
  for name in SCENARIOS:
    if name not in results:
      continue
    r = results[name]
    ex = "-" if r["exit_after_s"] is None else f"{r['exit_after_s']} s after {r['exit_after']}"
    last = r["last_line"].split(": ", 1)[-1][:90] if r["returncode"] else "(completed)"
    rows.append(f"| {name} | {r['returncode']} | {r['steps_lost']} | {ex} | {r['log_lines']} "
                f"({r['log_lines_not_steps']}) | {r['tracebacks']} | {last} |")
  return "\n".join(rows)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--redo", nargs="*", default=[], choices=list(SCENARIOS))
  parser.add_argument("--only", nargs="*", default=list(SCENARIOS), choices=list(SCENARIOS))
  args = parser.parse_args()
  results = {}
  if os.path.exists(RESULTS):
    with open(RESULTS) as f:
      results = json.load(f).get("scenarios", {})
  with tempfile.TemporaryDirectory(prefix="storage_outages_") as tmp:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(tmp, "jax_cache")
    for name in args.only:
      if name in results and name not in args.redo:
        continue
      print(f"--- {name} ...", flush=True)
      results[name] = run_one(name, tmp)
      os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
      with open(RESULTS, "w") as f:  # after each scenario: an interrupted bench resumes
        json.dump({"cpu": cpu_name(), "cores": os.cpu_count(), "num_steps": NUM_STEPS,
                   "scenarios": results}, f, indent=2)
      print(json.dumps(results[name], indent=2), flush=True)
  print(table(results))


if __name__ == "__main__":
  main()
