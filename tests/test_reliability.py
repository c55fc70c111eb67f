"""Trainer reliability: SIGTERM (or JAX's preemption notice) checkpoints and exits cleanly;
non-finite updates are skipped and counted, and too many in a row stop the run."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.experimental import multihost_utils

from dapo_jax.trainer import run_setup
from dapo_jax.trainer import trajectories
from dapo_jax.trainer import train as train_lib
from tests import fault_report
from tests.test_train_e2e import ROOT, TINY, _small_config
from tests.tiny_run_flags import TINY_RUN_FLAGS

_SMALL_FLAGS = [
    *TINY_RUN_FLAGS, "--config.checkpoint.save_every=1000",
    "--config.checkpoint.async_save=False"]


def _steps(workdir):
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  return [json.loads(l)["step"] for l in open(path) if l.strip()]


@pytest.mark.slow
def test_sigterm_checkpoints_the_current_step_and_resumes(tmp_path):
  workdir = str(tmp_path / "run")
  cmd = [sys.executable, "-m", "dapo_jax.main", f"--config={TINY}", f"--workdir={workdir}",
         "--config.num_steps=1000", *_SMALL_FLAGS]
  # The resumed launch reads its programs from the first launch's compile cache.
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu",
             JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  deadline = time.time() + 300
  while len(_steps(workdir)) < 2 and time.time() < deadline and proc.poll() is None:
    time.sleep(0.5)
  assert proc.poll() is None, proc.stdout.read()[-3000:]
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 0, out[-3000:]
  ckpts = sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())
  stopped = max(_steps(workdir))
  assert ckpts == [stopped], (ckpts, stopped)  # save_every=1000: only the SIGTERM checkpoint
  assert "Stopped at step" in out
  # The next launch resumes from it and continues the same log.
  resume = subprocess.run([*cmd[:5], f"--config.num_steps={stopped + 1}", *_SMALL_FLAGS],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert resume.returncode == 0, resume.stdout[-3000:] + resume.stderr[-3000:]
  assert _steps(workdir) == list(range(1, stopped + 2))
  assert f"at step {stopped}." in resume.stdout + resume.stderr  # resumed from that checkpoint
  fault_report.record("sigterm", {"signals": 1, "exit_code": proc.returncode,
                                  "checkpoint_step": ckpts[0], "stopped_at_step": stopped,
                                  "steps_lost": 0})


def test_poisoned_batches_are_skipped_training_continues_then_the_run_stops(tmp_path,
                                                                            monkeypatch):
  real = trajectories.compute_advantages
  poisoned_steps = {2, 4, 5, 6}
  calls = {"n": 0}

  def poisoned(traj, norm_adv_by_std=True):
    calls["n"] += 1
    adv = real(traj, norm_adv_by_std)
    return np.full_like(adv, np.nan) if calls["n"] in poisoned_steps else adv

  monkeypatch.setattr(train_lib.traj_lib, "compute_advantages", poisoned)
  closed = []
  real_close = run_setup.RewardScorer.close
  monkeypatch.setattr(run_setup.RewardScorer, "close",
                      lambda self: (closed.append(True), real_close(self))[1])
  c = _small_config()
  c.num_steps = 8
  c.optim.max_consecutive_skips = 6  # 2 updates per step: steps 4-6 make 6 in a row
  c.checkpoint.max_to_keep = 10
  workdir = str(tmp_path / "nan")
  with pytest.raises(train_lib.NonFiniteUpdatesError, match="6 consecutive non-finite updates "
                     r"up to step 6; stopping\. The last good checkpoint \(step 5\) is kept"):
    train_lib.train_and_evaluate(c, workdir)
  rows = {r["step"]: r for r in (json.loads(l) for l in open(os.path.join(workdir,
                                                                         "metrics.jsonl")))}
  assert closed == [True]  # the failed run still shut the verifier's worker pool down
  assert [rows[s]["actor/skipped"] for s in range(1, 7)] == [0.0, 1.0, 0.0, 1.0, 1.0, 1.0]
  assert [rows[s]["actor/skipped_total"] for s in range(1, 7)] == [0, 2, 2, 4, 6, 8]
  # The step after the poisoned one trains normally: finite, and the parameters move.
  assert np.isfinite(rows[3]["actor/grad_norm"]) and np.isfinite(rows[3]["actor/pg_loss"])
  from tests.test_train_e2e import _params  # pylint: disable=g-import-not-at-top
  p1, p2, p3 = (_params(workdir, s) for s in (1, 2, 3))
  for a, b in zip(p1, p2):  # a skipped update leaves the parameters untouched, bit for bit
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(p2, p3))
  # The run stopped at step 6 without saving it; the kept checkpoint holds finite params.
  ckpts = sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())
  assert ckpts[-1] == 5
  assert all(np.isfinite(np.asarray(x)).all() for x in _params(workdir, 5))
  fault_report.record("non_finite", {"poisoned_updates": 2 * len(poisoned_steps),
                                     "skipped_and_counted": rows[6]["actor/skipped_total"],
                                     "finite_updates_after_a_skip": 2,
                                     "stopped_after_consecutive": 6, "kept_checkpoint": 5})


def test_stop_request_across_processes(monkeypatch):
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  # JAX's preemption service: its sync point decides (the same step on every process), and
  # no Python SIGTERM handler replaces its notifier.
  monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", lambda step: step == 3)
  stop = train_lib._StopRequest()  # pylint: disable=protected-access
  before = signal.getsignal(signal.SIGTERM)
  stop.install()
  assert signal.getsignal(signal.SIGTERM) is before
  assert [stop.requested(s) for s in (1, 2, 3)] == [False, False, True]
  # Service off: our handler, and every process stops once any one was signalled.
  gathered = []
  monkeypatch.setattr(multihost_utils, "process_allgather",
                      lambda x: gathered.append(int(x)) or np.array([int(x), 1]))
  jax.config.update("jax_enable_preemption_service", False)
  try:
    stop = train_lib._StopRequest()  # pylint: disable=protected-access
    stop.install()
    assert signal.getsignal(signal.SIGTERM) == stop._handle  # pylint: disable=protected-access
    assert stop.requested(1) and gathered == [0]  # another process was signalled
  finally:
    stop.restore()
    jax.config.update("jax_enable_preemption_service", True)
  assert signal.getsignal(signal.SIGTERM) is before
