"""User mistakes get one line from every command (issue 27): exit code 2 and exactly one
non-empty stderr line ``dapo-X: error: ...`` naming the thing and the fix; unexpected errors keep
their traceback.

Each command runs in this process through `cli.exit_on_error` (what its console script runs), so
the table costs no interpreter start. `MISTAKES` is the table the issue's closing note quotes.
"""

import functools
import os
import subprocess
import sys

import pytest

from dapo_jax.spec import cli
from dapo_jax import config as config_lib
from dapo_jax.trainer import evaluate
from dapo_jax.commands import export
from dapo_jax import main as train_main
from dapo_jax.planner import plan
from dapo_jax.commands import serve
from tests.gcs_emulator import GcsEmulator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.py")

COMMANDS = {"dapo-train": train_main.main, "dapo-eval": evaluate.main,
            "dapo-serve": functools.partial(serve.main, block=False),
            "dapo-export": export.main, "dapo-plan": plan.main}
ALL = tuple(COMMANDS)
# Each command's flags besides the mistake ({w}: a workdir that does not exist).
BASE = {"dapo-train": [f"--config={TINY}", "--workdir={w}"],
        "dapo-eval": [f"--config={TINY}"], "dapo-serve": [f"--config={TINY}"],
        "dapo-export": [f"--config={TINY}", "--workdir={w}", "--out={w}-out"],
        "dapo-plan": [f"--config={TINY}", "--target=cpu:8"]}

# (mistake, commands, flags added (a --config= or --workdir= replaces the base one), what the
# line must say). `{w}` is a fresh local path.
MISTAKES = [
    ("config key typo", ALL, ["--config.optim.lrr=1e-5"],
     "--config.optim.lrr: unknown config key 'lrr'. Did you mean --config.optim.lr?"),
    ("typo in a nested key", ALL, ["--config.model.overrides.hiden_size=64"],
     "Did you mean --config.model.overrides.hidden_size?"),
    ("missing config file", ALL, ["--config=configs/tiny_gpu.py"],
     "--config=configs/tiny_gpu.py: no such config file"),
    ("config variant the file rejects", ALL, [f"--config={TINY}:naive_grp"],
     "the config file failed: ValueError: Unknown tiny_cpu variant 'naive_grp'"),
    ("override of the wrong type", ALL, ["--config.optim.lr=1e-5x"],
     "flag --config.optim.lr=1e-5x: could not convert string to float"),
    ("mesh without sizes", ALL, ["--config.mesh=fsdp"],
     "'fsdp': write axis=size pairs, e.g. fsdp=-1,tensor=8"),
    ("misspelt flag", ALL, ["--workdri=/tmp/x"], "Unknown command line flag 'workdri'"),
    ("stray argument", ALL, ["8"],
     "unexpected arguments ['8']; flags are written --name=value"),
    ("mesh that does not divide the devices", ("dapo-train",), ["--config.mesh=data=3"],
     "Mesh [('data', 3)] does not divide the 8 available devices. Use -1 for one axis"),
    ("mesh that does not divide the devices", ("dapo-plan",), ["--config.mesh=data=3"],
     "Mesh [('data', 3)] does not divide the 8 available devices"),
    ("mesh that does not divide the devices", ("dapo-train", "dapo-eval", "dapo-serve",
                                               "dapo-export"), ["--config.mesh=data=-1,tensor=3"],
     "config.mesh=[('data', -1), ('tensor', 3)]: Mesh [('data', -1), ('tensor', 3)] does not "
     "divide the 8 available devices"),
    ("rollout mesh that does not divide the devices", ("dapo-eval", "dapo-serve", "dapo-export"),
     ["--config.rollout_mesh=tensor=3"], "config.rollout_mesh=[('tensor', 3)]: Mesh"),
    ("unknown mesh axis", ALL, ["--config.mesh=dp=-1"],
     "config.mesh=[('dp', -1)]: axis names must be distinct and among ('data', 'fsdp', "
     "'tensor')"),
    ("no steps", ("dapo-train", "dapo-plan"), ["--config.num_steps=-3"],
     "config.num_steps=-3: must be >= 1"),
    ("zero steps", ("dapo-train", "dapo-plan"), ["--config.num_steps=0"],
     "config.num_steps=0: must be >= 1"),
    ("model directory that does not exist", ("dapo-train", "dapo-eval", "dapo-serve",
                                             "dapo-plan"), ["--config.model.checkpoint={w}-model"],
     "{w}-model"),
    ("model directory that does not exist", ("dapo-train", "dapo-eval", "dapo-serve"),
     ["--config.model.checkpoint={w}-model"],
     "config.model.checkpoint='{w}-model': no such directory {w}-model (expected a Hugging "
     "Face checkpoint directory"),
    ("mini-batch that does not divide the batch", ("dapo-train",),
     ["--config.optim.mini_batch_size=3"],
     "config.optim.mini_batch_size=3: must (1) divide optim.train_batch_size=16, (2) times "
     "rollout.n=8 give a multiple of the 8 batch shards (batch axes {'fsdp': 8} on 8 devices), "
     "(3) times rollout.n=8 give a multiple of optim.micro_batch_size=64 or at most 64 (one "
     "micro-batch); 3 fails (1): use e.g. 2 or 4"),
    ("mini-batch whose rows do not split over the devices", ("dapo-train",),
     ["--config.optim.mini_batch_size=1", "--config.rollout.n=4"],
     "1 fails (2): use e.g. 2"),
    ("mini-batch that does not divide the batch", ("dapo-plan",),
     ["--config.optim.mini_batch_size=3"], "3 fails (1): use e.g. 2 or 4"),
    ("unknown dtype", ("dapo-train", "dapo-plan"), ["--config.model.dtype=fp16"],
     "config.model.dtype='fp16': choose one of ('float32', 'bfloat16', 'float16')"),
    ("unknown model preset", ("dapo-train",), ["--config.model.preset=qwen2.5-33b"],
     "config.model.preset='qwen2.5-33b': not a preset; did you mean"),
    ("workdir that is not a run", ("dapo-eval", "dapo-serve", "dapo-export"),
     ["--config=", "--workdir={w}"], "config.json not found: is {w} a dapo-train workdir?"),
    ("--allow_config_change typo", ("dapo-train",), ["--allow_config_change=optim.lrr"],
     "--allow_config_change: optim.lrr is not a config key"),
    ("no --workdir", ("dapo-train",), ["--workdir="], "--workdir is required"),
]


