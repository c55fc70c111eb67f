"""Strict DAPO reward (docs/algorithm.md section 2): the table pins verl's behaviour and quirks."""
import pytest

from dapo_jax.rewards import math_dapo
from dapo_jax.rewards.math_dapo import compute_score, normalize_final_answer

# (solution_str, ground_truth, expected acc, expected pred). Expected values are worked out
# by hand from the spec 2.4 rules, not recorded from the implementation.
STRICT_CASES = [
    # Spec 2.5, the known consequences.
    ("Answer: 11.", "11", False, "11."),
    ("So the result is \\boxed{11}", "11", False, "[INVALID]"),
    ("Answer: \\boxed{11}", "11", True, "11"),
    ("Answer: $11$", "11", True, "11"),
    ("Answer: 11 degrees", "11", True, "11"),
    ("Answer: x = 5", "5", True, "5"),
    ("answer : 1,000", "1000", True, "1000"),
    ("Answer: \\frac12", "\\frac{1}{2}", True, "\\frac{1}{2}"),
    # Case-insensitive anchor, optional whitespace around the colon.
    ("ANSWER: 7", "7", True, "7"),
    ("aNsWeR:7", "7", True, "7"),
    ("The answer: 6", "6", True, "6"),
    ("Final Answer: 9", "9", True, "9"),
    # Markdown bold puts "**" inside the captured text, which normalisation keeps.
    ("**Answer:** 9", "9", False, "**9"),
    # Last match wins; each match stops at the end of its line.
    ("Answer: 3\nAnswer: 4", "4", True, "4"),
    ("Answer: 4\nAnswer: 3", "4", False, "3"),
    ("Answer: 1\nsome text\nanswer : 2", "2", True, "2"),
    ("Step 1: ...\nAnswer: 12\n\nI hope it is correct.", "12", True, "12"),
    # \s* after the colon spans newlines.
    ("Answer:\n\n42", "42", True, "42"),
    # Nothing but whitespace after the colon: the one-space capture normalises to "".
    ("Answer: ", "1", False, ""),
    ("Answer:", "1", False, "[INVALID]"),
    ("", "1", False, "[INVALID]"),
    ("no anchor here, 42", "42", False, "[INVALID]"),
    # Plain mismatches keep the normalised prediction.
    ("Answer: 12", "11", False, "12"),
    ("Answer: 7", "-7", False, "7"),
    ("Answer: -7", "-7", True, "-7"),
    ("Answer: 0.5", "\\frac{1}{2}", False, "0.5"),
    ("Answer: \\sqrt{8}", "2\\sqrt{2}", False, "\\sqrt{8}"),
    ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}", False, "\\dfrac{1}{2}"),
    ("Answer: 3\\%", "3", False, "3\\%"),
    # Unit words, \text, degree signs, dollars are stripped.
    ("Answer: 5 inches", "5", True, "5"),
    ("Answer: 5 cm", "5", True, "5"),
    ("Answer: 12 students", "12", True, "12"),
    ("Answer: 5\\text{ cm}", "5", True, "5"),
    ("Answer: \\text{B}", "B", True, "B"),
    ("Answer: \\textbf{12}", "12", True, "12"),
    ("Answer: 10^\\circ", "10", True, "10"),
    ("Answer: 10^{\\circ}", "10", True, "10"),
    ("Answer: \\$5", "5", True, "5"),
    ("Answer: an apple", "apple", True, "apple"),
    # Radicals and fractions without braces gain them.
    ("Answer: \\sqrt2", "\\sqrt{2}", True, "\\sqrt{2}"),
    ("Answer: 2\\sqrt{2}", "2\\sqrt2", True, "2\\sqrt{2}"),
    ("Answer: \\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt{3}}{2}", True, "\\frac{\\sqrt{3}}{2}"),
    # Digit groups: commas vanish whenever only digits and commas remain (a verl quirk).
    ("Answer: 1000", "1,000", True, "1000"),
    ("Answer: 1, 2, 3", "123", True, "123"),
    # The ground truth is normalised too.
    ("Answer: 7", "\\boxed{7}", True, "7"),
    ("Answer: 7", "$7$", True, "7"),
    # The first $...$ pair is kept and what follows it is dropped, trailing period included.
    ("Answer: $\\boxed{42}$.", "42", True, "42"),
    ("Answer: $11.$", "11", True, "11"),
    # Only the text after the last "=" counts, even across a list of assignments.
    ("Answer: x = 3, y = 4", "4", True, "4"),
]


@pytest.mark.parametrize("solution,gt,acc,pred", STRICT_CASES)
def test_strict_table(solution, gt, acc, pred):
  out = compute_score(solution, gt)
  assert out == {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}
  assert isinstance(out["score"], float)


def test_table_is_large_and_covers_both_outcomes():
  assert len(STRICT_CASES) >= 40
  assert {acc for _, _, acc, _ in STRICT_CASES} == {True, False}


@pytest.mark.parametrize("pad,found", [(290, True), (291, False)])
def test_only_last_300_chars_are_searched(pad, found):
  # "Answer: 4\n" is 10 chars: with 290 of padding the whole string is exactly 300 long.
  solution = "Answer: 4\n" + "x" * pad
  out = compute_score(solution, "4")
  assert out["acc"] is found
  assert out["pred"] == ("4" if found else "[INVALID]")


def test_answer_before_tail_is_ignored_even_if_correct():
  solution = "Answer: 4\n" + "y" * 1000 + "\nAnswer: 5"
  assert compute_score(solution, "4")["acc"] is False
  assert compute_score(solution, "5")["acc"] is True


# The removal list of spec 2.4, copied from the spec so a typo in the module is caught.
SPEC_REMOVED = [
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units",
    "\\ldots", "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm",
    "pounds", "meters", "meals", "edges", "students", "childrentickets", "multiples",
    "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}",
    "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots"]


def test_removed_expressions_match_spec():
  assert list(math_dapo.REMOVED_EXPRESSIONS) == SPEC_REMOVED


@pytest.mark.parametrize("expr", SPEC_REMOVED)
def test_each_removed_expression_is_stripped(expr):
  assert normalize_final_answer("7" + expr) == "7"


@pytest.mark.parametrize("raw,normalized", [
    ("\\text{(B)}", "(B)"),
    ("\\overline{3}", "3"),
    ("\\mbox{m}", ""),  # mbox -> \text{m} -> \text{} -> removed: a bare metre unit vanishes
    ("1,\\text{and}2", "12"),
    ("a = b = 17", "17"),
    ("\\frac34", "\\frac{3}{4}"),
    ("\\sqrt3+\\sqrt5", "\\sqrt{3}+\\sqrt{5}"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("  9  ", "9"),
    ("4\\ \\text{m}", "4"),
    ("1,2", "12"),
    ("1,a", "1,a"),
])
def test_normalize_final_answer(raw, normalized):
  assert normalize_final_answer(raw) == normalized
