"""What a ``dapo-train`` run on a ``gs://`` workdir prints: its step lines and little else.

Run as a user runs it (the console script, in a child process, output to a pipe as in a cluster
log) against a real GCS server (tests/gcs_emulator.py), with a checkpoint and a metrics flush at
every step: each step reads and writes the bucket, where third-party libraries used to print.
Before the logging defaults (dapo_jax/console_log.configure_logging), the TensorBoard writer's
NaN skip and the emulator's credential variables, a 40-step run of these flags (no per-step
checkpoint, samples every 10 steps) printed 298 lines: 40 step lines, 24 sample lines, 200
tensorboardX NaN warnings, 30 fsspec INFO lines, 3 start/end lines and TensorStore's
"Could not find the credentials file" error; after, 68 (the steps, the samples, 4 others).

The same run's bucket then serves the other commands (issue 41): `dapo-export` of a missing step
prints its one error line and nothing else (no Orbax "Given directory is read only" above it),
and `dapo-eval` through an outage of its checkpoint read prints a few lines, no traceback.
"""

import logging
import math
import os
import re
import subprocess
import sys
import time

import pytest

from tests import outage_target
from tests.gcs_emulator import GcsEmulator
from tests.tiny_run_flags import TINY_RUN_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3
# Not per step: the cache directory, the model, the launch's compile count, TensorStore's
# one-line note of the credentials it uses (C++ logging, on stderr).
FIXED_LINES = 5
_STEP = re.compile(r"dapo_jax\.infra\.console_log: step (\d+)/%d \|" % STEPS)


def _dapo_train() -> list[str]:
  script = os.path.join(os.path.dirname(sys.executable), "dapo-train")
  return [script] if os.path.exists(script) else [sys.executable, "-m", "dapo_jax.main"]


@pytest.fixture(scope="module")
def gs_run(tmp_path_factory):
  """(emulator, env, the 3-step run's output, its checkpoint objects) of a `dapo-train` run on
  gs://bkt-quiet/run, with a checkpoint and a metrics flush at every step."""
  if sys.platform != "linux":
    pytest.skip("fake-gcs-server binary")
  tmp_path = tmp_path_factory.mktemp("quiet")
  emu = GcsEmulator(str(tmp_path / "gcs"))
  emu.start()
  try:
    emu.create_bucket("bkt-quiet")
    env = {k: v for k, v in os.environ.items() if k != "EPATH_USE_TF"}
    env.update(emu.env, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    out = subprocess.run(
        [*_dapo_train(), f"--config={ROOT}/configs/tiny_cpu.py", "--workdir=gs://bkt-quiet/run",
         f"--config.num_steps={STEPS}", *TINY_RUN_FLAGS, "--config.checkpoint.save_every=1",
         "--config.logging.samples_every=0"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    saved = emu.object_names("bkt-quiet", "run/checkpoints/")
    yield emu, env, out, saved
  finally:
    emu.stop()


def test_gs_run_prints_its_steps_and_little_else(gs_run):
  _, _, out, saved = gs_run
  lines = out.stdout.splitlines() + out.stderr.splitlines()
  assert out.returncode == 0, "\n".join(lines[-60:])
  steps = [int(m.group(1)) for line in lines if (m := _STEP.search(line))]
  assert steps == list(range(1, STEPS + 1)), "\n".join(lines)
  assert any(n.endswith(f"/{STEPS}/commit_success.txt") for n in saved), saved  # it did write
  others = [line for line in lines if not _STEP.search(line)]
  assert len(others) <= FIXED_LINES, f"{len(others)} lines besides the steps:\n" + "\n".join(others)


def test_export_of_a_missing_step_prints_one_line(gs_run, tmp_path):
  """Orbax's "Given directory is read only" warning (a read-only restore) stays off the terminal
  unless --verbose asks for it (issue 41: it came above the error line)."""
  _, env, _, _ = gs_run
  cmd = [sys.executable, "-c", "from dapo_jax.commands import export; export.run()",
         "--workdir=gs://bkt-quiet/run", "--step=7", f"--out={tmp_path / 'out'}"]
  out = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
  lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
  assert out.returncode == 2 and len(lines) == 1, "\n".join(lines)
  assert lines[0].startswith("dapo-export: error: ") and "7" in lines[0], lines


def test_eval_through_an_outage_prints_few_lines(gs_run, tmp_path):
  """`dapo-eval` whose checkpoint read meets an outage (the storage stopped just before it, for
  longer than one request's retries) waits it out with one warning and no third-party
  traceback, as dapo-train does (issue 41: 104 lines on stderr, two gcsfs tracebacks), then
  evaluates. Its waits are scaled as in tests/test_storage_outages.py."""
  emu, env, _, _ = gs_run
  hold = tmp_path / "hold"
  hold.mkdir()
  env = dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=1",
             **{outage_target.SCALE_ENV: "0.05", outage_target.COMMAND_ENV: "eval",
                outage_target.HOLD_ENV: str(hold)})
  cmd = [sys.executable, "-m", "tests.outage_target", "--workdir=gs://bkt-quiet/run",
         f"--step={STEPS}", "--config.eval.max_examples=2", "--config.eval.num_samples=1",
         "--config.eval.batch_size=2"]
  proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 240
    while not (hold / "reading").exists() and proc.poll() is None and time.monotonic() < deadline:
      time.sleep(0.05)
    emu.stop()
    try:
      (hold / "go").touch()
      time.sleep(4)  # past gcsfs's (scaled) retries of one request
    finally:
      emu.start()
    stdout, stderr = proc.communicate(timeout=300)
  finally:
    if proc.poll() is None:
      proc.kill()
  err = [line for line in stderr.splitlines() if line.strip()]
  assert proc.returncode == 0, "\n".join(err[-60:])
  assert '"avg@1"' in stdout or "avg@1" in stdout, stdout[-2000:]
  assert "Traceback" not in stderr and not any("Given directory" in e for e in err), stderr
  assert any("storage unreachable" in e for e in err), "\n".join(err)
  assert len(err) <= 6, f"{len(err)} lines on stderr:\n" + "\n".join(err)


def test_non_finite_scalars_stay_out_of_tensorboard(tmp_path, caplog):
  """A NaN (a ratio with nothing to count) is no point on a TensorBoard curve and made
  tensorboardX log a warning per value; metrics.jsonl keeps it as null."""
  from dapo_jax.infra import metrics  # pylint: disable=g-import-not-at-top
  from tests.test_metrics import _scalars  # pylint: disable=g-import-not-at-top
  with caplog.at_level(logging.WARNING), metrics.MetricsWriter(tmp_path) as w:
    w.write_scalars(1, {"a": 1.0, "nan": math.nan, "inf": math.inf})
    w.write_scalars(2, {"a": 2.0, "nan": 0.5})
  assert _scalars(tmp_path / metrics.TB_SUBDIR) == {("a", 1): 1.0, ("a", 2): 2.0, ("nan", 2): 0.5}
  assert math.isnan(metrics.read_jsonl(tmp_path / metrics.METRICS_FILE)[0]["inf"])  # null
  assert not [r for r in caplog.records if r.name.startswith("tensorboardX")], caplog.text