@pytest.fixture(autouse=True)
def quiet_train_logging(monkeypatch):
  """dapo-train points the root logger at sys.stdout, which is pytest's capture here."""
  monkeypatch.setattr(train_main, "_setup_logging", lambda: None)


def _argv(prog, added, w):
  replaced = {a.split("=", 1)[0] for a in added if a.startswith(("--config=", "--workdir="))}
  argv = [a for a in BASE[prog] if a.split("=", 1)[0] not in replaced]
  argv += [a for a in added if a not in ("--config=", "--workdir=")]
  return [a.replace("{w}", w) for a in argv]


def run_command(prog, argv, capsys) -> tuple[int, str]:
  """(exit code, stderr) of ``prog`` as its console script runs it."""
  capsys.readouterr()
  with pytest.raises(SystemExit) as e:
    cli.exit_on_error(prog, COMMANDS[prog], argv)
  return e.value.code, capsys.readouterr().err


def assert_one_line(prog, code, err, want):
  lines = [line for line in err.splitlines() if line.strip()]
  assert code == 2 and len(lines) == 1, (prog, code, err[-3000:])
  assert lines[0].startswith(f"{prog}: error: "), lines
  assert want in lines[0], (want, lines[0])


@pytest.mark.parametrize("mistake,progs,added,want", MISTAKES,
                         ids=[f"{m[0]}-{'+'.join(p.split('-')[1] for p in m[1])}"
                              for m in MISTAKES])
def test_a_mistake_gets_one_line_from_every_command(mistake, progs, added, want, tmp_path,
                                                     capsys):
  del mistake
  w = str(tmp_path / "run")
  for prog in progs:
    code, err = run_command(prog, _argv(prog, added, w), capsys)
    assert_one_line(prog, code, err, want.replace("{w}", w))
    assert not os.path.exists(w), prog  # answered before anything was written


def test_a_mesh_is_checked_on_one_device_too(tmp_path, capsys, monkeypatch):
  """One device builds no mesh, but a mesh that cannot fit it is still a mistake: every
  command that takes one says so (issue 41: dapo-eval ignored it and exited 0)."""
  import jax  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(jax, "device_count", lambda *args, **kwargs: 1)
  w = str(tmp_path / "run")
  for prog in ("dapo-train", "dapo-eval", "dapo-serve", "dapo-export"):
    code, err = run_command(prog, _argv(prog, ["--config.mesh=data=-1,tensor=3"], w), capsys)
    assert_one_line(prog, code, err, "config.mesh=[('data', -1), ('tensor', 3)]: Mesh "
                    "[('data', -1), ('tensor', 3)] does not divide the 1 available devices")
    assert not os.path.exists(w), prog


