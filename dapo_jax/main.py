"""``dapo-train``: the command line of ``train.train_and_evaluate``.

  dapo-train --config configs/tiny_cpu.py --workdir /tmp/dapo_tiny
  dapo-train --config configs/dapo_qwen2_5_32b.py:naive_grpo --workdir gs://b/run \
      --config.optim.lr=2e-6
"""

from __future__ import annotations

import logging
import os
import sys

from absl import app
from absl import flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (path[:variant]).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                      stream=sys.stdout, force=True)
  for noisy in ("absl", "jax._src", "orbax", "tensorflow"):
    logging.getLogger(noisy).setLevel(logging.WARNING)
  from dapo_jax import distributed  # pylint: disable=g-import-not-at-top
  distributed.maybe_initialize()
  from dapo_jax.train import train_and_evaluate  # pylint: disable=g-import-not-at-top
  train_and_evaluate(_CONFIG.value, os.path.expanduser(_WORKDIR.value))


def run():
  app.run(main)


if __name__ == "__main__":
  run()
