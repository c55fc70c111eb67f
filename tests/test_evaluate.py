"""Evaluation: scripted answers give hand-computed avg@k / pass@k / maj@k; the CLI runs."""

import json
import types

import numpy as np
import pytest

from dapo_jax import config as config_lib
from dapo_jax.trainer import evaluate
from dapo_jax.data import arithmetic
from dapo_jax.rewards.batch import RewardScorer
from dapo_jax.spec.run_spec import RunSpec
from dapo_jax.tokenizers import CharTokenizer


def _scripted_rollout(tokenizer, answers_per_prompt, width=16):
  """A rollout that answers prompt i (in call order) with the scripted strings."""
  calls = {"n": 0}

  def rollout(params, ids, mask, key, sampling, n):
    del params, mask, key, sampling
    rows, lengths = [], []
    for b in range(ids.shape[0]):
      script = answers_per_prompt[min(calls["n"] + b, len(answers_per_prompt) - 1)]
      for j in range(n):
        toks = tokenizer.encode(script[j]) + [tokenizer.eos_id]
        rows.append(toks + [tokenizer.pad_id] * (width - len(toks)))
        lengths.append(len(toks))
    calls["n"] += ids.shape[0]
    resp = np.asarray(rows, np.int32)
    return types.SimpleNamespace(response_ids=resp, lengths=np.asarray(lengths, np.int32),
                                 response_mask=resp != tokenizer.pad_id,
                                 logprobs=np.zeros(resp.shape, np.float32),
                                 truncated=np.zeros(len(rows), bool))

  return rollout


def test_evaluator_matches_hand_computed_metrics():
  tok = CharTokenizer()
  records = arithmetic.make_records(3, split="test", seed=0)
  gts = [r.ground_truth for r in records]
  wrong = lambda gt: f"Answer: {int(gt) + 1}"
  right = lambda gt: f"Answer: {gt}"
  # Problem 0: 4/4 right; problem 1: 1/4 right; problem 2: 0/4 right (same wrong answer).
  script = [[right(gts[0])] * 4,
            [wrong(gts[1]), right(gts[1]), wrong(gts[1]), wrong(gts[1])],
            [wrong(gts[2])] * 4]
  c = config_lib.default_config()
  c.eval.update(num_samples=4, batch_size=2, max_examples=0)
  c.data.max_prompt_length = 16
  c.rollout.max_response_length = 16
  with RewardScorer("strict", max_response_length=16, overlong_buffer_enable=False) as scorer:
    ev = evaluate.Evaluator(RunSpec.read(c), _scripted_rollout(tok, script), tok, scorer,
                            records)
    out = ev(params_state=None)
  assert out["eval/num_problems"] == 3 and out["eval/num_samples"] == 12
  assert out["eval/avg@4"] == pytest.approx((1 + 0.25 + 0) / 3)
  assert out["eval/pass@1"] == pytest.approx((1 + 0.25 + 0) / 3)
  # pass@2 for 1 of 4 correct: 1 - C(3,2)/C(4,2) = 0.5
  assert out["eval/pass@2"] == pytest.approx((1 + 0.5 + 0) / 3)
  assert out["eval/pass@4"] == pytest.approx(2 / 3)
  assert out["eval/maj@4"] == pytest.approx(1 / 3)  # only problem 0's majority is right
  assert [r["correct"] for r in ev.last_rows] == [4, 1, 0]


def test_dapo_eval_cli_on_hf_checkpoint(tmp_path, capsys):
  pytest.importorskip("torch")
  from tests import hf_fixtures  # pylint: disable=g-import-not-at-top
  ckpt = hf_fixtures.write_tiny_qwen2(str(tmp_path / "ckpt"), vocab_size=64)
  CharTokenizer().save(ckpt)  # the fixture model speaks the char vocabulary
  data = tmp_path / "eval.jsonl"
  from dapo_jax.data.loaders import write_rows  # pylint: disable=g-import-not-at-top
  write_rows(arithmetic.make_rows(5, split="test"), str(data))
  out = tmp_path / "table.json"
  summary = evaluate.main([f"--config.model.checkpoint={ckpt}", f"--config.data.eval={data}",
                           "--config.eval.num_samples=2", "--config.rollout.max_response_length=8",
                           "--config.eval.batch_size=4", "--config.data.max_prompt_length=32",
                           "--output", str(out)])
  assert summary["eval/num_problems"] == 5 and summary["eval/num_samples"] == 10
  assert 0.0 <= summary["eval/avg@2"] <= summary["eval/pass@2"] <= 1.0
  table = json.load(open(out))
  assert len(table["problems"]) == 5
  # Issue 27 (8): the summary and the file name what was evaluated (the 8 CPU devices of
  # conftest under the default mesh, fp32 weights).
  assert table["provenance"] == {
      "workdir": None, "step": None, "checkpoint": ckpt, "dataset": str(data), "num_samples": 2,
      "dtype": "float32", "param_dtype": "float32", "mesh": "data=1,fsdp=8,tensor=1",
      "num_devices": 8}
  assert (f"dapo-eval: HF checkpoint {ckpt}; dataset {data} (2 samples per row); dtype float32 "
          "(params float32); mesh data=1,fsdp=8,tensor=1 (8 devices)") in capsys.readouterr().out


