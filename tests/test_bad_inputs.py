"""Bad input, clear errors, nothing lost (issue #8, item 3).

Each test feeds one bad input and asserts that the error names the thing at fault. Covered
elsewhere and not repeated here: malformed rows at the loader level and bad parquet/JSONL files
(tests/test_data_records.py), a safetensors file with a missing or misshaped tensor and a
pickle-only checkpoint (tests/test_hf_parity.py), damaged Orbax steps
(tests/test_orbax_checkpoint.py), the sampler's own errors (tests/test_dynamic_sampling.py), the
commands' one-line answers to command-line mistakes (tests/test_user_mistakes.py).
"""

import ast
import dataclasses
import glob
import logging
import os

import numpy as np
import orbax.checkpoint as ocp
import pytest

from dapo_jax import config as config_lib
from dapo_jax.trainer import run_setup
from dapo_jax.trainer import train as train_lib
from dapo_jax.data.records import MalformedRowError
from dapo_jax.rewards.batch import RewardScorer
from dapo_jax.spec.run_spec import read_section
from tests import dapo_rows
from tests.test_train_e2e import ROOT, _small_config


def test_malformed_row_through_the_run_config_names_file_and_row(tmp_path, caplog):
  path = str(dapo_rows.write_malformed(tmp_path / "bad.parquet"))
  c = config_lib.default_config()
  with pytest.raises(MalformedRowError, match=rf"bad\.parquet: row {dapo_rows.MALFORMED_ROW}: "):
    run_setup.load_dataset(path, read_section(c, "data"), c.seed, "train")
  c.data.on_malformed = "skip"
  with caplog.at_level(logging.WARNING):
    records = run_setup.load_dataset(path, read_section(c, "data"), c.seed, "train")
  assert len(records) == len(dapo_rows.PROBLEMS) - 1
  assert "bad.parquet: skipped 1 malformed rows" in caplog.text  # counted, never silent


def test_unknown_config_key_is_named_with_a_suggestion():
  c = config_lib.default_config()
  c.optim.lrr = 1e-5  # a config file's typo: without the check, the default lr would stay
  with pytest.raises(ValueError, match=r"config\.optim\.lrr: unknown config key\. "
                     r"Did you mean 'optim\.lr'\?"):
    config_lib.validate(c)
  c = config_lib.default_config()
  c.checkpoints = {"save_every": 1}
  with pytest.raises(ValueError, match=r"config\.checkpoints: .* Did you mean 'checkpoint'"):
    config_lib.validate(c)
  c = config_lib.default_config()
  c.model.overrides = {"hiden_size": 32}
  with pytest.raises(ValueError, match=r"model\.overrides\.hiden_size: not a Qwen2Config "
                     r"field\. Did you mean 'hidden_size'"):
    config_lib.validate(c)


class _OneMixedGroupPerBatch(RewardScorer):
  """The real scorer, then the first response of each generation batch marked right: exactly
  one group per batch varies, so dynamic sampling keeps one group per generation batch."""

  closed = []  # one entry per close(): a failed run must still end its verifier workers

  def close(self):
    super().close()
    type(self).closed.append(True)

  def __call__(self, responses, ground_truths, response_lengths, timeout_s=None):
    out = super().__call__(responses, ground_truths, response_lengths, timeout_s)
    acc, score = np.zeros_like(out.acc), np.full_like(out.score, -1.0)
    acc[0], score[0] = True, 1.0
    return dataclasses.replace(out, acc=acc, score=score, reward=score + out.overlong_penalty)


def _sampling_config(**over):
  # The static engine scores one generation batch per scorer call, which the batch pattern of
  # `_OneMixedGroupPerBatch` relies on; the streaming case is the last test of this group.
  c = _small_config(**{"algorithm.dynamic_sampling": True, "algorithm.gen_batch_size": 2,
                       "optim.train_batch_size": 4, "optim.mini_batch_size": 2,
                       "rollout.engine": "static",
                       # two generation batches per epoch
                       "data.arithmetic.num_train": 4, **over})
  c.num_steps = 1
  return c


def _saved_meta(workdir, step):
  path = os.path.join(workdir, "checkpoints", str(step), "meta")
  return ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(path)


