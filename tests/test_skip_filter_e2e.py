"""The skip filter end to end (issue 39): a DAPO-schema parquet whose problems repeat, through
train_and_evaluate on the continuous and static engines, the streaming and batch loops, carried
groups and the overlapped rollout; a resumed run keeps its history."""

import dataclasses
import os
import shutil

import numpy as np
import orbax.checkpoint as ocp
import pytest

from dapo_jax.rewards.batch import RewardScorer
from dapo_jax.trainer import run_setup
from dapo_jax.trainer import skip_filter as sf
from dapo_jax.trainer.train import train_and_evaluate
from tests import dapo_rows
from tests.test_train_e2e import _metric_rows, _params, _small_config

# 8 problems in the char tokenizer's alphabet, 6 copies each, shuffled (as DAPO-Math-17k repeats
# each problem ~100 times). Answers 1-3: every response right; 4-5: every response wrong.
PROBLEMS = [(f"What is {i}+0?", str(i), f"uuid-{i:04d}") for i in range(1, 9)]
ALL_RIGHT, ALL_WRONG = {"1", "2", "3"}, {"4", "5"}


def _write(path):
  order = np.random.default_rng(0).permutation(np.repeat(np.arange(len(PROBLEMS)), 6))
  rows = []
  for i in order:
    row = dapo_rows.dapo_row(*PROBLEMS[i])
    row["prompt"][0]["content"] = PROBLEMS[i][0]  # the spec template's quotes are not chars
    rows.append(row)
  return str(dapo_rows.write_parquet(rows, path))


class _ByProblem(RewardScorer):
  """Correctness by problem: all right, all wrong, or the first response of each group of 4."""

  def __call__(self, responses, ground_truths, response_lengths, timeout_s=None):
    out = super().__call__(responses, ground_truths, response_lengths, timeout_s)
    gts = np.asarray(ground_truths)
    acc = (np.arange(len(gts)) % 4 == 0) | np.isin(gts, list(ALL_RIGHT))
    acc &= ~np.isin(gts, list(ALL_WRONG))
    score = np.where(acc, 1.0, -1.0).astype(out.score.dtype)
    return dataclasses.replace(out, acc=acc, score=score, reward=score + out.overlong_penalty)


def _config(data, **over):
  base = {"data.train": data, "data.eval": "", "algorithm.dynamic_sampling": True,
          "algorithm.skip_filter": True, "algorithm.skip_adapt_rate": 0.3,
          "algorithm.keep_surplus": True, "algorithm.gen_batch_size": 4,
          "optim.train_batch_size": 4, "num_steps": 4, "checkpoint.save_every": 2,
          "checkpoint.max_to_keep": 3}
  return _small_config(**{**base, **over})


def _skips(rows):
  return sum(r["skip/skipped_right"] + r["skip/skipped_wrong"] for r in rows.values())


def test_resumed_run_keeps_its_history(tmp_path, monkeypatch):
  """Continuous engine, streaming loop, carried groups: the run relaunched from its step-2
  checkpoint (as after a kill: the newer checkpoint removed) ends equal to the uninterrupted
  run, skips included; the checkpoint holds one history entry per problem, not per copy."""
  monkeypatch.setattr(run_setup, "RewardScorer", _ByProblem)
  data = _write(tmp_path / "repeats.parquet")
  cfg = lambda: _config(data, **{"rollout.engine": "continuous"})
  full, part = str(tmp_path / "full"), str(tmp_path / "part")
  train_and_evaluate(cfg(), full)
  rows = _metric_rows(full)
  assert _skips(rows) > 0 and min(r["skip/explore_right"] for r in rows.values()) < 1.0
  shutil.copytree(full, part)
  shutil.rmtree(os.path.join(part, "checkpoints", "4"))
  meta = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(
      os.path.join(part, "checkpoints", "2", "meta"))
  history = meta["sampler"]["prefilter"]["history"]
  assert len(history) == len(PROBLEMS)  # keyed by content: 6 copies share one entry
  assert all(len(h) <= sf.HISTORY_PER_PROMPT for _, h in history)
  train_and_evaluate(cfg(), part)
  assert _metric_rows(part) == rows
  for x, y in zip(_params(full, 4), _params(part, 4)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("over", [
    {"rollout.engine": "static", "algorithm.sampling_loop": "batch",
     "rollout.prompts_per_call": 2},
    {"rollout.engine": "static", "algorithm.sampling_loop": "stream",
     "rollout.prompts_per_call": 2},
    {"rollout.engine": "continuous", "algorithm.max_staleness": 1,
     "algorithm.rollout_is": "token_truncated"},
], ids=["static_batch", "static_stream", "overlap"])
@pytest.mark.slow
def test_skips_on_every_engine_and_loop(tmp_path, monkeypatch, over):
  monkeypatch.setattr(run_setup, "RewardScorer", _ByProblem)
  workdir = str(tmp_path / "run")
  train_and_evaluate(_config(_write(tmp_path / "repeats.parquet"), **over), workdir)
  rows = _metric_rows(workdir)
  assert sorted(rows) == list(range(1, 5))
  assert _skips(rows) > 0
  for r in rows.values():  # every drawn prompt is skipped, admitted, or (streaming) never needed
    rolled = r["skip/prompts_drawn"] - r["skip/skipped_right"] - r["skip/skipped_wrong"]
    # A generation batch: 4 prompts not skipped, from as many batches of 4 as it takes.
    assert r["skip/prompts_drawn"] % 4 == 0 and rolled >= 4 * r["sampling/num_gen_batches"]
    if over.get("algorithm.sampling_loop") == "batch":
      assert r["sampling/prompts_admitted"] == rolled
    else:
      assert r["sampling/prompts_admitted"] <= rolled
