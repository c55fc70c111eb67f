"""Kill test (issue #8, item 1): SIGKILL a tiny CPU run at 10 seeded random moments.

Four kills land provably inside an Orbax write (`tests/kill_target.py` stalls the write of a
chosen step, at the array/JSON items or just before the commit, and the kill follows); the other
six at a uniformly random moment of one step period, once the run has saved two new steps. One
more fault: before one relaunch the newest checkpoint is truncated, so the resume must fall back
to the previous step with a warning. Every relaunch must resume from the newest complete,
readable step (never a partial one), and the final parameters and per-step metrics must equal
those of an uninterrupted run bit for bit.
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests import fault_report
from tests import kill_target
from tests.tiny_run_flags import TINY_RUN_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.py")
SEED = 0
NUM_STEPS = 30  # a launch advances at most 4 steps (1 with a stall): 10 kills use <= 28
NUM_KILLS = 10
NUM_WRITE_KILLS = 4
CORRUPT_BEFORE_LAUNCH = 6  # the relaunch after this many kills finds a truncated newest step
LAUNCH_TIMEOUT_S = 300
FLAGS = [
    f"--config={TINY}", f"--config.num_steps={NUM_STEPS}", *TINY_RUN_FLAGS,
    "--config.checkpoint.save_every=1",
    "--config.checkpoint.max_to_keep=3", "--config.checkpoint.async_save=True"]
# Metrics that depend on wall time, not on the computation.
_TIMING = ("time/", "perf/")
_RESUMED = re.compile(r"Resumed from \S+ at step (\d+)\.")


def _env(cache_dir, **extra):
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
             JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
  env.pop(kill_target.STALL_ENV, None)
  env.update(extra)
  return env


def _launch(workdir, log_path, env):
  log = open(log_path, "w")
  proc = subprocess.Popen([sys.executable, "-m", "tests.kill_target", f"--workdir={workdir}",
                           *FLAGS], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
  log.close()
  return proc


def _complete_steps(workdir):
  d = os.path.join(workdir, "checkpoints")
  return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def _tmp_dirs(workdir):
  """Leftovers of unfinished writes, by (name, inode): a relaunch may reuse a name."""
  d = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(d):
    return set()
  return {(n, os.stat(os.path.join(d, n)).st_ino) for n in os.listdir(d)
          if kill_target.TMP_SUFFIX in n}


def _logged_steps(workdir):
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  return [json.loads(l)["step"] for l in open(path) if l.strip().endswith("}")]


def _wait(predicate, proc, log_path, what):
  deadline = time.monotonic() + LAUNCH_TIMEOUT_S
  while not predicate():
    if proc.poll() is not None:
      pytest.fail(f"run exited ({proc.returncode}) before {what}:\n"
                  + open(log_path).read()[-3000:])
    if time.monotonic() > deadline:
      proc.kill()
      pytest.fail(f"timed out waiting for {what}:\n" + open(log_path).read()[-3000:])
    time.sleep(0.01)


def _resumed_step(log_path):
  found = _RESUMED.findall(open(log_path).read())
  return int(found[-1]) if found else 0


def _truncate_newest(workdir):
  step = _complete_steps(workdir)[-1]
  params_dir = os.path.join(workdir, "checkpoints", str(step), "params")
  files = [os.path.join(r, f) for r, _, fs in os.walk(params_dir) for f in fs]
  biggest = max(files, key=os.path.getsize)
  os.truncate(biggest, os.path.getsize(biggest) // 2)
  return step


def _final_params(workdir):
  path = os.path.join(workdir, "checkpoints", str(NUM_STEPS), "params")
  return jax.tree.leaves(jax.device_get(ocp.StandardCheckpointer().restore(path)))


def _metric_rows(workdir):
  rows = {}
  for line in open(os.path.join(workdir, "metrics.jsonl")):
    row = json.loads(line)
    rows.setdefault(row["step"], {}).update(
        {k: v for k, v in row.items() if not k.startswith(_TIMING)})
  return rows


def _finish(proc, log_path, what):
  try:
    proc.wait(timeout=LAUNCH_TIMEOUT_S)
  except subprocess.TimeoutExpired:
    proc.kill()
    pytest.fail(f"{what} did not finish:\n" + open(log_path).read()[-3000:])
  assert proc.returncode == 0, f"{what} failed:\n" + open(log_path).read()[-3000:]


@pytest.mark.slow
def test_random_sigkills_resume_bit_exact(tmp_path):
  rng = random.Random(SEED)
  cache = str(tmp_path / "jax_cache")
  killed, ref = str(tmp_path / "killed"), str(tmp_path / "reference")
  # The uninterrupted reference runs alongside the campaign (its own workdir).
  ref_proc = _launch(ref, str(tmp_path / "reference.log"), _env(cache))
  plan = ["write"] * NUM_WRITE_KILLS + ["random"] * (NUM_KILLS - NUM_WRITE_KILLS)
  rng.shuffle(plan)
  kills, lost_to_corruption = [], None
  for i, kind in enumerate(plan + ["final"]):
    log_path = str(tmp_path / f"launch_{i}.log")
    corrupted = None
    if i == CORRUPT_BEFORE_LAUNCH:
      corrupted = _truncate_newest(killed)
    complete = _complete_steps(killed)
    expected_resume = max((s for s in complete if s != corrupted), default=0)
    tmp_before = _tmp_dirs(killed)
    extra, stage = {}, None
    if kind == "write":
      stall_step = expected_resume + rng.randint(1, 2)
      stage = rng.choice(("items", "commit"))
      marker = str(tmp_path / f"stalled_{i}")
      extra[kill_target.STALL_ENV] = f"{stall_step}:{stage}:{marker}"
    proc = _launch(killed, log_path, _env(cache, **extra))
    if kind == "final":
      _finish(proc, log_path, "the final resume")
    else:
      if kind == "write":
        _wait(lambda: os.path.exists(marker), proc, log_path, f"the stall in step {stall_step}")
      else:  # a uniform moment of one step period, after two new checkpoints
        saved = lambda step: lambda: max(_complete_steps(killed), default=0) >= step
        _wait(saved(expected_resume + 1), proc, log_path, "the first new checkpoint")
        first = time.monotonic()
        _wait(saved(expected_resume + 2), proc, log_path, "the second new checkpoint")
        time.sleep(rng.uniform(0.0, time.monotonic() - first))
      proc.send_signal(signal.SIGKILL)
      proc.wait()
    log = open(log_path).read()
    # Each launch resumed from the newest complete, readable step: never a partial one.
    assert _resumed_step(log_path) == expected_resume, (i, kind, complete, log[-3000:])
    if corrupted is not None:
      assert f"Checkpoint step {corrupted}" in log and "cannot be restored" in log, log[-3000:]
      lost_to_corruption = corrupted - expected_resume
    else:
      assert "cannot be restored" not in log, log[-3000:]
    if kind == "final":
      break
    new_tmp = sorted(n for n, ino in _tmp_dirs(killed) - tmp_before)
    if kind == "write":  # provably mid-write: the stalled step's tmp dir is left, uncommitted
      assert f"{stall_step}{kill_target.TMP_SUFFIX}" in new_tmp, (new_tmp, log[-2000:])
      assert stall_step not in _complete_steps(killed)
    kills.append({"kind": kind, "stage": stage,
                  "resumed_from": expected_resume, "last_logged": max(_logged_steps(killed)),
                  "complete_after": max(_complete_steps(killed), default=0),
                  "mid_write": bool(new_tmp)})
  _finish(ref_proc, str(tmp_path / "reference.log"), "the reference run")

  # Steps a kill loses: trained (logged) but in no complete checkpoint. With async writes that
  # is at most the step being written plus the one trained meanwhile.
  lost = [k["last_logged"] - k["complete_after"] for k in kills]
  assert all(0 <= n <= 2 for n in lost), kills
  assert lost_to_corruption == 1 and _complete_steps(killed)[-1] == NUM_STEPS
  assert not _tmp_dirs(killed), "leftovers of killed writes are cleaned up"
  assert sum(k["mid_write"] for k in kills) >= NUM_WRITE_KILLS
  a, b = _final_params(ref), _final_params(killed)
  assert len(a) == len(b)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  rows_ref, rows_killed = _metric_rows(ref), _metric_rows(killed)
  assert sorted(rows_killed) == list(range(1, NUM_STEPS + 1)), "one log row per step"
  assert rows_killed == rows_ref
  fault_report.record("kill_resume", {
      "sigkills": len(kills), "mid_write_kills": sum(k["mid_write"] for k in kills),
      "corrupted_checkpoints": 1, "runs_survived": len(kills) + 1,
      "steps_lost_total": sum(lost), "steps_lost_max": max(lost), "steps": NUM_STEPS,
      "steps_lost_to_corruption": lost_to_corruption,
      "final_params_bit_exact": True, "kills": kills})
