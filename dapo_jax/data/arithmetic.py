"""A synthetic, verifiable arithmetic task for the tiny CPU DAPO demo.

Problems such as `37+5`, `12-40` or `12+7*3` (integer operands, `*` binds
tighter than `+`/`-`, evaluated left to right otherwise). Rows follow the DAPO
schema, so `loaders`, `builders` and `pipeline` handle them unchanged, but the
prompt is a compact template (default `"{problem}="`): a char-level model with a
few million parameters cannot afford the long DAPO instruction text.

`reference_response` gives a short worked solution ending in the strict
verifier's `Answer: N` line (spec section 2), used for a supervised warm start:

  12+7*3=12+21=33
  Answer: 33

Train and held-out problems are separated by a hash of the problem text, so no
problem is in both, whatever the seeds or sizes asked for.
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Any, Literal

import numpy as np

from dapo_jax.data.records import MathRecord, parse_row

OPS = "+-*"
DATA_SOURCE = "arithmetic"
Split = Literal["train", "test"]


@dataclasses.dataclass(frozen=True)
class ArithmeticProblem:
  """`operands[0] ops[0] operands[1] ops[1] ...` over non-negative integers."""
  operands: tuple[int, ...]
  ops: tuple[str, ...]

  def __post_init__(self):
    if len(self.operands) < 2 or len(self.ops) != len(self.operands) - 1:
      raise ValueError(f"need n >= 2 operands and n - 1 operators, got {self.operands} "
                       f"and {self.ops}")
    if any(op not in OPS for op in self.ops):
      raise ValueError(f"operators must be in {OPS!r}, got {self.ops}")
    if any(x < 0 for x in self.operands):
      raise ValueError(f"operands must be non-negative, got {self.operands}")

  @property
  def text(self) -> str:
    return _format(list(self.operands), list(self.ops))

  @property
  def answer(self) -> int:
    return reduction_steps(self)[-1][0][0]

  @classmethod
  def parse(cls, text: str) -> ArithmeticProblem:
    """Parses `"12+7*3"` (no spaces, no signs) back into a problem."""
    if not re.fullmatch(r"\d+([+*-]\d+)+", text):
      raise ValueError(f"not an arithmetic problem like '12+7*3': {text!r}")
    return cls(tuple(int(x) for x in re.findall(r"\d+", text)),
               tuple(re.findall(r"[+*-]", text)))


def _format(operands: list[int], ops: list[str]) -> str:
  parts = [str(operands[0])]
  for op, x in zip(ops, operands[1:]):
    parts.append(op + str(x))
  return "".join(parts)


def reduction_steps(problem: ArithmeticProblem) -> list[tuple[list[int], list[str]]]:
  """Each intermediate expression, one operation applied per step.

  The leftmost `*` goes first, then the leftmost remaining operation, which is
  the usual precedence. Only the first number can turn negative (a product of
  non-negatives is not), so no step ever reads like `3--2`.
  """
  operands, ops = list(problem.operands), list(problem.ops)
  steps = [(operands, ops)]
  while ops:
    i = ops.index("*") if "*" in ops else 0
    a, b = operands[i], operands[i + 1]
    value = a * b if ops[i] == "*" else a + b if ops[i] == "+" else a - b
    operands = operands[:i] + [value] + operands[i + 2:]
    ops = ops[:i] + ops[i + 1:]
    steps.append((operands, ops))
  return steps


def reference_response(problem: ArithmeticProblem | MathRecord | str) -> str:
  """A worked solution whose last line is `Answer: N`, e.g. `12+7*3=12+21=33\\nAnswer: 33`.

  Takes a problem, its text, or a record made by this module (which keeps the
  problem text in `extra["problem"]`).
  """
  if isinstance(problem, MathRecord):
    if "problem" not in problem.extra:
      raise ValueError(f"record {problem.index!r} has no extra['problem']; not an arithmetic row")
    problem = problem.extra["problem"]
  if isinstance(problem, str):
    problem = ArithmeticProblem.parse(problem)
  chain = "=".join(_format(o, p) for o, p in reduction_steps(problem))
  return f"{chain}\nAnswer: {problem.answer}"


@dataclasses.dataclass(frozen=True)
class ArithmeticConfig:
  """Difficulty and format of generated problems.

  Attributes:
    min_digits, max_digits: each operand has a digit count drawn uniformly from
      this range (1 digit includes 0).
    min_operands, max_operands: operand count range (2 gives `a+b`; 3 gives `a+b*c`).
    ops: operators to draw from, a subset of "+-*".
    template: user-turn text; must contain `{problem}`.
    heldout_fraction: share of the problem space reserved for the "test" split.
    data_source: the rows' `data_source`.
  """
  min_digits: int = 1
  max_digits: int = 2
  min_operands: int = 2
  max_operands: int = 2
  ops: str = OPS
  template: str = "{problem}="
  heldout_fraction: float = 0.1
  data_source: str = DATA_SOURCE

  def __post_init__(self):
    if not 1 <= self.min_digits <= self.max_digits:
      raise ValueError(f"need 1 <= min_digits <= max_digits, got {self.min_digits}, "
                       f"{self.max_digits}")
    if not 2 <= self.min_operands <= self.max_operands:
      raise ValueError(f"need 2 <= min_operands <= max_operands, got {self.min_operands}, "
                       f"{self.max_operands}")
    if not self.ops or any(op not in OPS for op in self.ops):
      raise ValueError(f"ops must be a non-empty subset of {OPS!r}, got {self.ops!r}")
    if "{problem}" not in self.template:
      raise ValueError(f"template must contain '{{problem}}', got {self.template!r}")
    if not 0.0 < self.heldout_fraction < 1.0:
      raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")


def split_of(problem: ArithmeticProblem | str, heldout_fraction: float) -> Split:
  """"test" for a fixed `heldout_fraction` of all problems, by a stable hash of the text."""
  text = problem if isinstance(problem, str) else problem.text
  # sha256, not hash(): the split must not change between processes or runs.
  bucket = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2.0**64
  return "test" if bucket < heldout_fraction else "train"


def sample_problem(rng: np.random.Generator, config: ArithmeticConfig) -> ArithmeticProblem:
  """Draws one problem of the configured difficulty."""
  n = int(rng.integers(config.min_operands, config.max_operands + 1))
  operands = []
  for _ in range(n):
    digits = int(rng.integers(config.min_digits, config.max_digits + 1))
    low = 0 if digits == 1 else 10 ** (digits - 1)
    operands.append(int(rng.integers(low, 10 ** digits)))
  ops = [config.ops[int(rng.integers(len(config.ops)))] for _ in range(n - 1)]
  return ArithmeticProblem(tuple(operands), tuple(ops))


def make_problems(num_problems: int, *, split: Split = "train", seed: int = 0,
                  config: ArithmeticConfig = ArithmeticConfig()) -> list[ArithmeticProblem]:
  """`num_problems` distinct problems of `split`, a deterministic function of the arguments."""
  if split not in ("train", "test"):
    raise ValueError(f"split must be 'train' or 'test', got {split!r}")
  rng = np.random.default_rng(seed)
  problems: dict[str, ArithmeticProblem] = {}  # keyed by text: distinct, in draw order
  max_draws = 50 * num_problems + 1000
  for _ in range(max_draws):
    if len(problems) >= num_problems:
      break
    problem = sample_problem(rng, config)
    if split_of(problem, config.heldout_fraction) == split:
      problems.setdefault(problem.text, problem)
  if len(problems) < num_problems:
    raise ValueError(f"found only {len(problems)} distinct '{split}' problems of the "
                     f"{num_problems} asked for in {max_draws} draws; the problem space of "
                     f"{config} is too small (raise max_digits or max_operands)")
  return list(problems.values())


def problem_row(problem: ArithmeticProblem, index: int, split: Split,
                config: ArithmeticConfig = ArithmeticConfig()) -> dict[str, Any]:
  """One DAPO-schema row for `problem`."""
  return {
      "data_source": config.data_source,
      "prompt": [{"role": "user", "content": config.template.format(problem=problem.text)}],
      "ability": "ARITHMETIC",
      "reward_model": {"ground_truth": str(problem.answer), "style": "rule"},
      "extra_info": {"index": index, "problem": problem.text, "split": split},
  }


def make_rows(num_rows: int, *, split: Split = "train", seed: int = 0,
              config: ArithmeticConfig = ArithmeticConfig()) -> list[dict[str, Any]]:
  """DAPO-schema rows of distinct problems (write them with `loaders.write_rows`)."""
  problems = make_problems(num_rows, split=split, seed=seed, config=config)
  return [problem_row(p, i, split, config) for i, p in enumerate(problems)]


def make_records(num_rows: int, *, split: Split = "train", seed: int = 0,
                 config: ArithmeticConfig = ArithmeticConfig()) -> list[MathRecord]:
  """Like `make_rows`, parsed into `MathRecord`s (through the same validation)."""
  rows = make_rows(num_rows, split=split, seed=seed, config=config)
  source = f"<arithmetic {split} seed={seed}>"
  return [parse_row(row, source=source, row_number=i) for i, row in enumerate(rows)]
