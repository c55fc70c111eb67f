"""Verifier fuzz (issue #8, item 2): 10,000 generated hostile answers through both verifiers.

Every answer goes through the strict `compute_score` and through the symbolic verifier
(math-verify in killable worker processes). No exception may escape, every result must be a
well-formed score, the slowest symbolic call must end within its deadline plus the kill grace
(plus scheduling slack), and canaries that create a file when evaluated (Python, shell, TeX)
must create none. A second test records every string that reaches SymPy's eval-based
`parse_expr` while verifying hostile text; a third checks the package's own source.
"""

import ast
import collections
import glob
import itertools
import os
import re
import subprocess
import time

import pytest

from dapo_jax.rewards import deadline_pool
from dapo_jax.rewards import math_dapo
from dapo_jax.rewards import symbolic
from tests import fault_report
from tests import hostile_answers as hostile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_ANSWERS = 10_000
TIMEOUT_S = 0.1  # short, so the ~2% of answers that blow up SymPy cost little
KILL_GRACE_S = 0.25
MARGIN_S = 1.0  # scheduling slack on a loaded 2-core machine; a hang would blow far past it
CHUNK = 1000
GROUND_TRUTHS = ("5", "\\frac{1}{2}", "x^2+1", "[0, 1)", "-42")
# What SymPy's parse_expr may be handed while model text is verified: a NUMBER token of the
# LaTeX grammar, as `sympy.Number` passes it on.
NUMBER_LITERAL = re.compile(r"^(Integer \(\d+ \)|Float \('\d*\.?\d*' \))$")


def _check_score(out) -> None:
  assert set(out) == {"score", "acc", "pred"}, out
  assert out["score"] in (1.0, -1.0) and out["acc"] is (out["score"] == 1.0), out
  assert isinstance(out["pred"], str)


def _check_canaries_are_armed(tmp_path) -> None:
  """Guards the fuzz itself: evaluated or run, every Python and shell canary creates its file."""
  for i, code in enumerate(hostile.python_canaries(str(tmp_path / "armed_py_{}"))):
    path = code.replace("{}", str(i))
    result = eval(path, {})  # pylint: disable=eval-used  (trusted: the test's own canary)
    getattr(result, "wait", lambda: None)()
    getattr(result, "close", lambda: None)()
    assert os.path.exists(str(tmp_path / f"armed_py_{i}")), code
  for i, cmd in enumerate(hostile.shell_canaries(str(tmp_path / "armed_sh_{}"))):
    subprocess.run(["sh", "-c", "echo " + cmd.replace("{}", str(i))], check=False,
                   capture_output=True, timeout=10)
    assert os.path.exists(str(tmp_path / f"armed_sh_{i}")), cmd


def _address_space_limit(pid: int) -> int | None:
  try:
    with open(f"/proc/{pid}/limits") as f:
      for line in f:
        if line.startswith("Max address space"):
          soft = line.split()[3]
          return None if soft == "unlimited" else int(soft)
  except OSError:
    return None
  return None


@pytest.mark.slow
def test_ten_thousand_hostile_answers_through_both_verifiers(tmp_path):
  canary_dir = tmp_path / "canary"
  canary_dir.mkdir()
  _check_canaries_are_armed(tmp_path)
  answers = hostile.hostile_answers(NUM_ANSWERS, seed=0, canary_path=str(canary_dir / "CANARY"))
  families = collections.Counter()
  statuses = collections.Counter()
  slowest_strict = slowest_symbolic = 0.0
  start = time.monotonic()
  with symbolic.SymbolicVerifier(num_workers=2, timeout_s=TIMEOUT_S,
                                 kill_grace_s=KILL_GRACE_S) as verifier:
    if os.path.isdir("/proc"):  # memory stays bounded: every worker runs under the cap
      verifier.score_many(["Answer: 1/2"], ["0.5"])
      for pid in verifier.pool.pids:
        assert _address_space_limit(pid) == symbolic.DEFAULT_MEMORY_LIMIT_MB * 2**20
    for index in itertools.count(0, CHUNK):
      chunk = list(itertools.islice(answers, CHUNK))
      if not chunk:
        break
      texts = [text for _, text in chunk]
      gts = [GROUND_TRUTHS[(index + i) % len(GROUND_TRUTHS)] for i in range(len(chunk))]
      families.update(name for name, _ in chunk)
      for text, gt in zip(texts, gts):
        t0 = time.perf_counter()
        out = math_dapo.compute_score(text, gt)
        slowest_strict = max(slowest_strict, time.perf_counter() - t0)
        _check_score(out)
      for out, outcome in verifier.score_many(texts, gts):
        _check_score(out)
        statuses[outcome.status] += 1
        slowest_symbolic = max(slowest_symbolic, outcome.seconds)
        if outcome.status != "ok":
          assert not out["acc"] and out["pred"] in (symbolic.TIMEOUT_PRED, symbolic.ERROR_PRED)
    # The pool still answers after thousands of timeouts and kills.
    assert verifier.score("Answer: 0.25", "\\frac14", timeout_s=10.0)["acc"] is True
    killed = verifier.pool.num_killed
  elapsed = time.monotonic() - start

  assert sum(families.values()) == NUM_ANSWERS == sum(statuses.values())
  assert slowest_symbolic <= TIMEOUT_S + KILL_GRACE_S + MARGIN_S, slowest_symbolic
  assert slowest_strict <= TIMEOUT_S, slowest_strict  # pure Python on a 300-character tail
  assert statuses["timeout"] > 0  # the deadline path was exercised, not just easy inputs
  assert not os.listdir(canary_dir), os.listdir(canary_dir)
  fault_report.record("verifier_fuzz", {
      "answers": NUM_ANSWERS, "families": dict(families), "symbolic_outcomes": dict(statuses),
      "workers_killed": killed, "timeout_s": TIMEOUT_S, "kill_grace_s": KILL_GRACE_S,
      "slowest_symbolic_s": round(slowest_symbolic, 3),
      "slowest_strict_s": round(slowest_strict, 5), "canary_files_created": 0,
      "wall_s": round(elapsed, 1)})


