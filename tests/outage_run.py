"""One tiny `dapo-train` run on a ``gs://`` workdir with storage outages: the emulator is stopped
once the run has committed a given checkpoint step, and started again after a given time.

Shared by tests/test_storage_outages.py (outages scaled down) and bench/storage_outages.py (real
time). Every output line of the run is kept with the time it arrived.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

from tests.gcs_emulator import GcsEmulator
from tests.tiny_run_flags import TINY_RUN_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class Outage:
  after_step: int  # stop the server once this checkpoint step is committed
  seconds: float | None  # None: storage never comes back


@dataclasses.dataclass
class Result:
  returncode: int
  timed_out: bool  # killed at the timeout
  lines: list[tuple[float, str]]  # (arrival time, text)
  outages: list[tuple[float, float | None]]  # (stopped, started again) times
  gave_up_at: float | None  # when the run made its StorageUnavailableError
  exited_at: float

  @property
  def text(self) -> str:
    return "\n".join(t for _, t in self.lines)


def committed_steps(gcs: GcsEmulator, bucket: str) -> list[int]:
  """Checkpoint steps with Orbax's commit marker in the bucket (GCS: written last, in place)."""
  names = gcs.object_names(bucket, "run/checkpoints/")
  return sorted(int(n.split("/")[2]) for n in names
                if re.fullmatch(r"run/checkpoints/\d+/commit_success\.txt", n))


def logged_steps(gcs: GcsEmulator, bucket: str) -> list[int]:
  """The ``step`` of every line of metrics.jsonl, in file order (duplicates kept)."""
  if "run/metrics.jsonl" not in gcs.object_names(bucket, "run/metrics.jsonl"):
    return []
  url = f"{gcs.url}/storage/v1/b/{bucket}/o/run%2Fmetrics.jsonl?alt=media"
  with urllib.request.urlopen(url, timeout=10) as r:
    return [json.loads(line)["step"] for line in r.read().decode().splitlines() if line]


def run(gcs: GcsEmulator, bucket: str, tmp: str, *, num_steps: int, outages: list[Outage],
        scale: float, extra_flags: tuple[str, ...] = (), timeout_s: float = 600.0) -> Result:
  """Runs ``tests.outage_target`` (time scaled by ``scale``) and makes the outages."""
  marker = os.path.join(tmp, f"gave_up.{time.time_ns()}")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
             XLA_FLAGS="--xla_force_host_platform_device_count=1",
             JAX_COMPILATION_CACHE_DIR=os.path.join(tmp, "jax_cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             DAPO_OUTAGE_TIME_SCALE=str(scale), DAPO_OUTAGE_MARKER=marker, **gcs.env)
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    env.pop(k, None)
  cmd = [sys.executable, "-m", "tests.outage_target",
         f"--config={os.path.join(ROOT, 'configs', 'tiny_cpu.py')}",
         f"--workdir=gs://{bucket}/run", f"--config.num_steps={num_steps}", *TINY_RUN_FLAGS,
         "--config.checkpoint.save_every=1", "--config.checkpoint.async_save=True",
         *extra_flags]
  proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, bufsize=1)
  lines: list[tuple[float, str]] = []
  reader = threading.Thread(target=lambda: lines.extend(
      (time.time(), line.rstrip("\n")) for line in proc.stdout), daemon=True)
  reader.start()
  deadline = time.monotonic() + timeout_s
  done: list[tuple[float, float | None]] = []
  down, timed_out = False, False
  try:
    for outage in outages:
      while proc.poll() is None and time.monotonic() < deadline:
        if outage.after_step <= 0 or (committed_steps(gcs, bucket) or [0])[-1] >= \
            outage.after_step:
          break
        time.sleep(0.1)
      if proc.poll() is not None:
        break
      gcs.stop()
      down, stopped = True, time.time()
      if outage.seconds is None:
        done.append((stopped, None))
        break
      while proc.poll() is None and time.time() < stopped + outage.seconds:
        time.sleep(0.05)
      gcs.start()
      down = False
      done.append((stopped, time.time()))
    try:
      proc.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
      timed_out = True
  finally:
    exited = time.time()
    if down:
      gcs.start()  # the caller reads the bucket afterwards
  reader.join(timeout=10)
  gave_up = float(open(marker).read()) if os.path.exists(marker) else None
  return Result(proc.returncode, timed_out, lines, done, gave_up, exited)
