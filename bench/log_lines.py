"""How much of a gs:// run's console output is ours: `dapo-train` on the tiny config with a
workdir in a GCS emulator bucket (fake-gcs-server on 127.0.0.1), its output lines classified.

  python bench/log_lines.py                      # 40 steps of this checkout
  python bench/log_lines.py --src /tmp/old_tree  # another checkout (e.g. `git worktree add`)

Prints the total line count (stdout + stderr) and the count per kind; writes the same to
bench/results/log_lines.json under the checkout's commit.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results", "log_lines.json")
_LAUNCH = "import sys; sys.argv[0] = 'dapo-train'; from dapo_jax.main import run; run()"


def classify(line: str) -> str:
  if "console_log: step " in line:
    return "step line"
  if "console_log" in line:
    return "sample line"
  if "fsspec.caching" in line:
    return "fsspec.caching INFO"
  if "NaN or Inf" in line:
    return "tensorboardX NaN warning"
  if "google_auth_provider" in line or "credentials" in line.lower():
    return "credential probing"
  return "other"


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--src", default=ROOT, help="checkout whose dapo_jax runs (default: this one)")
  ap.add_argument("--steps", type=int, default=40)
  args = ap.parse_args()
  sys.path.insert(0, ROOT)
  from tests.gcs_emulator import GcsEmulator  # pylint: disable=g-import-not-at-top
  from tests.tiny_run_flags import TINY_RUN_FLAGS  # pylint: disable=g-import-not-at-top
  src = os.path.abspath(args.src)
  commit = subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
  with tempfile.TemporaryDirectory() as tmp:
    emu = GcsEmulator(os.path.join(tmp, "gcs"))
    emu.start()
    try:
      bucket = f"loglines-{uuid.uuid4().hex[:8]}"
      emu.create_bucket(bucket)
      env = {**os.environ, **emu.env, "JAX_PLATFORMS": "cpu", "PYTHONPATH": src}
      start = time.time()
      p = subprocess.run(
          [sys.executable, "-c", _LAUNCH, f"--config={src}/configs/tiny_cpu.py",
           f"--workdir=gs://{bucket}/run", f"--config.num_steps={args.steps}",
           *TINY_RUN_FLAGS], env=env, capture_output=True, text=True, cwd=tmp, check=False)
    finally:
      emu.stop()
  lines = p.stdout.splitlines() + p.stderr.splitlines()
  kinds = collections.Counter(classify(line) for line in lines)
  result = {"commit": commit, "steps": args.steps, "returncode": p.returncode,
            "lines": len(lines), "kinds": dict(kinds.most_common()),
            "wall_s": round(time.time() - start, 1)}
  print(json.dumps(result, indent=2))
  if p.returncode:
    print(p.stderr[-3000:], file=sys.stderr)
  results = json.load(open(RESULTS)) if os.path.exists(RESULTS) else {}
  results[commit] = result
  with open(RESULTS, "w") as f:
    json.dump(results, f, indent=2)
    f.write("\n")


if __name__ == "__main__":
  main()
