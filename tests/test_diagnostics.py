"""dapo_jax.trainer.diagnostics: every number checked against a case worked out by hand."""

import json
import math
import types

import numpy as np
import pytest

from dapo_jax.infra import metrics
from dapo_jax.trainer import diagnostics as D


def test_distinct_answers_counts_normalised_answers_and_no_answer_once():
  texts = ["2+3 = 5. Answer: 5", "Answer: 5", "Answer: 7", "I give up",  # {5, 7, none}
           "Answer: 1,000", "Answer: 1000", "blah", "blah blah"]  # {1000, none}
  np.testing.assert_array_equal(D.distinct_answers(texts, 4), [3, 2])
  np.testing.assert_array_equal(D.distinct_answers(texts, 8), [4])
  with pytest.raises(ValueError, match="groups of 3"):
    D.distinct_answers(texts, 3)


def test_length_and_pass_rate_buckets():
  np.testing.assert_array_equal(D.length_bucket([1, 8, 9, 16, 17, 24, 25, 32], 32),
                                [0, 0, 1, 1, 2, 2, 3, 3])
  np.testing.assert_array_equal(
      D.pass_rate_bucket([0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1]),
      [0, 1, 1, 2, 2, 3, 3, 4, 5])
  with pytest.raises(ValueError, match="pass rates"):
    D.pass_rate_bucket([1.5])


def _mask(lengths, r=4):
  return np.arange(r)[None, :] < np.asarray(lengths)[:, None]


@pytest.mark.parametrize("mode,expected", [
    ("token-mean", [2 / 6, 4 / 6]),  # each token 1 / (2 + 4)
    ("seq-mean-token-mean", [1 / 2, 1 / 2]),  # each row 1 / rows, whatever its length
    ("seq-mean-token-sum", [2 / 2, 4 / 2]),  # each token 1 / rows
    ("seq-mean-token-sum-norm", [2 / 8, 4 / 8]),  # each token 1 / (rows x R)
])
def test_row_loss_weights_follow_the_aggregation(mode, expected):
  w = D.row_loss_weights(_mask([2, 4]), np.zeros(2, bool), mode, rows_per_update=2)
  np.testing.assert_allclose(w, expected, rtol=1e-6)


def test_row_loss_weights_per_mini_batch_and_overlong_filter():
  mask, trunc = _mask([2, 4]), np.array([False, True])
  # One row per mini-batch: each row is its mini-batch's whole token mean.
  np.testing.assert_allclose(D.row_loss_weights(mask, trunc, "token-mean", 1), [1, 1])
  # The filter masks the truncated row out: the other row takes all the weight.
  np.testing.assert_allclose(D.row_loss_weights(mask, trunc, "token-mean", 2, True), [1, 0])


def test_grad_weight_share():
  adv, lengths = np.array([1.0, -1.0, 0.5, -2.0]), np.array([4, 30, 10, 20])
  acc = np.array([True, False, True, False])
  # token-mean weights are proportional to length: |A| x L = 4, 30, 5, 40 (total 79).
  out = D.grad_weight_share(adv, lengths / lengths.sum(), acc, lengths, 32)
  expected = {"q1_correct": 4 / 79, "q4_wrong": 30 / 79, "q2_correct": 5 / 79,
              "q3_wrong": 40 / 79}
  assert len(out) == 8
  for key, value in out.items():
    assert value == pytest.approx(expected.get(key.split("/")[-1], 0.0)), key
  assert all(v == 0 for v in D.grad_weight_share(0 * adv, lengths, acc, lengths, 32).values())


def test_decode_seconds_split_over_rows_alive_at_each_step():
  # One batch, 3 steps of 4/3 s: step 1 shared by both rows, steps 2-3 by the long one.
  np.testing.assert_allclose(D.attributed_decode_seconds(4.0, np.array([1, 3]), 0),
                             [2 / 3, 2 / 3 + 8 / 3])
  # Two decode batches of 2 rows: 3 + 2 steps share 5 s, 1 s a step.
  lengths = np.array([1, 3, 2, 2])
  np.testing.assert_allclose(D.attributed_decode_seconds(5.0, lengths, 2), [0.5, 2.5, 1, 1])
  out = D.decode_time_by_length([(5.0, lengths), (1.0, np.array([4]))], 4, 2)
  key = "time/decode_by_length/"
  assert out == pytest.approx({key + "q1": 0.5, key + "q2": 2.0, key + "q3": 2.5,
                               key + "q4": 1.0})


