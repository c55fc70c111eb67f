"""Symbolic verifier (docs/algorithm.md section 2): math-verify equivalence, hard time bounds."""
import os
import time

import pytest

from dapo_jax.rewards import deadline_pool
from dapo_jax.rewards import symbolic
from dapo_jax.rewards.math_dapo import compute_score

TIMEOUT_S = 1.0
# Slack for start-up jitter on a shared 2-core machine; a hang would blow far past it.
MARGIN_S = 2.0
# Benign items get a generous bound so a busy CI machine cannot turn them into timeouts.
SLOW_OK_S = 10.0


@pytest.fixture(scope="module")
def verifier():
  with symbolic.SymbolicVerifier(num_workers=2, timeout_s=TIMEOUT_S) as v:
    yield v


# Pairs the strict verifier gets wrong but that are mathematically equal.
EQUIVALENT = [
    ("Answer: 0.5", "\\frac{1}{2}"),
    ("Answer: \\sqrt{8}", "2\\sqrt{2}"),
    ("Answer: \\dfrac{1}{2}", "0.5"),
    ("Answer: 3/4", "\\frac34"),
    ("Answer: [0.5, 5)", "[\\frac12,5)"),
    ("Answer: $(-\\infty, 3]$", "(-\\infty,\\sqrt{9}]"),
    ("Answer: $(-\\infty, 3]$", "x \\le 3"),
    ("Answer: $\\{2, 1\\}$", "\\{1,2\\}"),
    ("Answer: x^2+2x+1", "(x+1)^2"),
    ("Answer: \\frac{\\pi}{2}", "\\pi/2"),
    ("Answer: 11.", "11"),
    ("so the answer is \\boxed{\\frac{3}{4}}.", "0.75"),
    ("we get \\boxed{\\sqrt{\\frac{1}{4}}} and stop", "\\frac{1}{2}"),
]

NOT_EQUIVALENT = [
    ("Answer: 0.51", "\\frac{1}{2}"),
    ("Answer: \\sqrt{7}", "2\\sqrt{2}"),
    ("Answer: (2, 5]", "[2,5)"),
    ("Answer: 2x", "x"),
    ("Answer: 12", "11"),
    # The Answer line takes precedence over a \boxed{} elsewhere.
    ("\\boxed{11}\nAnswer: 12", "11"),
    # No anchor and no box: invalid, like the strict verifier.
    ("the result is eleven", "11"),
]


def test_strict_misses_the_equivalent_cases():
  # Guards the table: these must be cases where symbolic adds something.
  assert not any(compute_score(s, gt)["acc"] for s, gt in EQUIVALENT)


def test_equivalent_answers_are_right(verifier):
  results = verifier.score_many(*zip(*EQUIVALENT), timeout_s=SLOW_OK_S)
  for (solution, gt), (out, outcome) in zip(EQUIVALENT, results):
    assert outcome.status == "ok", (solution, outcome)
    assert out["acc"] is True and out["score"] == 1.0, (solution, gt, out)


def test_non_equivalent_answers_stay_wrong(verifier):
  results = verifier.score_many(*zip(*NOT_EQUIVALENT), timeout_s=SLOW_OK_S)
  for (solution, gt), (out, _) in zip(NOT_EQUIVALENT, results):
    assert out["acc"] is False and out["score"] == -1.0, (solution, gt, out)
  assert results[-1][0]["pred"] == "[INVALID]"
  assert results[-2][0]["pred"] == "12"


def test_strict_right_is_symbolic_right(verifier):
  cases = [("Answer: x = 5", "5"), ("Answer: 11 degrees", "11"), ("answer : 1,000", "1000"),
           ("Answer: \\frac12", "\\frac{1}{2}"), ("Answer: \\boxed{11}", "11"),
           # math-verify alone rejects this one (a set of two equations vs 4).
           ("Answer: x = 3, y = 4", "4")]
  results = verifier.score_many(*zip(*cases), timeout_s=SLOW_OK_S)
  for (solution, gt), (out, _) in zip(cases, results):
    assert out == compute_score(solution, gt), solution


@pytest.mark.parametrize("text,content", [
    ("a \\boxed{1} b \\boxed{2}", "2"),
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),
    ("\\boxed{7} then \\boxed{\\frac{1}", "7"),  # last box unbalanced: previous one
    ("no box", None),
])
def test_last_boxed_content(text, content):
  assert symbolic.last_boxed_content(text) == content


def test_extract_answer_prefers_answer_line_and_reads_only_the_tail():
  assert symbolic.extract_answer("\\boxed{3}\nAnswer: $4$") == "$4$"
  assert symbolic.extract_answer("\\boxed{3}" + "z" * 300) is None
  assert symbolic.extract_answer("Answer:   \n") is None


