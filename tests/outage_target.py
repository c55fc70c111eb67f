"""`dapo-train` for the storage-outage tests: `python -m tests.outage_target --config ...`.

It runs `dapo_jax.main` unchanged, with every wait of an outage scaled by
``DAPO_OUTAGE_TIME_SCALE`` (default 1: real time), so that a test replays a minutes-long outage
in seconds with the same sequence of failed requests, saves and flushes:

  * gcsfs's retries of one request (6 tries, ~1+2+4+8+16 s apart; not configurable);
  * TensorStore's retries of an array write (`orbax.bound_tensorstore_retries`);
  * our own waits between attempts and at exit (`run_files.RETRY_WAIT_S`, `FINAL_RETRY_S`);
    the launch's wait is the config's ``checkpoint.storage_wait_s``, scaled by the caller.

With ``DAPO_OUTAGE_MARKER=<file>`` the wall time at which the run gives up (the first
`StorageUnavailableError` made) is written to that file, so a test can time the exit after it.

``DAPO_OUTAGE_COMMAND=eval`` runs `dapo-eval` instead; with ``DAPO_OUTAGE_HOLD=<dir>`` it writes
``<dir>/reading`` just before it reads the checkpoint and waits for ``<dir>/go``, so a test can
stop the storage exactly then.
"""

import os
import sys
import time

SCALE_ENV = "DAPO_OUTAGE_TIME_SCALE"
MARKER_ENV = "DAPO_OUTAGE_MARKER"
COMMAND_ENV = "DAPO_OUTAGE_COMMAND"
HOLD_ENV = "DAPO_OUTAGE_HOLD"


def hold_before_checkpoint_reads(hold: str) -> None:
  """The first checkpoint read waits, after ``<hold>/reading``, for ``<hold>/go``."""
  from dapo_jax.checkpoints import orbax as orbax_ckpt  # pylint: disable=g-import-not-at-top
  real = orbax_ckpt.restore_params_only

  def held(*args, **kwargs):
    if not os.path.exists(os.path.join(hold, "reading")):
      open(os.path.join(hold, "reading"), "w").close()
      deadline = time.monotonic() + 120
      while not os.path.exists(os.path.join(hold, "go")) and time.monotonic() < deadline:
        time.sleep(0.05)
    return real(*args, **kwargs)
  orbax_ckpt.restore_params_only = held


def install(scale: float, marker: str | None) -> None:
  # pylint: disable=g-import-not-at-top
  import asyncio
  import types
  from gcsfs import retry
  from dapo_jax.infra import run_files
  from dapo_jax.checkpoints import orbax as orbax_ckpt
  if scale != 1.0:
    real_sleep = asyncio.sleep
    retry.asyncio = types.SimpleNamespace(sleep=lambda seconds: real_sleep(seconds * scale))
    orbax_ckpt.bound_tensorstore_retries(6, 1.0 * scale, 16.0 * scale)
    run_files.RETRY_WAIT_S *= scale
    run_files.FINAL_RETRY_S *= scale
  if marker:
    real_init = run_files.StorageUnavailableError.__init__

    def init(self, *args):
      if not os.path.exists(marker):
        with open(marker, "w") as f:
          f.write(repr(time.time()))
      real_init(self, *args)
    run_files.StorageUnavailableError.__init__ = init


if __name__ == "__main__":
  sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX handles
  install(float(os.environ.get(SCALE_ENV, "1")), os.environ.get(MARKER_ENV))
  if os.environ.get(HOLD_ENV):
    hold_before_checkpoint_reads(os.environ[HOLD_ENV])
  if os.environ.get(COMMAND_ENV) == "eval":
    from dapo_jax.trainer import evaluate  # pylint: disable=g-import-not-at-top
    evaluate.run()
  else:
    from dapo_jax import main  # pylint: disable=g-import-not-at-top
    main.run()
