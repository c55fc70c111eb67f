"""The synthetic arithmetic task (dapo_jax/data/arithmetic.py)."""
import ast
import importlib
import operator
import re

import pytest

from dapo_jax.data import arithmetic, loaders
from dapo_jax.data.arithmetic import ArithmeticConfig, ArithmeticProblem, reference_response

HARD = ArithmeticConfig(min_digits=1, max_digits=3, min_operands=2, max_operands=4)

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _evaluate(text: str) -> int:
  """Python's own precedence rules, as an independent reference (no eval())."""
  def walk(node):
    if isinstance(node, ast.BinOp):
      return _BINOPS[type(node.op)](walk(node.left), walk(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):  # "-2+8" mid-chain
      return -walk(node.operand)
    assert isinstance(node, ast.Constant) and isinstance(node.value, int)
    return node.value
  return walk(ast.parse(text, mode="eval").body)


def test_ground_truths_are_correct_integers():
  records = arithmetic.make_records(300, split="train", seed=0, config=HARD)
  for r in records:
    problem = r.extra["problem"]
    assert r.prompt == f"{problem}="  # the compact default template
    assert re.fullmatch(r"-?\d+", r.ground_truth)
    assert int(r.ground_truth) == _evaluate(problem)
  assert {len(re.findall(r"\d+", r.extra["problem"])) for r in records} == {2, 3, 4}
  assert any(int(r.ground_truth) < 0 for r in records)


def test_difficulty_knobs():
  config = ArithmeticConfig(min_digits=3, max_digits=3, min_operands=3, max_operands=3, ops="*",
                            template="Q: {problem} A:")
  for r in arithmetic.make_records(50, seed=1, config=config):
    operands = r.extra["problem"].split("*")
    assert len(operands) == 3 and all(len(x) == 3 for x in operands)
    assert r.prompt == f"Q: {r.extra['problem']} A:"
  with pytest.raises(ValueError, match="too small"):
    arithmetic.make_rows(200, config=ArithmeticConfig(max_digits=1, ops="+"))  # 100 sums only
  with pytest.raises(ValueError, match="template"):
    ArithmeticConfig(template="no placeholder")


def test_splits_are_disjoint_and_deterministic():
  train = arithmetic.make_problems(2000, split="train", seed=0, config=HARD)
  test = arithmetic.make_problems(200, split="test", seed=0, config=HARD)
  other_seed = arithmetic.make_problems(200, split="test", seed=5, config=HARD)
  train_texts = {p.text for p in train}
  assert len(train_texts) == 2000 and len({p.text for p in test}) == 200
  assert not train_texts & {p.text for p in test + other_seed}
  assert arithmetic.make_problems(2000, split="train", seed=0, config=HARD) == train
  assert arithmetic.make_problems(2000, split="train", seed=1, config=HARD) != train


def test_reference_response_format():
  assert reference_response("12+7*3") == "12+7*3=12+21=33\nAnswer: 33"
  assert reference_response("3-5+2*4") == "3-5+2*4=3-5+8=-2+8=6\nAnswer: 6"
  assert reference_response(ArithmeticProblem((4, 9), ("-",))) == "4-9=-5\nAnswer: -5"
  for r in arithmetic.make_records(200, split="test", seed=2, config=HARD):
    response = reference_response(r)
    *work, last = response.split("\n")
    assert last == f"Answer: {r.ground_truth}"  # the answer on its own last line
    chain = work[0].split("=")
    assert chain[0] == r.extra["problem"] and chain[-1] == r.ground_truth
    assert all(_evaluate(step) == int(r.ground_truth) for step in chain)
    # Spec section 2: the last `Answer:` match in the 300-character tail is the prediction.
    matches = re.findall(r"(?i)Answer\s*:\s*([^\n]+)", response[-300:])
    assert matches[-1] == r.ground_truth


def test_reference_responses_score_right_with_compute_score():
  try:
    math_dapo = importlib.import_module("dapo_jax.rewards.math_dapo")
  except ImportError:
    pytest.skip("dapo_jax.rewards.math_dapo not written yet")
  for r in arithmetic.make_records(300, split="train", seed=3, config=HARD):
    result = math_dapo.compute_score(reference_response(r), r.ground_truth)
    assert result["acc"] and result["score"] == 1.0, (r.extra["problem"], result)
  wrong = math_dapo.compute_score("2+2=5\nAnswer: 5", "4")
  assert not wrong["acc"]


def test_rows_go_through_the_same_loaders(tmp_path):
  rows = arithmetic.make_rows(40, split="train", seed=4, config=HARD)
  expected = arithmetic.make_records(40, split="train", seed=4, config=HARD)
  for name in ("arith.parquet", "arith.jsonl"):
    loaders.write_rows(rows, tmp_path / name)
    got, stats = loaders.load_records(tmp_path / name, dedup=True)
    assert got == expected and stats.duplicates_removed == 0


def test_prompts_and_responses_fit_the_char_tokenizer():
  try:
    char_tokenizer = importlib.import_module("dapo_jax.tokenizers.char_tokenizer")
  except ImportError:
    pytest.skip("dapo_jax.tokenizers.char_tokenizer not written yet")
  tok = char_tokenizer.CharTokenizer()
  for r in arithmetic.make_records(100, seed=6, config=HARD):
    for text in (r.prompt, reference_response(r)):
      assert tok.decode(tok.encode(text)) == text
