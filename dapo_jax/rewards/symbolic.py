"""Symbolic math verifier (docs/algorithm.md section 2: the option next to the strict default).

Equivalence is decided by the `math-verify` library (LaTeX -> SymPy, then numeric / symbolic /
set / interval comparison), so `0.5`, `\\frac{1}{2}` and `1/2` agree, as do `\\sqrt{8}` and
`2\\sqrt{2}`. Nothing here parses LaTeX by hand or evaluates model text itself.

Safety, because the text comes from a policy being optimised against this very function:
  * only the last `tail_chars` characters are read (same tail as the strict verifier), so at
    most a few hundred characters ever reach SymPy;
  * SymPy runs only in `DeadlinePool` worker processes that are killed at the deadline;
    math-verify's own SIGALRM timeouts are switched off (they only work on a main thread and
    cannot interrupt C code), the pool provides both the soft and the hard bound;
  * each worker's address space is capped (`DEFAULT_MEMORY_LIMIT_MB`), so `2^{2^{40}}` ends
    in a MemoryError (or a dead worker, replaced) instead of swapping the host;
  * model text only takes math-verify's LaTeX path (an ANTLR grammar that builds SymPy objects
    directly). What reaches SymPy's eval-based `parse_expr` from it is the text of the
    grammar's NUMBER tokens (digits, `.` and `,`), through `sympy.Number`;
    tests/test_verifier_fuzz.py records every string that reaches it.

Scoring order: the strict verifier first (cheap; a strict match is always accepted, so the
symbolic verifier accepts a superset), then the extracted answer goes to a worker.
"""
import atexit
import functools
import logging
import os
import threading
from collections.abc import Sequence

from dapo_jax.rewards import math_dapo
from dapo_jax.rewards.deadline_pool import DeadlinePool, Outcome

TIMEOUT_PRED = "[TIMEOUT]"
ERROR_PRED = "[ERROR]"
# A worker with SymPy and math-verify loaded maps about 200 MB.
DEFAULT_MEMORY_LIMIT_MB = 1024
# Modules each worker imports before it reports ready, so no item pays for the import.
WORKER_PRELOAD = ("dapo_jax.rewards.symbolic", "math_verify")

_MATH_DELIMITERS = ("$", "\\(", "\\[", "\\boxed")


def last_boxed_content(text: str) -> str | None:
  """Contents of the last balanced `\\boxed{...}` in text, or None (linear scan, no regex)."""
  start = text.rfind("\\boxed{")
  while start != -1:
    depth = 0
    begin = start + len("\\boxed{")
    for j in range(begin - 1, len(text)):
      if text[j] == "{":
        depth += 1
      elif text[j] == "}":
        depth -= 1
        if depth == 0:
          return text[begin:j]
    # Unbalanced (cut off by the tail or by truncation): try the previous one.
    start = text.rfind("\\boxed{", 0, start)
  return None


def extract_answer(solution_str: str, tail_chars: int = math_dapo.TAIL_CHARS) -> str | None:
  """The last `Answer:` line in the tail, else the last `\\boxed{}` in the tail, else None (the
  tail of `math_dapo.answer_region`: after a thinking block)."""
  tail = math_dapo.answer_region(solution_str)[-tail_chars:]
  answer = math_dapo.extract_answer_line(tail, tail_chars)
  if answer is None:
    answer = last_boxed_content(tail)
  if answer is None or not answer.strip():
    return None
  return answer.strip()


def _as_latex(text: str) -> str:
  # A sentence's full stop ("Answer: 11.") is not part of the answer; inside $...$ it would
  # make the LaTeX parser reject "11.".
  text = text.strip()
  if text.endswith(".") and not text.endswith("\\."):
    text = text[:-1]
  # math-verify looks for LaTeX inside math delimiters; a bare `\frac12` or `[2, 5)` is only
  # read as LaTeX once wrapped.
  if any(d in text for d in _MATH_DELIMITERS):
    return text
  return f"${text}$"


@functools.lru_cache(maxsize=4096)
def _parse_gold(ground_truth: str):
  # Ground truths repeat n times per prompt (spec 5: n = 16), so each worker caches them.
  from math_verify import parse  # pylint: disable=g-import-not-at-top
  return parse(_as_latex(ground_truth), parsing_timeout=None)


def symbolic_equal(answer: str, ground_truth: str) -> bool:
  """True iff math-verify finds `answer` equivalent to `ground_truth`. UNBOUNDED in time.

  Runs in a worker process of `SymbolicVerifier`; call it directly only on trusted text.
  """
  # pylint: disable-next=g-import-not-at-top
  from math_verify import LatexExtractionConfig, parse, verify
  # Timeouts off: the pool bounds this call (math-verify's alarms would reset the pool's).
  logging.getLogger("math_verify").setLevel(logging.ERROR)
  gold = _parse_gold(ground_truth)
  # LaTeX extraction only for model text: math-verify's plain-expression path goes through
  # SymPy's eval-based parse_expr, the LaTeX path through a grammar parser.
  pred = parse(_as_latex(answer), extraction_config=[LatexExtractionConfig()],
               parsing_timeout=None)
  if not gold or not pred:
    return False
  return bool(verify(gold, pred, timeout_seconds=None))


