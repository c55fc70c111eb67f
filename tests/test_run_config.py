"""The workdir's config is a contract (issue 27): a relaunch that would change the run's state
or algorithm is refused in one line and leaves the workdir as it was; safe changes and
``--allow_config_change`` resume and are recorded in ``config_history/``; a checkpoint of
another model config is named as such, not as damage.

One real 1-step run (dapo-train in this process, configs/tiny_cpu.py shrunk by
`tiny_run_flags`) is shared by the tests; the test that resumes it works on a copy.
"""

import json
import os
import shutil

import pytest
from etils import epath

from dapo_jax.spec import cli
from dapo_jax.commands import export
from dapo_jax import main as train_main
from dapo_jax.spec import run_config
from dapo_jax.infra import run_files
from tests.gcs_emulator import GcsEmulator
from tests.test_user_mistakes import TINY, assert_one_line
from tests.test_user_mistakes import quiet_train_logging  # noqa: F401  (autouse)
from tests.tiny_run_flags import TINY_RUN_FLAGS

RUN_FLAGS = [*TINY_RUN_FLAGS, "--config.checkpoint.save_every=1",
             "--config.checkpoint.async_save=False"]


def _train(argv, capsys) -> tuple[int, str]:
  capsys.readouterr()
  with pytest.raises(SystemExit) as e:
    cli.exit_on_error("dapo-train", train_main.main, argv)
  return e.value.code, capsys.readouterr().err