HOSTILE = {
    # Tower of powers: SymPy tries to evaluate it.
    "power_tower": "Answer: 9^{9^{9^{9^9}}}",
    # 140 nested braces fit in the tail and take seconds to parse.
    "nested_in_tail": "Answer: $" + "{" * 140 + "1" + "}" * 140 + "$",
    # Too big for the tail: must be cut before anything parses it.
    "megabyte_line": "Answer: " + "9^" * 500_000 + "9",
    "nested_5000": "Answer: $" + "{" * 5000 + "1" + "}" * 5000 + "$",
    "plain_power_tower": "Answer: 9^9^9^9^9",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_input_is_bounded_and_wrong(verifier, name):
  start = time.monotonic()
  (out, outcome), = verifier.score_many([HOSTILE[name]], ["5"])
  elapsed = time.monotonic() - start
  assert elapsed < TIMEOUT_S + MARGIN_S, f"{name} took {elapsed:.1f} s"
  assert out["acc"] is False and out["score"] == -1.0
  if outcome.status == "timeout":
    assert out["pred"] == symbolic.TIMEOUT_PRED


def test_hostile_items_time_out_and_the_pool_keeps_working(verifier):
  solutions = [HOSTILE["power_tower"], "Answer: 0.5", HOSTILE["nested_in_tail"], "Answer: 1/3"]
  results = verifier.score_many(solutions, ["5", "1/2", "1", "\\frac{1}{3}"])
  assert [o.status for _, o in results] == ["timeout", "ok", "timeout", "ok"]
  assert [r["acc"] for r, _ in results] == [False, True, False, True]
  assert verifier.score("Answer: 0.25", "\\frac14")["acc"] is True


def test_pool_kills_a_worker_stuck_in_c_code():
  # sum() over a range runs entirely in C and never checks signals: only SIGKILL stops it.
  with deadline_pool.DeadlinePool(1, kill_grace_s=0.1) as pool:
    pool.map(abs, [(1,)], timeout_s=5.0)  # wait until the worker is up
    (stuck_pid,) = pool.pids
    start = time.monotonic()
    out = pool.map(sum, [(range(10**15),), ([2, 1000, 22],)], timeout_s=0.5)
    elapsed = time.monotonic() - start
    assert [o.status for o in out] == ["timeout", "ok"]
    assert out[1].value == 1024
    assert pool.num_killed == 1 and pool.pids != [stuck_pid]
    with pytest.raises(ProcessLookupError):  # gone, not left running in the background
      os.kill(stuck_pid, 0)
    assert elapsed < 0.6 + MARGIN_S + 1.0  # one deadline plus a respawn


def test_pool_soft_timeout_keeps_the_worker():
  # time.sleep is interrupted by the in-worker SIGALRM, so no kill or respawn is needed.
  with deadline_pool.DeadlinePool(1, kill_grace_s=5.0) as pool:
    out = pool.map(time.sleep, [(30,), (0,)], timeout_s=0.3)
    assert [o.status for o in out] == ["timeout", "ok"]
    assert pool.num_killed == 0


def _allocate(num_bytes: int) -> int:
  # Module-level so the worker can unpickle it; returns a small value either way.
  return len(bytearray(num_bytes))


def test_pool_reports_errors_deaths_and_memory_limit():
  with deadline_pool.DeadlinePool(1, memory_limit_mb=1024) as pool:
    out = pool.map(int, [("x",), ("7",)], timeout_s=5.0)
    assert [(o.status, o.value) for o in out] == [("error", None), ("ok", 7)]
    assert out[0].error == "ValueError"
    out = pool.map(_allocate, [(2 * 2**30,), (2**20,)], timeout_s=5.0)
    assert out[0].status == "error" and out[0].error == "MemoryError"
    assert out[1].value == 2**20
    out = pool.map(os._exit, [(3,)], timeout_s=5.0)  # pylint: disable=protected-access
    assert out[0].status == "error"
    assert pool.map(abs, [(-2,)], timeout_s=5.0)[0].value == 2


def test_compute_score_symbolic_function():
  out = symbolic.compute_score_symbolic("Answer: 0.5", "\\frac{1}{2}", timeout_s=5.0)
  assert out == {"score": 1.0, "acc": True, "pred": "0.5"}
  assert symbolic.compute_score_symbolic("Answer: 3", "4")["acc"] is False


def test_bad_arguments():
  with pytest.raises(ValueError, match="timeout_s"):
    symbolic.SymbolicVerifier(num_workers=1, timeout_s=0)
  with pytest.raises(ValueError, match="num_workers"):
    deadline_pool.DeadlinePool(0)