def test_a_missing_bucket_is_named(tmp_path, capsys, monkeypatch):
  """A definite "no such bucket" (HTTP 404) is one line naming the bucket, at once."""
  emu = GcsEmulator(str(tmp_path / "gcs"))
  emu.start()
  try:
    for k, v in emu.env.items():
      monkeypatch.setenv(k, v)
    emu.apply_in_process()  # the variables above are undone by monkeypatch afterwards
    w = "gs://no-such-bucket-27/run"
    for prog in ("dapo-train", "dapo-eval", "dapo-serve", "dapo-export"):
      added = ["--workdir=" + w] + (["--config="] if prog != "dapo-train" else [])
      code, err = run_command(prog, _argv(prog, added, w), capsys)
      assert_one_line(prog, code, err, "bucket gs://no-such-bucket-27 (of --workdir "
                      f"{w}) does not exist or is not reachable")
  finally:
    emu.stop()
    from etils.epath import gpath  # pylint: disable=g-import-not-at-top
    gpath._is_tf_installed.cache_clear()  # pylint: disable=protected-access


def test_following_a_batch_suggestion_never_hits_another_rule():
  """Over a grid of batch sizes and meshes: every suggested mini-batch size passes all of
  validate's rules on it (issue 27: the old message's suggestion failed the next rule)."""
  checked = 0
  for train in (6, 16, 24):
    for n in (1, 3, 8):
      for micro in (3, 64):
        for mesh in ([("data", 1), ("fsdp", -1), ("tensor", 1)],
                     [("data", 2), ("fsdp", -1), ("tensor", 2)]):
          c = config_lib.default_config()
          c.rollout.n, c.mesh = n, mesh
          c.optim.update(train_batch_size=train, micro_batch_size=micro)
          c.algorithm.gen_batch_size = train
          for mini in range(1, train + 1):
            c.optim.mini_batch_size = mini
            try:
              config_lib.validate(c, num_devices=8)
              continue
            except config_lib.ConfigError as e:
              msg = str(e)
            if not msg.startswith("config.optim.mini_batch_size=") or "use e.g." not in msg:
              continue
            values, _, then = msg.split("use e.g. ")[1].partition(", then ")
            for value in values.split(" or "):
              c.optim.mini_batch_size = int(value)
              try:
                config_lib.validate(c, num_devices=8)
              except config_lib.ConfigError as e2:
                assert not str(e2).startswith("config.optim.mini_batch_size="), (msg, e2)
                if str(e2).startswith("config.optim.micro_batch_size="):  # said, with a value
                  assert "set optim.micro_batch_size" in then, (msg, e2)
                  micro_fix = int(str(e2).split("use e.g. ")[1].split(" or ")[0])
                  c.optim.micro_batch_size = micro_fix
                  config_lib.validate(c, num_devices=8)
                  c.optim.micro_batch_size = micro
              checked += 1
  assert checked > 50


def test_unexpected_errors_keep_their_traceback(tmp_path, monkeypatch):
  """A ValueError raised inside the run (a bug, not a mistake) is not made into one line."""
  from dapo_jax.trainer import train  # pylint: disable=g-import-not-at-top

  def broken(*args, **kwargs):
    raise ValueError("an internal bug")
  monkeypatch.setattr(train, "train_and_evaluate", broken)
  with pytest.raises(ValueError, match="an internal bug"):
    cli.exit_on_error("dapo-train", train_main.main,
                      [f"--config={TINY}", f"--workdir={tmp_path / 'run'}"])


@pytest.mark.parametrize("error", ["sampling_stopped", "side_gone"])
def test_a_checkpointed_stop_prints_one_line(tmp_path, monkeypatch, capsys, error):
  """A sampling stop (data ran out, max_num_gen_batches) and the other side of a split gone
  end a run that has saved what it could: one line and exit 2, not a traceback."""
  from dapo_jax.trainer import rollout_process, train  # pylint: disable=g-import-not-at-top
  made = {"sampling_stopped": train.SamplingStoppedError("Dynamic sampling stopped at step 3: "
                                                         "raise data.num_epochs."),
          "side_gone": rollout_process.SideGoneError("The rollout process has gone (EOFError) "
                                                     "with the training process at step 3.")}

  def stopped(*args, **kwargs):
    raise made[error]
  monkeypatch.setattr(train, "train_and_evaluate", stopped)
  with pytest.raises(SystemExit) as exit_:
    cli.exit_on_error("dapo-train", train_main.main,
                      [f"--config={TINY}", f"--workdir={tmp_path / 'run'}"])
  assert exit_.value.code == 2
  assert capsys.readouterr().err.strip().splitlines() == [f"dapo-train: error: {made[error]}"]


def test_the_console_script_prints_one_line(tmp_path):
  """The real entry point (`python -m dapo_jax.main`): exit 2, one line on stderr."""
  proc = subprocess.run(
      [sys.executable, "-m", "dapo_jax.main", f"--config={TINY}", f"--workdir={tmp_path}",
       "--config.num_step=5"], cwd=ROOT, capture_output=True, text=True, timeout=300,
      env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines() == [
      "dapo-train: error: --config.num_step: unknown config key 'num_step'. Did you mean "
      "--config.num_steps? dapo_jax/config.py lists every key."], proc.stderr[-2000:]
  assert os.listdir(tmp_path) == []
