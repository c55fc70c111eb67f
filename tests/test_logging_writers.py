"""The wandb writer next to TensorBoard + JSONL: an offline run's files hold what was written."""

import glob
import json
import logging
import os
import struct
import sys

import jax
import numpy as np
import pytest
from wandb.proto import wandb_internal_pb2

from dapo_jax import config as config_lib
from dapo_jax.infra import logging_writers as W
from dapo_jax.infra import metrics as M
from dapo_jax.spec.run_spec import RunSpec


@pytest.fixture(name="offline_wandb")
def _offline_wandb(tmp_path, monkeypatch):
  root = tmp_path / "wandb_dir"
  root.mkdir()
  for k, v in {"WANDB_MODE": "offline", "WANDB_DIR": str(root), "WANDB_SILENT": "true",
               "WANDB_CONSOLE": "off"}.items():
    monkeypatch.setenv(k, v)
  yield root
  import wandb  # pylint: disable=g-import-not-at-top
  wandb.teardown()  # wandb reads WANDB_DIR once per process; the next test gets its own


def _records(path):
  """The protobuf records of a ``.wandb`` file, read here from its framing (LevelDB log
  format: 32 KiB blocks, a 7-byte header per chunk) rather than by wandb's own reader."""
  data = open(path, "rb").read()
  assert data[:4] == b":W&B", data[:8]
  block, pos, out, cur = 32768, 7, [], b""
  while pos + 7 <= len(data):
    room = block - pos % block
    if room < 7:
      pos += room
      continue
    _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
    if n == 0 and kind == 0:  # block padding
      pos += room
      continue
    chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
    if kind == 1:  # a whole record
      out.append(chunk)
    elif kind in (2, 3):  # first / middle piece
      cur = (b"" if kind == 2 else cur) + chunk
    elif kind == 4:  # last piece
      out.append(cur + chunk)
  records = []
  for raw in out:
    rec = wandb_internal_pb2.Record()
    rec.ParseFromString(raw)
    records.append(rec)
  return records


def _run(root):
  """(run record, {step: {key: value}}) of the one offline run under ``root``."""
  (path,) = glob.glob(os.path.join(root, "wandb", "offline-run-*", "run-*.wandb"))
  run, rows = None, {}
  for rec in _records(path):
    kind = rec.WhichOneof("record_type")
    if kind == "run":
      run = rec.run
    elif kind == "history":
      item = {"/".join(i.nested_key) or i.key: json.loads(i.value_json)
              for i in rec.history.item}
      rows[int(item.pop("_step"))] = item
  return run, rows


def _wandb_config(**wandb):
  c = config_lib.default_config()
  c.logging.samples_every = 2
  c.logging.wandb.update(enable=True, mode="offline", project="dapo_test", **wandb)
  return c


def test_offline_run_holds_scalars_texts_config_and_resumes_its_id(tmp_path, offline_wandb):
  workdir = tmp_path / "run"
  c = _wandb_config(tags="dapo, tiny", name="h7")
  with W.open_writers(RunSpec.from_config(c), workdir, active=True) as w:
    w.write_scalars(1, {"train/acc_mean": 0.25, "eval/avg@4": np.float32(0.5)})
    w.write_scalars(1, {"time/rollout": 1.5})  # same step: the same row
    w.write_texts(1, {"sample_0": "not on a samples_every step"})
    w.flush()
    w.write_scalars(2, {"train/acc_mean": jax.numpy.asarray(0.75), "actor/entropy": 3})
    w.write_texts(2, {"sample_0": "'2+3=' -> '5' (reward +1.00)"})
  run, rows = _run(offline_wandb)
  assert run.project == "dapo_test" and run.display_name == "h7"
  assert list(run.tags) == ["dapo", "tiny"]
  config = {u.key: json.loads(u.value_json) for u in run.config.update}
  assert config["optim"]["lr"] == c.optim.lr and config["logging"]["samples_every"] == 2
  scalars = {s: {k: v for k, v in r.items() if not k.startswith(("_", "samples"))}
             for s, r in rows.items()}
  assert scalars == {1: {"train/acc_mean": 0.25, "eval/avg@4": 0.5, "time/rollout": 1.5},
                     2: {"train/acc_mean": 0.75, "actor/entropy": 3.0}}
  assert "samples/_type" not in rows[1] and rows[2]["samples/_type"] == "table-file"
  (table,) = glob.glob(os.path.join(offline_wandb, "wandb", "offline-run-*", "files", "media",
                                    "table", "samples_*.table.json"))
  assert json.load(open(table))["data"] == [["sample_0", "'2+3=' -> '5' (reward +1.00)"]]
  # TensorBoard/JSONL still get everything.
  assert M.read_jsonl(workdir / M.METRICS_FILE)[0]["time/rollout"] == 1.5
  # A restart on the same workdir continues the same wandb run.
  run_id = (workdir / W.RUN_ID_FILE).read_text()
  assert run.run_id == run_id
  with W.open_writers(RunSpec.from_config(c), workdir, resume_step=2, active=True) as w:
    assert w.writers[1].run.id == run_id


