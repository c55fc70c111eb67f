"""The commands' one override syntax (`--config path --config.x=y`), help and path expansion."""

import os
import subprocess
import sys

import pytest
from absl import flags

from dapo_jax.spec import cli
from dapo_jax.planner import plan as plan_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.py")


def test_dapo_train_help_lists_config_workdir_and_common_overrides():
  # sys.argv[0] as the console script sets it: __main__ then has no docstring nor flags.
  proc = subprocess.run(
      [sys.executable, "-c", "import sys; sys.argv[0] = 'dapo-train'; "
       "from dapo_jax import main; main.run()", "--help"],
      capture_output=True, text=True, timeout=300, cwd=ROOT,
      env=dict(os.environ, PYTHONPATH=ROOT))
  assert proc.returncode in (0, 1), proc.stderr[-2000:]  # absl's --help exits with 1
  for text in ("--config:", "--workdir:", "--config.model.checkpoint=", "--config.mesh=",
               "--config.optim.lr="):
    assert text in proc.stdout, (text, proc.stdout)


def test_help_of_the_other_commands_names_their_flags(capsys):
  with pytest.raises(SystemExit) as e:
    plan_lib.main(["--help"])
  assert e.value.code == 0
  text = capsys.readouterr().out
  assert text.startswith("``dapo-plan``") and "--target" in text and "--config.x=y" in text


def test_mesh_overrides_and_home_expansion(monkeypatch, tmp_path):
  monkeypatch.setenv("HOME", str(tmp_path))
  fv = cli.parse("prog", "doc", [f"--config={TINY}", "--config.mesh=data=2,fsdp=-1,tensor=2",
                                 "--config.rollout_mesh=[('data', -1), ('tensor', 4)]",
                                 "--config.tokenizer.path=~/tok",
                                 "--config.data.train=~/train.parquet",
                                 "--config.data.eval=arithmetic"])
  c = fv.config
  assert list(c.mesh) == [("data", 2), ("fsdp", -1), ("tensor", 2)]
  assert list(c.rollout_mesh) == [("data", -1), ("tensor", 4)]
  assert c.tokenizer.path == str(tmp_path / "tok")
  assert c.data.train == str(tmp_path / "train.parquet") and c.data.eval == "arithmetic"
  assert c.data.data_dir == str(tmp_path / "tensorflow_datasets")  # the default, expanded
  with pytest.raises(flags.Error):
    cli.parse("prog", "doc", [f"--config={TINY}", "--config.mesh=fsdp"])
  with pytest.raises(flags.Error, match="--config is required"):
    cli.parse("prog", "doc", ["--config.seed=1"])
  with pytest.raises(flags.Error, match="unexpected arguments"):
    cli.parse("prog", "doc", [f"--config={TINY}", "stray"])


_EXITING = """
import atexit, logging, sys
import jax, jax.numpy as jnp
from dapo_jax.spec import cli
log = sys.argv[1]
atexit.register(lambda: open(log + ".atexit", "w").write("ran"))
def main(argv):
  logging.basicConfig(filename=log, level=logging.INFO)
  logging.info("logged before the exit")
  jnp.ones(3).sum().block_until_ready()  # a backend and a compiled program to tear down
  print("no newline yet", end="")
  if argv[-1] == "bad":
    raise ValueError("bad input")
  return 0
cli.exit_on_error("prog", main)
"""


@pytest.mark.parametrize("arg,code", [("ok", 0), ("bad", 2)])
def test_a_finished_command_exits_without_teardown_and_loses_no_output(tmp_path, arg, code):
  """The console path ends with os._exit (no JAX teardown, no atexit hooks: issue 41) after
  flushing the log handlers and standard streams; the exit code is kept."""
  log = str(tmp_path / "log.txt")
  proc = subprocess.run([sys.executable, "-c", _EXITING, log, arg], capture_output=True,
                        text=True, timeout=120, cwd=ROOT,
                        env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"))
  assert proc.returncode == code, proc.stderr
  assert proc.stdout == "no newline yet"
  assert "logged before the exit" in open(log).read()
  assert not os.path.exists(log + ".atexit")  # the interpreter's exit hooks were skipped
  if code:
    assert proc.stderr.strip().endswith("prog: error: bad input")
