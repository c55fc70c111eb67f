"""`dapo-train` for the kill test: `python -m tests.kill_target --config ... --workdir ...`.

It runs `dapo_jax.main` unchanged. With ``DAPO_KILLTEST_STALL=<step>:<stage>:<marker>`` set,
the Orbax write of checkpoint ``<step>`` stops at ``<stage>``, creates the file ``<marker>``
and sleeps, so the test's SIGKILL provably lands inside that write:

  * ``items``: the tmp directory and the array files exist, the JSON items are not written;
  * ``commit``: every file is written, the tmp directory is not yet renamed (committed).

The hooks wrap Orbax's own functions (`JsonCheckpointHandler._save_fn`,
`AtomicRenameTemporaryPath.finalize`); nothing in dapo_jax knows about them. PyTorch is kept
out: tensorboardX imports it only to accept torch tensors, and that import is ~2 s of every
one of the test's dozen launches.
"""

import os
import sys
import time

STALL_ENV = "DAPO_KILLTEST_STALL"
TMP_SUFFIX = ".orbax-checkpoint-tmp"


def _stall(marker: str) -> None:
  with open(marker, "w") as f:
    f.write(str(os.getpid()))
  time.sleep(600)  # the test kills the process long before


def _step_of(path) -> int | None:
  """The checkpoint step a path inside `<step>.orbax-checkpoint-tmp[...]/` belongs to."""
  for part in str(path).split(os.sep):  # item dirs inside it may be tmp dirs of their own
    head = part.split(TMP_SUFFIX)[0]
    if TMP_SUFFIX in part and head.isdigit():
      return int(head)
  return None


def install_hooks(spec: str) -> None:
  step_s, stage, marker = spec.split(":", 2)
  step = int(step_s)
  # pylint: disable=g-import-not-at-top,protected-access
  from orbax.checkpoint._src.handlers import json_checkpoint_handler
  from orbax.checkpoint._src.path import atomicity

  if stage == "items":
    real_save = json_checkpoint_handler.JsonCheckpointHandler._save_fn

    async def save_fn(self, x, directory):
      if _step_of(directory) == step:
        _stall(marker)
      return await real_save(self, x, directory)

    json_checkpoint_handler.JsonCheckpointHandler._save_fn = save_fn
  elif stage == "commit":
    real_finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(self):
      if _step_of(self.get()) == step:
        _stall(marker)
      return await real_finalize(self)

    atomicity.AtomicRenameTemporaryPath.finalize = finalize
  else:
    raise ValueError(f"{STALL_ENV}: unknown stage {stage!r} (items or commit).")


if __name__ == "__main__":
  sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX handles
  if os.environ.get(STALL_ENV):
    install_hooks(os.environ[STALL_ENV])
  from dapo_jax import main  # pylint: disable=g-import-not-at-top
  main.run()
