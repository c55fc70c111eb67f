"""Trainer reliability: SIGTERM checkpoints and exits cleanly; non-finite updates are skipped."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from dapo_jax import experience
from dapo_jax import train as train_lib
from tests.test_train_e2e import ROOT, TINY, _small_config

_SMALL_FLAGS = [
    "--config.model.overrides.hidden_size=32", "--config.model.overrides.intermediate_size=64",
    "--config.model.overrides.num_hidden_layers=1",
    "--config.model.overrides.num_attention_heads=2",
    "--config.model.overrides.num_key_value_heads=1", "--config.sft.steps=0",
    "--config.rollout.n=4", "--config.rollout.max_response_length=12",
    "--config.reward.overlong_buffer_len=4", "--config.algorithm.dynamic_sampling=False",
    "--config.algorithm.gen_batch_size=4", "--config.optim.train_batch_size=4",
    "--config.optim.mini_batch_size=2", "--config.eval.every=0",
    "--config.data.arithmetic.num_train=64", "--config.checkpoint.save_every=1000",
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
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
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


def test_poisoned_steps_are_skipped_then_the_run_stops(tmp_path, monkeypatch):
  real = experience.compute_advantages
  poisoned_steps = {2, 3, 4, 5}
  calls = {"n": 0}

  def poisoned(traj, norm_adv_by_std=True):
    calls["n"] += 1
    adv = real(traj, norm_adv_by_std)
    return np.full_like(adv, np.nan) if calls["n"] in poisoned_steps else adv

  monkeypatch.setattr(train_lib.exp, "compute_advantages", poisoned)
  c = _small_config()
  c.num_steps = 8
  c.optim.max_consecutive_skips = 6  # 2 updates per step: steps 2-4 make 6 in a row
  workdir = str(tmp_path / "nan")
  with pytest.raises(train_lib.NonFiniteUpdatesError, match="consecutive non-finite"):
    train_lib.train_and_evaluate(c, workdir)
  rows = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  skipped = {r["step"]: r["actor/skipped"] for r in rows}
  assert skipped[1] == 0.0 and skipped[2] == 1.0 and skipped[3] == 1.0
  for r in rows:  # the skipped updates left nothing non-finite behind
    assert r["actor/grad_norm"] is None or np.isfinite(r["actor/grad_norm"])
  # The run stopped at step 4 without saving it; the kept checkpoint holds finite params
  # (skipped updates leave params and optimizer state untouched).
  ckpts = sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())
  assert ckpts[-1] == 3
  from tests.test_train_e2e import _params  # pylint: disable=g-import-not-at-top
  assert all(np.isfinite(np.asarray(x)).all() for x in _params(workdir, 3))