def test_missing_wandb_names_the_install(tmp_path, monkeypatch):
  spec = RunSpec.from_config(_wandb_config())  # validated while wandb was there
  monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` sees when not installed
  with pytest.raises(ValueError, match=r"config\.logging\.wandb\.enable=True.*pip install wandb"):
    config_lib.validate(_wandb_config())
  with pytest.raises(ImportError, match="pip install wandb"):
    W.open_writers(spec, tmp_path, active=True)
  # Off (the default): never imported, nothing asked of the user.
  config_lib.validate(config_lib.default_config())
  with W.open_writers(RunSpec.from_config(config_lib.default_config()), tmp_path, active=True) as w:
    assert [type(x) for x in w.writers] == [M.MetricsWriter]


def test_only_process_zero_creates_a_run(tmp_path, offline_wandb, monkeypatch):
  monkeypatch.setattr(jax, "process_index", lambda: 3)
  # active from the process index
  with W.open_writers(RunSpec.from_config(_wandb_config()), tmp_path / "run") as w:
    w.write_scalars(1, {"a": 1.0})
    w.write_texts(2, {"t": "x"})
  assert not (tmp_path / "run").exists()
  assert not glob.glob(os.path.join(offline_wandb, "wandb", "offline-run-*"))


def test_tags_from_a_string_or_a_list():
  assert W.wandb_tags(" dapo,, qwen2.5-32b ") == ["dapo", "qwen2.5-32b"]
  assert W.wandb_tags(["a", " b"]) == ["a", "b"]
  assert W.wandb_tags("") == []


def test_tiny_run_logs_lines_samples_and_wandb_rows(tmp_path, offline_wandb, caplog):
  """The trainer's wiring: non-terminal lines every `log_every` steps, samples every
  `samples_every`, and the same scalars in metrics.jsonl and the wandb run."""
  from tests.test_train_e2e import _small_config  # pylint: disable=g-import-not-at-top
  from dapo_jax.trainer.train import train_and_evaluate  # pylint: disable=g-import-not-at-top
  caplog.set_level(logging.INFO)
  c = _small_config(**{"num_steps": 3, "log_every": 2, "num_sample_texts": 1,
                       "logging.console": "lines", "logging.samples_every": 2,
                       "logging.wandb.enable": True, "logging.wandb.mode": "offline",
                       "logging.wandb.project": "dapo_test"})
  train_and_evaluate(c, str(tmp_path / "run"))
  msgs = [r.getMessage() for r in caplog.records if r.name == "dapo_jax.infra.console_log"]
  steps = [m.split(" |")[0] for m in msgs if m.startswith("step ")]
  assert steps == ["step 2/3", "step 3/3"]
  line = next(m for m in msgs if m.startswith("step 2/3"))
  for part in ("acc ", "reward ", "kept ", "gen 1", "len ", "clip ", "entropy ", "rollout ",
               "old_logprob ", "update "):
    assert part in line, (part, line)
  samples = [m for m in msgs if m.startswith("sample ")]
  assert len(samples) == 1 and samples[0].startswith("sample 1/1 at step 2 (reward ")
  rows = M.read_jsonl(tmp_path / "run" / M.METRICS_FILE)
  _, wandb_rows = _run(offline_wandb)
  for row in rows:
    for key in ("train/acc_mean", "train/reward_mean", "actor/pg_clipfrac", "time/update"):
      assert wandb_rows[row["step"]][key] == pytest.approx(row[key], rel=1e-6), key
  assert "samples/_type" in wandb_rows[2] and "samples/_type" not in wandb_rows[1]
