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

from typing import Sequence

from absl import flags

from dapo_jax.spec import cli


def _define(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics), local or gs://.",
                      flag_values=fv)
  flags.DEFINE_list("allow_config_change", [], "Keys (or sections) a resumed run may change "
                    "although they change its state or algorithm, e.g. optim.lr,rollout.n; "
                    "recorded in <workdir>/config_history/.", flag_values=fv)
  flags.DEFINE_enum("role", "both", ["both", "train", "rollout"], "both: this process trains "
                    "and rolls out; train / rollout: this process does one side and a second "
                    "process, started with the other role, the same --config and --workdir and "
                    "the same --peer, does the other (docs/overlap.md).", flag_values=fv)
  flags.DEFINE_string("peer", "", "With --role: HOST:PORT where the training process listens "
                      "for its rollout process (one per training process, comma-separated, on "
                      "sides of several processes), or auto: the training processes listen on "
                      "free ports and write them to the workdir, where the rollout processes "
                      "read them.", flag_values=fv)
  cli.define_verbose(fv)


def _setup_logging(verbose: bool = False) -> None:
  from dapo_jax.infra import console_log  # pylint: disable=g-import-not-at-top
  console_log.configure_logging(verbose=verbose)  # stdout; third-party INFO chatter off


def main(argv: Sequence[str]) -> dict[str, float]:
  """``dapo-train`` without the program name in ``argv``; returns `train_and_evaluate`'s."""
  fv = cli.parse("dapo-train", __doc__, argv, _define)
  if not fv.workdir:
    raise flags.Error("--workdir is required: a local directory or gs://bucket/run (a new one "
                      "starts a run, an existing one resumes it).")
  if fv.verbose:
    _setup_logging(verbose=True)
  else:
    _setup_logging()
  from dapo_jax.infra import distributed, libtpu_flags  # pylint: disable=g-import-not-at-top
  libtpu_flags.apply(fv.config.get("tpu_windowed_einsum", False))  # before JAX starts
  distributed.maybe_initialize()
  # pylint: disable=g-import-not-at-top
  from dapo_jax import config as config_lib
  from dapo_jax.spec import run_config
  from dapo_jax.infra import run_files
  from dapo_jax.checkpoints import hf
  from dapo_jax.checkpoints import orbax as orbax_ckpt
  from dapo_jax.data.records import DataFormatError
  from dapo_jax.trainer import rollout_process
  from dapo_jax.trainer.train import SamplingStoppedError, train_and_evaluate
  # Past flag parsing only these are the user's to fix (a bad config value, a config change the
  # run cannot take, a missing bucket or model directory, a checkpoint of another model, a
  # malformed data file, a split's other process gone, a sampling stop, checkpointed) or a
  # storage outage past its retries (its own one line); any other error keeps its traceback.
  with cli.tracebacks_except(config_lib.ConfigError, run_config.ConfigChangeError,
                             run_config.BucketNotFoundError, hf.MissingCheckpointError,
                             orbax_ckpt.CheckpointLayoutError, DataFormatError,
                             run_files.StorageUnavailableError, rollout_process.RoleError,
                             rollout_process.PeerError, SamplingStoppedError):
    # The model directory before the workdir is made (a gs:// one retried through an outage).
    run_files.retry_transient(
        lambda: hf.check_checkpoint_dir(fv.config.model.checkpoint),
        what=f"--config.model.checkpoint={fv.config.model.checkpoint}",
        timeout_s=float(fv.config.checkpoint.storage_wait_s))
    return train_and_evaluate(fv.config, cli.expand(fv.workdir), fv.allow_config_change,
                              role=fv.role, peer=fv.peer)


def run() -> None:
  cli.exit_on_error("dapo-train", main)


if __name__ == "__main__":
  run()
