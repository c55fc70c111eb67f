"""What a ``dapo-train`` run on a ``gs://`` workdir prints: its step lines and little else.

Run as a user runs it (the console script, in a child process, output to a pipe as in a cluster
log) against a real GCS server (tests/gcs_emulator.py), with a checkpoint and a metrics flush at
every step: each step reads and writes the bucket, where third-party libraries used to print.
Before the logging defaults (dapo_jax/console_log.configure_logging), the TensorBoard writer's
NaN skip and the emulator's credential variables, a 40-step run of these flags (no per-step
checkpoint, samples every 10 steps) printed 298 lines: 40 step lines, 24 sample lines, 200
tensorboardX NaN warnings, 30 fsspec INFO lines, 3 start/end lines and TensorStore's
"Could not find the credentials file" error; after, 68 (the steps, the samples, 4 others).
"""

import logging
import math
import os
import re
import subprocess
import sys

import pytest

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


@pytest.mark.skipif(sys.platform != "linux", reason="fake-gcs-server binary")
def test_gs_run_prints_its_steps_and_little_else(tmp_path):
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
  finally:
    emu.stop()
  lines = out.stdout.splitlines() + out.stderr.splitlines()
  assert out.returncode == 0, "\n".join(lines[-60:])
  steps = [int(m.group(1)) for line in lines if (m := _STEP.search(line))]
  assert steps == list(range(1, STEPS + 1)), "\n".join(lines)
  assert any(n.endswith(f"/{STEPS}/commit_success.txt") for n in saved), saved  # it did write
  others = [line for line in lines if not _STEP.search(line)]
  assert len(others) <= FIXED_LINES, f"{len(others)} lines besides the steps:\n" + "\n".join(others)


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