def _snapshot(workdir) -> dict[str, tuple[int, bytes]]:
  """Every file with its mtime and bytes: a refused launch must change none."""
  out = {}
  for d, _, files in os.walk(workdir):
    for f in files:
      p = os.path.join(d, f)
      out[os.path.relpath(p, workdir)] = (os.stat(p).st_mtime_ns, open(p, "rb").read())
  return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A 1-step run; the workdir of a first launch."""
  workdir = str(tmp_path_factory.mktemp("contract") / "run")
  with pytest.MonkeyPatch.context() as m, pytest.raises(SystemExit) as e:
    m.setattr(train_main, "_setup_logging", lambda: None)  # (module scope: before the autouse)
    cli.exit_on_error("dapo-train", train_main.main, [
        f"--config={TINY}", f"--workdir={workdir}", *RUN_FLAGS, "--config.num_steps=1"])
  assert e.value.code == 0
  return workdir


def test_first_launch_is_recorded(run):
  (entry,) = run_config.history(run)
  assert entry["launch"] == 0 and entry["changes"] == {} and entry["resumed_from_step"] is None
  assert entry["config"] == json.loads(open(os.path.join(run, "config.json")).read())
  assert entry["config"]["model"]["overrides"]["hidden_size"] == 32


@pytest.mark.parametrize("change,keys", [
    (["--config.model.overrides.hidden_size=64"],
     ["model.overrides.hidden_size 32 -> 64"]),
    # Same shapes, another algorithm: it used to resume silently (issue 27).
    ([f"--config={TINY}:naive_grpo"],
     ["algorithm.clip_ratio_high 0.28 -> 0.2",
      'algorithm.loss_agg_mode "token-mean" -> "seq-mean-token-mean"',
      "reward.overlong_buffer_enable true -> false"]),
], ids=["shape", "algorithm"])
def test_a_relaunch_that_changes_the_run_is_refused(run, change, keys, capsys):
  before = _snapshot(run)
  config = next((c for c in change if c.startswith("--config=")), f"--config={TINY}")
  code, err = _train([config, f"--workdir={run}", *RUN_FLAGS, "--config.num_steps=1",
                      *(c for c in change if c != config)], capsys)
  for key in keys:
    assert_one_line("dapo-train", code, err, key)
  names = [k.split(" ")[0] for k in keys]
  assert f"--allow_config_change={','.join(names)}" in err
  assert "holds a run (checkpoint step 1) made with another config" in err
  assert _snapshot(run) == before  # config.json byte-identical, nothing written at all


def test_readers_of_the_run_still_work_after_a_refused_relaunch(run, tmp_path, capsys):
  code, _ = _train([f"--config={TINY}", f"--workdir={run}", *RUN_FLAGS,
                    "--config.model.overrides.hidden_size=64"], capsys)
  assert code == 2
  # dapo-eval and dapo-serve read the run's config the same way (no --config: config.json).
  assert cli.get_config(run).model.overrides.hidden_size == 32
  out = str(tmp_path / "hf")
  assert export.main([f"--workdir={run}", f"--out={out}"]) == out
  assert json.load(open(os.path.join(out, "config.json")))["hidden_size"] == 32


def test_safe_and_allowed_changes_resume_and_are_recorded(run, tmp_path, capsys):
  workdir = str(tmp_path / "run")
  shutil.copytree(run, workdir)
  code, err = _train([f"--config={TINY}", f"--workdir={workdir}", *RUN_FLAGS,
                      "--config.num_steps=2", "--config.optim.lr=2e-4",
                      "--allow_config_change=optim.lr"], capsys)
  assert code == 0, err[-3000:]
  steps = [json.loads(line)["step"] for line in open(os.path.join(workdir, "metrics.jsonl"))]
  assert steps == [1, 2]  # resumed from step 1
  first, second = run_config.history(workdir)
  assert second["launch"] == 1 and second["resumed_from_step"] == 1
  assert second["changes"] == {"num_steps": [1, 2], "optim.lr": [1e-4, 2e-4]}
  assert second["allowed"] == ["optim.lr"]
  assert first["config"]["optim"]["lr"] == 1e-4  # the history keeps every launch's config
  config = json.load(open(os.path.join(workdir, "config.json")))
  assert config == second["config"] and config["num_steps"] == 2


def test_an_allowed_shape_change_fails_the_restore_as_a_mismatch(run, capsys):
  """Let through on purpose, a model change still cannot restore: the line says it is the
  config, not damage, and config.json is untouched (written only after a restore)."""
  before = open(os.path.join(run, "config.json"), "rb").read()
  code, err = _train([f"--config={TINY}", f"--workdir={run}", *RUN_FLAGS,
                      "--config.model.overrides.hidden_size=64",
                      "--allow_config_change=model.overrides"], capsys)
  assert_one_line("dapo-train", code, err, "saved with another model config; the files are "
                  "not damaged")
  assert open(os.path.join(run, "config.json"), "rb").read() == before
  assert len(run_config.history(run)) == 1
  assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["1"]  # nothing quarantined


def test_changes_are_classified():
  assert all(run_config.is_safe(k) for k in (
      "num_steps", "logging.wandb.name", "eval.every", "checkpoint.save_every", "mesh",
      "data.num_epochs", "algorithm.max_num_gen_batches"))
  assert not any(run_config.is_safe(k) for k in (
      "seed", "model.overrides.hidden_size", "model.preset", "optim.lr", "rollout.n",
      "algorithm.loss_agg_mode", "algorithm.gen_batch_size", "eval.num_samples", "data.train",
      "eval", "checkpointx"))
  # The checkpoint cadence is the overlapped schedule's (max_staleness > 0), not otherwise.
  assert run_config.is_safe("checkpoint.save_every", {"algorithm.max_staleness": 0})
  assert not run_config.is_safe("checkpoint.save_every", {"algorithm.max_staleness": 2})
  assert run_config.is_safe("checkpoint.async_save", {"algorithm.max_staleness": 2})
  # A key the old file lacks is compared with the schema default (a field added since).
  from dapo_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  new = json.loads(config_lib.default_config().to_json_best_effort())
  old = json.loads(json.dumps(new))
  del old["algorithm"]["entropy_coeff"], old["optim"]["lr"]
  old["model"]["overrides"] = {"hidden_size": 8}
  new["optim"]["lr"] = 2e-6
  assert run_config.diff(old, new) == {"model.overrides.hidden_size": (8, "<absent>"),
                                       "optim.lr": (1e-6, 2e-6)}


def test_a_gs_workdir_refuses_without_writing(tmp_path, capsys, monkeypatch):
  emu = GcsEmulator(str(tmp_path / "gcs"))
  emu.start()
  try:
    for k, v in emu.env.items():
      monkeypatch.setenv(k, v)
    emu.apply_in_process()
    emu.create_bucket("contract")
    workdir = "gs://contract/run"
    first = cli.parse("dapo-train", "", [f"--config={TINY}", *RUN_FLAGS]).config
    run_config.record(run_config.check(workdir, first), None)
    # A checkpoint step: the refusal only looks at the step directories.
    (epath.Path(workdir) / "checkpoints" / "3" / "_CHECKPOINT_METADATA").write_text("{}")
    before = emu.object_names("contract")
    config_bytes = (epath.Path(workdir) / run_files.CONFIG_FILE).read_bytes()
    code, err = _train([f"--config={TINY}", f"--workdir={workdir}", *RUN_FLAGS,
                        "--config.rollout.n=8"], capsys)
    assert_one_line("dapo-train", code, err, "gs://contract/run holds a run (checkpoint step 3) "
                    "made with another config: rollout.n 4 -> 8.")
    assert emu.object_names("contract") == before
    assert (epath.Path(workdir) / run_files.CONFIG_FILE).read_bytes() == config_bytes
    assert [h["launch"] for h in run_config.history(workdir)] == [0]
  finally:
    emu.stop()
    from etils.epath import gpath  # pylint: disable=g-import-not-at-top
    gpath._is_tf_installed.cache_clear()  # pylint: disable=protected-access


@pytest.mark.parametrize("staleness,refused", [(0, False), (1, True)])
def test_the_checkpoint_cadence_of_an_overlapped_run_is_part_of_the_run(tmp_path, staleness,
                                                                         refused):
  """checkpoint.save_every may change on a resume, except where it sets the overlapped
  schedule (a step samples with the newest checkpoint's weights when newer than t - k)."""
  workdir = str(tmp_path / "run")
  flags = [f"--config={TINY}", *RUN_FLAGS, f"--config.algorithm.max_staleness={staleness}"]
  run_config.record(run_config.check(workdir, cli.parse("dapo-train", "", flags).config), None)
  os.makedirs(os.path.join(workdir, "checkpoints", "3"))
  (epath.Path(workdir) / "checkpoints" / "3" / "_CHECKPOINT_METADATA").write_text("{}")
  changed = cli.parse("dapo-train", "", [*flags, "--config.checkpoint.save_every=5"]).config
  if refused:
    with pytest.raises(run_config.ConfigChangeError, match="checkpoint.save_every 1 -> 5"):
      run_config.check(workdir, changed)
  else:
    assert run_config.check(workdir, changed).changes == {"checkpoint.save_every": (1, 5)}
