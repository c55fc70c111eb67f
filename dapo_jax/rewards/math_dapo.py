"""The strict DAPO math reward (docs/algorithm.md section 2): `Answer:` line + Minerva normaliser.

This is the faithful default verifier: plain string equality after normalisation, exactly as
the DAPO reproduction scores DAPO-Math-17k and AIME. It is pure Python on at most 300
characters, so one call is bounded by construction and needs no timeout.
"""
import re
from typing import TypedDict

# Spec 2.1: only the tail of the response is searched.
TAIL_CHARS = 300
# Spec 2.2: the LAST match of this pattern is the model's answer.
ANSWER_PATTERN = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
INVALID_PRED = "[INVALID]"
# Qwen3's thinking block (and any model that writes one): the answer is read after it.
THINK_START, THINK_END = "<think>", "</think>"

# Spec 2.4, applied with str.replace in this order.
SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    (r"\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)

# Spec 2.4, each removed with str.replace in this order.
REMOVED_EXPRESSIONS: tuple[str, ...] = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units",
    "\\ldots", "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm",
    "pounds", "meters", "meals", "edges", "students", "childrentickets", "multiples",
    "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}",
    "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots",
)

# Spec 2.4, applied with re.sub in this order (compiled once; same semantics as re.sub).
REGEX_SUBSTITUTIONS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), repl)
    for pattern, repl in (
        (r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$"),
        (r"(\\text\{)(.*?)(\})", "\\2"),
        (r"(\\textbf\{)(.*?)(\})", "\\2"),
        (r"(\\overline\{)(.*?)(\})", "\\2"),
        (r"(\\boxed\{)(.*)(\})", "\\2"),
        (r"(frac)([^{])(.)", "frac{\\2}{\\3}"),
        (r"(sqrt)([^{])", "sqrt{\\2}"),
    )
)


class ScoreDict(TypedDict):
  """What every verifier returns for one response."""
  score: float  # +1.0 correct, -1.0 wrong (spec 2).
  acc: bool
  pred: str


def normalize_final_answer(final_answer: str) -> str:
  """Minerva / lm-eval-harness MATH normaliser, in the exact order of spec 2.4."""
  final_answer = final_answer.split("=")[-1]
  for before, after in SUBSTITUTIONS:
    final_answer = final_answer.replace(before, after)
  for expr in REMOVED_EXPRESSIONS:
    final_answer = final_answer.replace(expr, "")
  for pattern, repl in REGEX_SUBSTITUTIONS:
    final_answer = pattern.sub(repl, final_answer)
  final_answer = final_answer.replace("$", "")
  # "1,000" -> "1000", but "1,2" style lists that are not all digits stay as they are.
  if final_answer.replace(",", "").isdigit():
    final_answer = final_answer.replace(",", "")
  return final_answer.strip()


def answer_region(solution_str: str) -> str:
  """The text an answer is read from: after the last `</think>` of a thinking block (Qwen3's
  format), "" while a `<think>` is still open (a response cut off mid-thought has no answer),
  else the whole response. Without the tags this is verl's math_dapo exactly; with them, an
  `Answer:` the model tried inside its thinking (within the 300-character tail) would
  otherwise be scored instead of its final one."""
  end = solution_str.rfind(THINK_END)
  if end != -1:
    return solution_str[end + len(THINK_END):]
  return "" if THINK_START in solution_str else solution_str


def extract_answer_line(solution_str: str, tail_chars: int = TAIL_CHARS) -> str | None:
  """Returns the text after the last `Answer:` in the tail of `answer_region`, or None (spec
  2.1-2.2)."""
  matches = ANSWER_PATTERN.findall(answer_region(solution_str)[-tail_chars:])
  return matches[-1] if matches else None


def compute_score(solution_str: str, ground_truth: str) -> ScoreDict:
  """Strict DAPO reward: +1/-1 by string equality of the normalised answers (spec 2)."""
  answer = extract_answer_line(solution_str)
  if answer is None:
    return {"score": -1.0, "acc": False, "pred": INVALID_PRED}
  pred = normalize_final_answer(answer)
  correct = pred == normalize_final_answer(ground_truth)
  return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