def test_dapo_eval_cli_expands_home_and_names_missing_weights(tmp_path, monkeypatch):
  monkeypatch.setenv("HOME", str(tmp_path))
  fv = evaluate._parse(["--config.model.checkpoint=~/ckpt", "--config.data.eval=~/x.jsonl",
                        "--config.model.dtype=bfloat16", "--config.mesh=data=2,tensor=4"])
  c = fv.config
  assert c.model.checkpoint == str(tmp_path / "ckpt") and c.data.eval == str(tmp_path / "x.jsonl")
  assert c.model.dtype == "bfloat16" and c.model.param_dtype == "float32"
  assert list(c.mesh) == [("data", 2), ("tensor", 4)]
  with pytest.raises(ValueError, match="config.model.checkpoint"):
    evaluate.main(["--config.eval.max_examples=1"])
  with pytest.raises(FileNotFoundError, match="dapo-train workdir"):
    evaluate.main([f"--workdir={tmp_path}"])


def _constant_rollout(tokenizer, text):
  """Every response is ``text``: which key the summary holds does not depend on the answers."""
  toks = tokenizer.encode(text) + [tokenizer.eos_id]

  def rollout(params, ids, mask, key, sampling, n):
    del params, mask, key, sampling
    resp = np.tile(np.asarray(toks, np.int32), (ids.shape[0] * n, 1))
    return types.SimpleNamespace(response_ids=resp, response_mask=np.ones(resp.shape, bool),
                                 lengths=np.full(len(resp), len(toks), np.int32),
                                 logprobs=np.zeros(resp.shape, np.float32),
                                 truncated=np.zeros(len(resp), bool))

  return rollout


def dapo_rows_answer(i: int) -> str:
  from tests import dapo_rows  # pylint: disable=g-import-not-at-top
  return dapo_rows.PROBLEMS[i][1]


def _eval_rows(source, tmp_path):
  from dapo_jax.data.loaders import load_records  # pylint: disable=g-import-not-at-top
  from tests import dapo_rows  # pylint: disable=g-import-not-at-top
  if source == "aime":
    path = dapo_rows.find_shared_aime()
    if path is None:
      pytest.skip("shared/data/aime-2024.parquet not present beside the checkout")
  elif source == "three_copies":  # as the AIME file (30 x 32), without needing it: 5 x 3
    path = dapo_rows.write_parquet(
        [dapo_rows.dapo_row(*p) for _ in range(3) for p in dapo_rows.PROBLEMS],
        tmp_path / "three_copies.parquet")
  elif source == "duplicated":  # 5 problems with 1 to 3 copies each, out of order
    path = dapo_rows.write_duplicated(tmp_path / "dup.parquet")
  else:
    path = dapo_rows.write_parquet([dapo_rows.dapo_row(*p) for p in dapo_rows.PROBLEMS],
                                   tmp_path / "unique.parquet")
  return load_records(str(path), on_malformed="raise", dedup=False)[0]


@pytest.mark.parametrize("source,num_samples,expected_k", [
    ("aime", 1, 32),  # the 32B config: 30 problems x 32 copies, one sample per row
    ("aime", 2, 64), ("three_copies", 1, 3), ("three_copies", 2, 6), ("duplicated", 1, 1),
    ("duplicated", 3, 3), ("unique", 4, 4)])
def test_headline_is_a_key_of_the_summary(source, num_samples, expected_k, tmp_path, caplog):
  """Issue 17 D1: the headline (progress bar, "Held-out" line) names the summary's avg@K for
  every number of copies in the file x eval.num_samples."""
  import logging  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top
  from configs import dapo_qwen2_5_32b  # pylint: disable=g-import-not-at-top
  from dapo_jax.infra import console_log  # pylint: disable=g-import-not-at-top
  from dapo_jax.trainer import train
  from dapo_jax.tokenizers import load_tokenizer  # pylint: disable=g-import-not-at-top
  records = _eval_rows(source, tmp_path)
  c = dapo_qwen2_5_32b.get_config()
  c.eval.num_samples = num_samples
  c.rollout.max_response_length = 16
  tok = load_tokenizer(None, fallback="qwen2.5")
  answer = "204" if source == "aime" else dapo_rows_answer(2)  # one problem right
  with RewardScorer("strict", max_response_length=16, overlong_buffer_enable=False) as scorer:
    ev = evaluate.Evaluator(RunSpec.read(c), _constant_rollout(tok, f"Answer: {answer}"), tok,
                            scorer, records)
    out = ev(params_state=None)
  assert ev.headline == f"eval/avg@{expected_k}"
  assert ev.headline in out
  # The headline's value is the share of problems answered right (every sample answers alike).
  problems = {evaluate.problem_id(r): r.ground_truth for r in records}
  assert out["eval/num_problems"] == len(problems) == (30 if source == "aime" else 5)
  right = sum(gt == answer for gt in problems.values())
  assert right > 0 and out[ev.headline] == pytest.approx(right / len(problems))
  line = console_log.format_line(5, 10, out, ev.headline)
  assert f"{ev.headline} {out[ev.headline]:.3f}" in line
  with caplog.at_level(logging.INFO, logger=train.__name__):
    train._log_held_out(c.num_steps, pathlib.Path(tmp_path), ev.headline, [out, out])  # pylint: disable=protected-access
  assert f"Held-out {ev.headline}" in caplog.text