def test_dataset_exhausted_mid_sampling_checkpoints_the_groups(tmp_path, monkeypatch):
  monkeypatch.setattr(run_setup, "RewardScorer", _OneMixedGroupPerBatch)
  monkeypatch.setattr(_OneMixedGroupPerBatch, "closed", [])
  workdir = str(tmp_path / "run")
  # One epoch = 2 generation batches = 2 kept groups; a step needs 4.
  with pytest.raises(train_lib.SamplingStoppedError) as info:
    train_lib.train_and_evaluate(_sampling_config(**{"data.num_epochs": 1}), workdir)
  msg = str(info.value)
  assert "dataset 'arithmetic' ran out after data.num_epochs=1 epoch(s)" in msg, msg
  assert "2/4 groups gathered" in msg and "checkpoint of step 0" in msg, msg
  meta = _saved_meta(workdir, 0)
  assert len(meta["sampler"]["carried"]) == 2 and meta["iterator"]["epoch"] == 1
  assert _OneMixedGroupPerBatch.closed == [True]  # the scorer's worker pool was shut down


def test_max_num_gen_batches_checkpoints_the_groups(tmp_path, monkeypatch):
  monkeypatch.setattr(run_setup, "RewardScorer", _OneMixedGroupPerBatch)
  workdir = str(tmp_path / "run")
  with pytest.raises(train_lib.SamplingStoppedError) as info:
    train_lib.train_and_evaluate(_sampling_config(**{"algorithm.max_num_gen_batches": 2}),
                                 workdir)
  msg = str(info.value)
  assert "2/4 groups after 2 generation batches (algorithm.max_num_gen_batches=2" in msg, msg
  assert "The 2 group(s) gathered are saved with a checkpoint of step 0" in msg, msg
  first = _saved_meta(workdir, 0)["sampler"]["carried"]
  assert len(first) == 2 and all(sum(g["acc"]) == 1 for g in first)  # the kept groups
  # The relaunch starts from the saved groups: 2 carried + 1 new generation batch.
  with pytest.raises(train_lib.SamplingStoppedError, match=r"3/4 groups after 1 generation "
                     r"batches \(algorithm\.max_num_gen_batches=1"):
    train_lib.train_and_evaluate(_sampling_config(**{"algorithm.max_num_gen_batches": 1}),
                                 workdir)
  second = _saved_meta(workdir, 0)["sampler"]["carried"]
  assert [g["prompt"] for g in second[:2]] == [g["prompt"] for g in first]
  assert len(second) == 3


def test_streaming_rollout_stopped_by_the_dataset_checkpoints_the_groups(tmp_path, monkeypatch):
  """The continuous engine scores groups as they complete (not one batch per call), so the
  kept count depends on the poll layout; the message and the checkpoint must agree on it."""
  monkeypatch.setattr(run_setup, "RewardScorer", _OneMixedGroupPerBatch)
  monkeypatch.setattr(_OneMixedGroupPerBatch, "closed", [])
  workdir = str(tmp_path / "run")
  with pytest.raises(train_lib.SamplingStoppedError) as info:
    train_lib.train_and_evaluate(
        _sampling_config(**{"data.num_epochs": 1, "rollout.engine": "continuous"}), workdir)
  msg = str(info.value)
  meta = _saved_meta(workdir, 0)
  kept = len(meta["sampler"]["carried"])
  assert 1 <= kept < 4 and f"{kept}/4 groups gathered" in msg, msg
  assert f"The {kept} group(s) gathered are saved with a checkpoint of step 0" in msg, msg
  assert all(sum(g["acc"]) == 1 for g in meta["sampler"]["carried"])  # the mixed groups only
  assert meta["iterator"]["epoch"] == 1 and _OneMixedGroupPerBatch.closed == [True]


# Calls that unpickle (run code from) a file; checkpoints and weights must never use them.
_UNPICKLERS = {("pickle", "load"), ("pickle", "loads"), ("torch", "load"), ("joblib", "load"),
               ("dill", "load"), ("dill", "loads"), ("cloudpickle", "load"),
               ("cloudpickle", "loads"), ("marshal", "loads"), ("yaml", "load"),
               ("yaml", "unsafe_load"), ("pd", "read_pickle"), ("pandas", "read_pickle")}


def test_nothing_in_the_package_unpickles_a_file():
  for path in glob.glob(os.path.join(ROOT, "dapo_jax", "**", "*.py"), recursive=True):
    for node in ast.walk(ast.parse(open(path).read(), path)):
      if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        continue
      owner = node.func.value
      name = (owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", ""),
              node.func.attr)
      assert name not in _UNPICKLERS, f"{path}:{node.lineno}: {'.'.join(name)}"
      for kw in node.keywords:  # np.load(..., allow_pickle=True)
        assert not (kw.arg == "allow_pickle" and getattr(kw.value, "value", False)), path