def _warm_up() -> None:
  # Touches the LaTeX parser, simplification and interval code once per worker.
  symbolic_equal("x^2+2x+1", "(x+1)^2")
  symbolic_equal("[0.5, 5)", "[\\frac12,5)")


def _wrong(pred: str) -> math_dapo.ScoreDict:
  return {"score": -1.0, "acc": False, "pred": pred}


def _right(pred: str) -> math_dapo.ScoreDict:
  return {"score": 1.0, "acc": True, "pred": pred}


def default_num_workers() -> int:
  try:
    cpus = len(os.sched_getaffinity(0))
  except AttributeError:  # macOS
    cpus = os.cpu_count() or 1
  return max(1, min(16, cpus))


class SymbolicVerifier:
  """Time-bounded symbolic scoring with a persistent worker pool (create once, reuse).

  Example:
    with SymbolicVerifier(num_workers=4, timeout_s=5.0) as v:
      results = v.score_many(responses, ground_truths)
  """

  def __init__(self, num_workers: int | None = None, timeout_s: float = 5.0, *,
               tail_chars: int = math_dapo.TAIL_CHARS,
               memory_limit_mb: int | None = DEFAULT_MEMORY_LIMIT_MB,
               kill_grace_s: float = 0.25, start_method: str | None = None):
    if timeout_s <= 0:
      raise ValueError(f"timeout_s must be > 0, got {timeout_s}.")
    if tail_chars < 1:
      raise ValueError(f"tail_chars must be >= 1, got {tail_chars}.")
    self.timeout_s = timeout_s
    self.tail_chars = tail_chars
    self.pool = DeadlinePool(
        num_workers or default_num_workers(), preload=WORKER_PRELOAD,
        memory_limit_mb=memory_limit_mb, kill_grace_s=kill_grace_s,
        warmup=(_warm_up, ()), start_method=start_method)

  def close(self) -> None:
    self.pool.close()

  def __enter__(self) -> "SymbolicVerifier":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def score_many(self, solutions: Sequence[str], ground_truths: Sequence[str],
                 timeout_s: float | None = None) -> list[tuple[math_dapo.ScoreDict, Outcome]]:
    """Scores a batch in parallel; returns (score dict, outcome) pairs in input order.

    `outcome.status` is "ok", "error" or "timeout"; the latter two always come with a
    wrong score dict whose pred is `ERROR_PRED` / `TIMEOUT_PRED`.
    """
    if len(solutions) != len(ground_truths):
      raise ValueError(
          f"Got {len(solutions)} solutions but {len(ground_truths)} ground truths.")
    results: list[tuple[math_dapo.ScoreDict, Outcome] | None] = [None] * len(solutions)
    todo: list[int] = []
    tasks: list[tuple[str, str]] = []
    preds: list[str] = []
    for i, (solution, gt) in enumerate(zip(solutions, ground_truths)):
      try:
        strict = math_dapo.compute_score(solution, gt)
        if strict["acc"]:
          results[i] = (strict, Outcome("ok", value=True))
          continue
        answer = extract_answer(solution, self.tail_chars)
      except Exception as e:  # pylint: disable=broad-except
        results[i] = (_wrong(ERROR_PRED), Outcome("error", error=type(e).__name__))
        continue
      if answer is None:
        results[i] = (_wrong(math_dapo.INVALID_PRED), Outcome("ok", value=False))
        continue
      todo.append(i)
      tasks.append((answer, str(gt)))
      preds.append(math_dapo.normalize_final_answer(answer))
    if tasks:
      timeout_s = self.timeout_s if timeout_s is None else timeout_s
      outcomes = self.pool.map(symbolic_equal, tasks, timeout_s)
      for i, pred, outcome in zip(todo, preds, outcomes):
        if outcome.status == "ok":
          results[i] = (_right(pred) if outcome.value else _wrong(pred), outcome)
        else:
          marker = TIMEOUT_PRED if outcome.status == "timeout" else ERROR_PRED
          results[i] = (_wrong(marker), outcome)
    return results  # type: ignore[return-value]

  def score(self, solution_str: str, ground_truth: str,
            timeout_s: float | None = None) -> math_dapo.ScoreDict:
    return self.score_many([solution_str], [ground_truth], timeout_s)[0][0]


_default_verifier: SymbolicVerifier | None = None
_default_lock = threading.Lock()


def _close_default() -> None:
  if _default_verifier is not None:
    _default_verifier.close()


def compute_score_symbolic(solution_str: str, ground_truth: str,
                           timeout_s: float = 5.0) -> math_dapo.ScoreDict:
  """Drop-in for `math_dapo.compute_score` with symbolic equivalence; bounded by timeout_s.

  Uses one shared single-worker pool, started on first use. For batches, use
  `SymbolicVerifier.score_many` or `dapo_jax.rewards.batch.RewardScorer` instead.
  """
  global _default_verifier
  with _default_lock:
    if _default_verifier is None:
      _default_verifier = SymbolicVerifier(num_workers=1, timeout_s=timeout_s)
      atexit.register(_close_default)
    return _default_verifier.score(solution_str, ground_truth, timeout_s)
