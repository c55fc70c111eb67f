"""`config.tpu_windowed_einsum` reaches libtpu through LIBTPU_INIT_ARGS before JAX starts, in
dapo-plan as in the trainer (so the plan compiles the trainer's program)."""

import os
import subprocess
import sys

import pytest

from dapo_jax import config as config_lib
from dapo_jax.infra import libtpu_flags
from dapo_jax.planner import plan as plan_lib

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")
ALL_GATHER, REDUCE_SCATTER = libtpu_flags.WINDOWED_EINSUM_OFF


def test_default_turns_windowed_einsum_off_and_keeps_what_the_user_set():
  default = config_lib.default_config().tpu_windowed_einsum
  env = {}
  assert libtpu_flags.apply(default, env) == [ALL_GATHER, REDUCE_SCATTER]
  assert env[libtpu_flags.ENV] == f"{ALL_GATHER} {REDUCE_SCATTER}"
  assert libtpu_flags.apply(False, env) == [] and env[libtpu_flags.ENV].count("all_gather") == 1
  # A value the user set for one of them wins; the other is appended after their options.
  mine = "--xla_tpu_enable_windowed_einsum_for_all_gather=true --xla_foo=1"
  env = {libtpu_flags.ENV: mine}
  assert libtpu_flags.apply(False, env) == [REDUCE_SCATTER]
  assert env[libtpu_flags.ENV] == f"{mine} {REDUCE_SCATTER}"
  env = {}
  assert libtpu_flags.apply(True, env) == [] and libtpu_flags.ENV not in env
  with pytest.raises(ValueError, match="tpu_windowed_einsum"):  # e.g. a dict-built config's
    libtpu_flags.apply("no", {})


class _Stop(Exception):
  pass


def test_plan_sets_the_options_before_the_backend_starts(monkeypatch):
  monkeypatch.delenv(libtpu_flags.ENV, raising=False)
  seen = []

  def parse_target(target):
    seen.append(os.environ.get(libtpu_flags.ENV))
    raise _Stop

  monkeypatch.setattr(plan_lib, "parse_target", parse_target)
  with pytest.raises(_Stop):
    plan_lib.main(["--config", os.path.join(CONFIGS, "tiny_cpu.py"), "--target", "cpu:8"])
  assert seen == [f"{ALL_GATHER} {REDUCE_SCATTER}"]
  monkeypatch.delenv(libtpu_flags.ENV)
  with pytest.raises(_Stop):
    plan_lib.main(["--config", os.path.join(CONFIGS, "tiny_cpu.py"), "--target", "cpu:8",
                   "--config.tpu_windowed_einsum=True"])
  assert seen[-1] is None


def test_dapo_train_sets_the_options_before_the_backend_starts(tmp_path):
  """The trainer's entry point sets the variable before `distributed.maybe_initialize` (which
  runs before anything asks JAX for devices)."""
  code = ("import os, sys\n"
          "from dapo_jax import main\n"
          "from dapo_jax.infra import distributed\n"
          "def stop():\n"
          "  from jax._src import xla_bridge as xb\n"
          "  print('ENV', os.environ.get('LIBTPU_INIT_ARGS'), xb.backends_are_initialized())\n"
          "  sys.exit(0)\n"
          "distributed.maybe_initialize = stop\n"
          "sys.argv = ['dapo-train', '--config', sys.argv[1], '--workdir', sys.argv[2]]\n"
          "main.run()\n")
  env = {k: v for k, v in os.environ.items() if k != libtpu_flags.ENV}
  out = subprocess.run([sys.executable, "-c", code, os.path.join(CONFIGS, "tiny_cpu.py"),
                        str(tmp_path)], capture_output=True, text=True, env=env, timeout=300,
                       check=True).stdout
  assert f"ENV {ALL_GATHER} {REDUCE_SCATTER} False" in out, out
