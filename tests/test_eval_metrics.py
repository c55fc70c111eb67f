"""pass@k, avg@k, maj@k and the per-problem summary against hand-computed values."""

import pytest

from dapo_jax.trainer import eval_metrics as E


@pytest.mark.parametrize("c,k,want", [
    (0, 1, 0.0), (0, 8, 0.0), (0, 32, 0.0),
    (1, 1, 1 / 32), (1, 8, 8 / 32), (1, 32, 1.0),  # One correct: pass@k = k/n.
    (16, 1, 0.5),
    (16, 8, 1 - 12870 / 10518300),  # 1 - C(16,8)/C(32,8).
    (16, 16, 1 - 1 / 601080390),  # 1 - 1/C(32,16).
    (16, 32, 1.0),
    (32, 1, 1.0), (32, 8, 1.0), (32, 32, 1.0),
])
def test_pass_at_k_n32(c, k, want):
  assert E.pass_at_k(32, c, k) == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_pass_at_k_large_n_is_finite_and_errors():
  # Factorials of 1024 overflow float64; the product form does not.
  assert E.pass_at_k(1024, 512, 1) == pytest.approx(0.5)
  assert E.pass_at_k(1024, 1, 10) == pytest.approx(10 / 1024)
  with pytest.raises(ValueError, match="impossible"):
    E.pass_at_k(4, 5, 1)
  with pytest.raises(ValueError, match="1 <= k <= n=4"):
    E.pass_at_k(4, 1, 5)


def test_avg_at_k():
  accs = [1, 0, 1, 1, 0, 0, 0, 0]
  assert E.avg_at_k(accs) == 3 / 8
  assert E.avg_at_k(accs, 4) == 3 / 4
  assert E.avg_at_k(accs, 1) == 1.0
  assert E.avg_at_k([True, False]) == 0.5
  with pytest.raises(ValueError, match="not a reward"):
    E.avg_at_k([1, -1, 1])


def test_maj_at_k_ties_and_abstentions():
  preds = ["5", "7", "7", "5", "", None, "9"]
  accs = [0, 1, 1, 0, 0, 0, 0]
  assert E.maj_at_k(preds, accs) == 0.0  # "5" and "7" tie at 2: "5" came first.
  assert E.majority_vote(preds) == 0
  assert E.maj_at_k(preds, accs, 3) == 1.0  # "7" leads among the first three.
  assert E.maj_at_k(preds, accs, 1) == 0.0
  # The same tie in the other order: the first-seen answer still wins.
  assert E.maj_at_k(["7", "5", "5", "7"], [1, 0, 0, 1]) == 1.0
  assert E.maj_at_k(["9", "3", "3"], [1, 0, 0]) == 0.0  # A clear majority beats first place.
  assert E.maj_at_k([None, ""], [0, 0]) == 0.0
  assert E.majority_vote([None, ""]) is None
  with pytest.raises(ValueError, match="2 predictions but 3"):
    E.maj_at_k(["a", "b"], [0, 1, 1])


def test_summarize_and_rows():
  samples = {"a": (["1", "1", "2", "3"], [1, 1, 0, 0]),
             "b": (["x", "y", "y", None], [0, 1, 1, 0]),
             "c": ([None] * 4, [0] * 4)}
  # Interleaved, as results come back from a batched sampler.
  results = [(pid, samples[pid][0][i], samples[pid][1][i]) for i in range(4) for pid in "abc"]
  summary, rows = E.summarize(results)
  assert summary == pytest.approx({
      "num_problems": 3.0, "num_samples": 12.0, "avg@4": 1 / 3,
      "pass@1": 1 / 3, "pass@2": (5 / 6 + 5 / 6) / 3, "pass@4": 2 / 3,  # 1 - C(2,2)/C(4,2) = 5/6.
      "maj@1": 1 / 3, "maj@2": 1 / 3, "maj@4": 2 / 3})
  assert [r["problem_id"] for r in rows] == ["a", "b", "c"]
  assert rows[1] == pytest.approx({"problem_id": "b", "n": 4, "correct": 2, "acc": 0.5,
                                   "pass@1": 0.5, "pass@2": 5 / 6, "pass@4": 1.0,
                                   "maj@1": 0.0, "maj@2": 0.0, "maj@4": 1.0,
                                   "majority_answer": "y"})
  assert rows[0]["majority_answer"] == "1" and rows[2]["majority_answer"] is None
  summary, _ = E.summarize(results, ks=[2])
  assert set(summary) == {"num_problems", "num_samples", "avg@2", "pass@2", "maj@2"}
  assert summary["avg@2"] == pytest.approx((1 + 0.5 + 0) / 3)


def test_summarize_errors():
  with pytest.raises(ValueError, match=r"k=4 exceeds the 2 samples of problem\(s\) \['q'\]"):
    E.summarize([("p", "1", 1)] * 4 + [("q", "1", 1)] * 2, ks=[4])
  with pytest.raises(ValueError, match="acc of problem 'p'"):
    E.summarize([("p", "1", 0.5)])
  with pytest.raises(ValueError, match="No results"):
    E.summarize([])
  assert E.default_ks(32) == [1, 2, 4, 8, 16, 32]
  assert E.default_ks(12) == [1, 2, 4, 8, 12]


def test_format_table():
  rows = [{"problem_id": "aime-2024-1", "pred": "a very long answer " * 3, "pass@8": 0.123456},
          {"problem_id": 7, "pred": None, "pass@8": 1.0}]
  text = E.format_table(rows, max_width=12)
  lines = text.splitlines()
  assert lines[0].split() == ["problem_id", "pred", "pass@8"]
  assert set(lines[1]) == {"-", " "}
  assert "0.123" in lines[2] and "1.000" in lines[3] and "0.1234" not in text
  assert "a very long~" in lines[2] and "answer a" not in text
  # Numbers are right-aligned, so the last column ends in the same place on every line.
  assert len({len(line) for line in lines}) == 1
  assert lines[3].index("7") == lines[2].index("aime-2024-1")  # Ids left-aligned.
  assert E.format_table([]) == "(no rows)"
