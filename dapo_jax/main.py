r"""``dapo-train``: the command line of ``train.train_and_evaluate``.

  dapo-train --config configs/tiny_cpu.py --workdir /tmp/dapo_tiny
  dapo-train --config configs/dapo_qwen2_5_32b.py:naive_grpo --workdir gs://b/run \
      --config.optim.lr=2e-6

--config path[:variant] is a file in configs/ (its first line is the command that runs it);
--config.x=y overrides one leaf of it (dapo_jax/config.py lists them all), for example:
  --config.model.checkpoint=~/ckpt/Qwen2.5-32B   HF directory to start from
  --config.model.dtype=bfloat16                  compute dtype (and model.param_dtype)
  --config.mesh=data=-1,fsdp=4,tensor=8          training mesh (rollout_mesh: sampling)
  --config.num_steps=200 --config.optim.lr=1e-6 --config.rollout.n=16
  --config.data.train=~/data/dapo-math-17k.parquet --config.eval.every=5
dapo-eval, dapo-serve, dapo-export and dapo-plan take the same --config and overrides.
"""

from __future__ import annotations

import logging
import sys

from absl import app
from absl import flags
from ml_collections import config_flags

from dapo_jax import cli

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
  from dapo_jax import distributed, libtpu_flags  # pylint: disable=g-import-not-at-top
  libtpu_flags.apply(_CONFIG.value)  # before anything starts JAX's backends
  distributed.maybe_initialize()
  from dapo_jax.train import train_and_evaluate  # pylint: disable=g-import-not-at-top
  train_and_evaluate(cli.expand_paths(_CONFIG.value), cli.expand(_WORKDIR.value))


def run():
  # absl's --help prints __main__'s docstring and the key flags of the module named by argv[0]:
  # for the console script both are empty, so name ours.
  main_module = sys.modules["__main__"]
  if not main_module.__doc__:
    main_module.__doc__ = __doc__
  for name in ("config", "workdir"):
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[name])
  app.run(main)


if __name__ == "__main__":
  run()