def _warm_spy(ground_truths) -> None:
  # Lazy SymPy imports (e.g. units for `\%`) sympify their own constants once; the gold
  # answers are trusted data. Both happen here, before anything is recorded.
  symbolic.symbolic_equal("12\\%", "5")
  for gt in ground_truths:
    symbolic._parse_gold(gt)  # pylint: disable=protected-access


def _spy_symbolic_equal(answer: str, ground_truth: str):
  """Runs in a worker: `symbolic_equal`, plus every code string SymPy's parse_expr evaluates."""
  from sympy.parsing import sympy_parser  # pylint: disable=g-import-not-at-top
  seen, real = [], sympy_parser.eval_expr

  def spy(code, local_dict, global_dict):
    seen.append(code)
    return real(code, local_dict, global_dict)

  sympy_parser.eval_expr = spy
  try:
    return symbolic.symbolic_equal(answer, ground_truth), seen
  finally:
    sympy_parser.eval_expr = real


@pytest.mark.slow
def test_model_text_reaches_parse_expr_only_as_number_tokens(tmp_path):
  canary = str(tmp_path / "CANARY")
  payloads = (hostile.python_canaries(canary) + hostile.shell_canaries(canary)
              + ["x^2 + 1", "0.5", "1,000", "3.14e5", "12\\%", "[1, 2)", "\\frac{7}{13}"])
  answers = [symbolic.extract_answer(f"Answer: {p}") for p in payloads]
  answers += [a for _, t in hostile.hostile_answers(200, 1, canary)
              if (a := symbolic.extract_answer(t)) is not None]
  tasks = [(a, GROUND_TRUTHS[i % len(GROUND_TRUTHS)]) for i, a in enumerate(answers)]
  with deadline_pool.DeadlinePool(2, preload=symbolic.WORKER_PRELOAD,
                                  warmup=(_warm_spy, (GROUND_TRUTHS,))) as pool:
    outcomes = pool.map(_spy_symbolic_equal, tasks, timeout_s=1.0)
  recorded = [code for o in outcomes if o.status == "ok" for code in o.value[1]]
  assert sum(o.status == "ok" for o in outcomes) > len(tasks) // 2
  assert recorded  # numbers do reach it (so the spy works) ...
  bad = sorted({c for c in recorded if not NUMBER_LITERAL.match(c)})
  assert not bad, bad  # ... and nothing else does
  assert not os.path.exists(canary)
  fault_report.record("parse_expr_spy", {
      "answers": len(tasks), "parse_expr_calls": len(recorded),
      "distinct_shapes": sorted({re.sub(r"\d+", "N", c) for c in recorded})})


# Calls that evaluate or parse a string as code; none may appear in the rewards package.
_FORBIDDEN_METHODS = {"sympify", "parse_expr", "parse_latex", "lambdify", "literal_eval"}
_FORBIDDEN_CALLS = _FORBIDDEN_METHODS | {"eval", "exec", "compile", "__import__", "S",
                                         "Number", "Symbol"}


def test_rewards_package_never_evaluates_strings():
  for path in glob.glob(os.path.join(ROOT, "dapo_jax", "rewards", "*.py")):
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
      if isinstance(node, ast.Call):
        f = node.func
        bad = (isinstance(f, ast.Name) and f.id in _FORBIDDEN_CALLS
               or isinstance(f, ast.Attribute) and f.attr in _FORBIDDEN_METHODS)
        assert not bad, f"{path}:{node.lineno} calls {ast.unparse(f)}"
  # math-verify's plain-expression extraction runs SymPy's parse_expr on raw text: model
  # answers must only take the LaTeX path. The one other `parse` call reads the ground truth.
  tree = ast.parse(open(os.path.join(ROOT, "dapo_jax", "rewards", "symbolic.py")).read())
  for func in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
    for call in (n for n in ast.walk(func) if isinstance(n, ast.Call)):
      if isinstance(call.func, ast.Name) and call.func.id == "parse":
        if func.name == "_parse_gold":
          continue
        kw = {k.arg: k.value for k in call.keywords}
        assert "extraction_config" in kw, f"{func.name}: parse() without extraction_config"
        configs = [c.func.id for c in kw["extraction_config"].elts]
        assert configs == ["LatexExtractionConfig"], (func.name, configs)