def test_pass_rate_histograms_and_acceptance():
  out = D.pass_rate_metrics(generated_pass=np.array([0, 0.5, 0.5, 1, 0.25]),
                            trained_pass=np.array([0.5, 0.25, 0.75]),  # 0.75: carried in
                            generated_trained=np.array([False, True, False, False, True]))
  gen = {"p0": .2, "p0-25": .2, "p25-50": .4, "p50-75": 0, "p75-100": 0, "p100": .2}
  kept = {"p0": 0, "p0-25": 1 / 3, "p25-50": 1 / 3, "p50-75": 1 / 3, "p75-100": 0, "p100": 0}
  acc = {"p0": 0, "p0-25": 1, "p25-50": .5, "p100": 0}
  for b in D.PASS_RATE_BUCKETS:
    assert out[f"diag/pass_rate_generated/{b}"] == pytest.approx(gen[b]), b
    assert out[f"diag/pass_rate_trained/{b}"] == pytest.approx(kept[b]), b
    if b in acc:
      assert out[f"diag/accepted/{b}"] == pytest.approx(acc[b]), b
    else:  # no group generated there: no figure (a NaN would reach TensorBoard as a warning)
      assert f"diag/accepted/{b}" not in out, b
  assert all(np.isfinite(v) for v in out.values())


def _group(answers, acc, lengths):
  return types.SimpleNamespace(texts=[f"Answer: {a}" for a in answers], acc=np.array(acc),
                               lengths=np.array(lengths))


def test_sampling_metrics_through_the_generation_log():
  first = [_group([1, 1], [True, True], [3, 3]), _group([1, 2], [True, False], [1, 4])]
  second = [_group([3, 4], [False, True], [2, 2])]
  log = D.GenerationLog()
  log.record(5.0, first)
  log.record(1.0, second)
  log.record(0.0, [])
  assert [len(c[1]) for c in log.calls] == [4, 2, 0] and len(log.groups) == 3
  out = D.sampling_metrics(log, [first[1], second[0]], max_response_length=4, rows_per_decode=0)
  assert out["diag/distinct_answers_generated"] == pytest.approx(5 / 3)  # 1, 2, 2
  assert out["diag/distinct_answers_trained"] == pytest.approx(2.0)
  assert out["diag/accepted/p100"] == 0 and out["diag/accepted/p25-50"] == 1
  total = sum(out[f"time/decode_by_length/{q}"] for q in D.LENGTH_BUCKETS)
  assert total == pytest.approx(sum(c[0] for c in log.calls))


def test_an_empty_bucket_writes_no_nan_or_null(tmp_path):
  """A step that generated no group (it trains only carried-over ones) and a step that trained
  none: the empty side has no distinct-answers figure, so metrics.jsonl gets no null and
  TensorBoard no point for it."""
  carried = [_group([1, 2], [True, False], [2, 3])]
  generated = D.GenerationLog()
  generated.record(1.0, [_group([3, 3], [True, True], [1, 1])])
  steps = {1: D.sampling_metrics(D.GenerationLog(), carried, max_response_length=4,
                                 rows_per_decode=0),
           2: D.sampling_metrics(generated, [], max_response_length=4, rows_per_decode=0)}
  assert "diag/distinct_answers_generated" not in steps[1]
  assert steps[1]["diag/distinct_answers_trained"] == 2.0
  assert "diag/distinct_answers_trained" not in steps[2]
  assert steps[2]["diag/distinct_answers_generated"] == 1.0
  writer = metrics.MetricsWriter(str(tmp_path), active=True)
  tb_points = []
  add_scalar = writer._tb.add_scalar  # pylint: disable=protected-access
  def record(tag, value, step):
    tb_points.append((tag, value))
    add_scalar(tag, value, step)
  writer._tb.add_scalar = record  # pylint: disable=protected-access
  for step, scalars in steps.items():
    writer.write_scalars(step, scalars)
  writer.close()
  rows = [json.loads(line) for line in (tmp_path / metrics.METRICS_FILE).read_text().splitlines()]
  assert [r["step"] for r in rows] == [1, 2]
  for row in rows:
    assert all(v is not None and math.isfinite(v) for v in row.values()), row
  assert tb_points and all(math.isfinite(v) for _, v in tb_points)
  assert {t for t, _ in tb_points if t.startswith("diag/distinct")} == {
      "diag/distinct_answers_trained", "diag/distinct_answers_generated"}
