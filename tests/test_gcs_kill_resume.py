"""A 2-process x 4-device run with ``--workdir gs://bucket/run``, SIGKILLed and relaunched.

Against a real GCS server (fake-gcs-server on 127.0.0.1, see `tests/gcs_emulator.py`). Each
relaunch must resume, on both processes, from the newest step committed in the bucket when the
kill landed; the finished run must have every artefact in the bucket (checkpoints, metrics,
samples, TensorBoard events, config, curves, final metrics) with each step logged once, and
nothing at all written under the processes' working directory.
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.gcs_emulator import GcsEmulator
from tests.processes import free_port
from tests.tiny_run_flags import TINY_RUN_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_STEPS = 4
KILL_AFTER_NEW_STEPS = 2  # each launch is killed once it has committed this many new steps
NUM_KILLS = 1  # the TPU launch test kills a gs:// run too
LAUNCH_TIMEOUT_S = 420
_RESUMED = re.compile(r"Resumed from \S+ at step (\d+)\.")
_CONFIG = """
import importlib.util
spec = importlib.util.spec_from_file_location("tiny_cpu", {tiny!r})
tiny = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tiny)

def get_config():
  c = tiny.get_config()
  c.mesh = [("data", 2), ("fsdp", -1), ("tensor", 1)]
  return c
"""



def _launch(config_file, workdir, cwd, logs, env):
  """Both processes of one launch; their logs go to ``logs`` (outside ``cwd``)."""
  coord = f"127.0.0.1:{free_port()}"
  procs = []
  for i in range(2):
    penv = dict(env, JAX_COORDINATOR_ADDRESS=coord, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i))
    with open(f"{logs}.{i}", "w") as log:
      procs.append(subprocess.Popen(
          [sys.executable, "-m", "tests.kill_target", f"--config={config_file}",
           f"--workdir={workdir}", f"--config.num_steps={NUM_STEPS}", *TINY_RUN_FLAGS,
           "--config.checkpoint.save_every=1", "--config.checkpoint.max_to_keep=2",
           "--config.checkpoint.async_save=True"],
          cwd=cwd, env=penv, stdout=log, stderr=subprocess.STDOUT))
  return procs


def _committed_steps(gcs, bucket):
  """Steps whose Orbax commit marker is in the bucket (on GCS Orbax writes in place and
  commits a step by writing ``commit_success.txt`` last)."""
  names = gcs.object_names(bucket, "run/checkpoints/")
  return sorted(int(n.split("/")[2]) for n in names
                if re.fullmatch(r"run/checkpoints/\d+/commit_success\.txt", n))


def _logged_steps(gcs, bucket):
  import urllib.request  # pylint: disable=g-import-not-at-top
  if "run/metrics.jsonl" not in gcs.object_names(bucket, "run/metrics.jsonl"):
    return []
  url = f"{gcs.url}/storage/v1/b/{bucket}/o/run%2Fmetrics.jsonl?alt=media"
  with urllib.request.urlopen(url, timeout=10) as r:
    return [json.loads(l)["step"] for l in r.read().decode().splitlines() if l.endswith("}")]


def _tail(logs):
  return "\n".join(f"--- process {i}:\n" + open(f"{logs}.{i}").read()[-2500:] for i in range(2))


def _kill(procs):
  for p in procs:
    if p.poll() is None:
      os.kill(p.pid, signal.SIGKILL)
  for p in procs:
    p.wait()


@pytest.mark.slow
def test_gcs_workdir_two_processes_killed_and_resumed(tmp_path):
  gcs = GcsEmulator(str(tmp_path / "gcs"))
  gcs.start()
  try:
    _campaign(gcs, tmp_path)
  finally:
    gcs.stop()


def _campaign(gcs, tmp_path):
  bucket = f"run-{uuid.uuid4().hex[:8]}"
  gcs.create_bucket(bucket)
  workdir = f"gs://{bucket}/run"
  cwd = tmp_path / "cwd"
  cwd.mkdir()
  config_file = tmp_path / "gcs_tiny.py"
  config_file.write_text(_CONFIG.format(tiny=os.path.join(ROOT, "configs", "tiny_cpu.py")))
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
             XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", **gcs.env)
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    env.pop(k, None)
  rng = random.Random(0)
  lost, resumed_from = [], 0
  for launch in range(NUM_KILLS + 1):
    logs = str(tmp_path / f"launch{launch}.log")
    procs = _launch(config_file, workdir, cwd, logs, env)
    if launch == NUM_KILLS:
      for p in procs:
        try:
          p.wait(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
          _kill(procs)
          pytest.fail("the last launch did not finish:\n" + _tail(logs))
      assert all(p.returncode == 0 for p in procs), _tail(logs)
    else:
      target = resumed_from + KILL_AFTER_NEW_STEPS
      deadline = time.monotonic() + LAUNCH_TIMEOUT_S
      while not (_committed_steps(gcs, bucket) or [0])[-1] >= target:
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
          _kill(procs)
          pytest.fail(f"launch {launch} ended or hung before step {target}:\n" + _tail(logs))
        time.sleep(0.2)
      time.sleep(rng.uniform(0.0, 1.5))  # somewhere inside the next step (or its save)
      _kill(procs)
      newest = _committed_steps(gcs, bucket)[-1]
      lost.append(max(_logged_steps(gcs, bucket) + [newest]) - newest)
    if launch:
      # Both processes resumed from the newest step committed when the previous launch died.
      found = [_RESUMED.findall(open(f"{logs}.{i}").read()) for i in range(2)]
      assert found[0] == found[1] == [str(resumed_from)], _tail(logs)
    if launch < NUM_KILLS:
      resumed_from = newest
  print(f"steps lost per kill (logged past the resumed checkpoint): {lost}")

  names = gcs.object_names(bucket)
  for required in ("run/config.json", "run/metrics.jsonl", "run/samples.jsonl",
                   "run/curves.png", "run/final_metrics.json",
                   f"run/checkpoints/{NUM_STEPS}/commit_success.txt",
                   f"run/checkpoints/{NUM_STEPS}/meta/metadata"):
    assert required in names, (required, names)
  events = [n for n in names if n.startswith("run/tb/events.out.tfevents")]
  assert len(events) == NUM_KILLS + 1  # one event file per launch
  assert _logged_steps(gcs, bucket) == list(range(1, NUM_STEPS + 1))
  assert _committed_steps(gcs, bucket) == [NUM_STEPS - 1, NUM_STEPS]  # max_to_keep=2
  assert not [n for n in names if "corrupt/" in n]
  # Nothing of the run on the local disk: the working directory stayed empty.
  assert os.listdir(cwd) == []
