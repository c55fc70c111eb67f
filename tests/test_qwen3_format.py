"""The verifiers on Qwen3's output format: a <think>...</think> block, then the answer.

Both read the answer after the last </think> (`math_dapo.answer_region`): an `Answer:` line or a
\\boxed{} the model tried inside its thinking is not scored, and a response cut off inside an
open <think> has no answer. Without the tags both are verl's math_dapo as before.
"""

from dapo_jax.rewards import math_dapo, symbolic

THINK = ("<think>\nLet me compute 12 * 13.\nAnswer: 146\nNo: 12 * 13 = 120 + 36 = 156, and "
         "\\boxed{146} was a slip.\n</think>\n\n")


def test_strict_answer_rule_reads_after_the_thinking_block():
  assert math_dapo.compute_score(THINK + "12 * 13 = 156.\nAnswer: 156", "156")["acc"]
  wrong = math_dapo.compute_score(THINK + "Answer: 146", "156")
  assert (wrong["score"], wrong["pred"]) == (-1.0, "146")
  # The thinking's "Answer: 146" (in the 300-character tail) is not the model's answer.
  assert math_dapo.compute_score(THINK + "So the product is 156.", "146")["pred"] == (
      math_dapo.INVALID_PRED)
  # Cut off mid-thought (truncated): no answer, whatever the thinking says.
  assert math_dapo.compute_score(THINK[:40], "146")["pred"] == math_dapo.INVALID_PRED
  # The same text without the tags: its last Answer: line is read, as verl's math_dapo does.
  untagged = THINK.replace("<think>", "").replace("</think>", "")
  assert math_dapo.compute_score(untagged + "So it is 156.", "146")["acc"]
  assert math_dapo.compute_score("12 * 13 = 156\nAnswer: 156", "156")["acc"]


def test_symbolic_verifier_on_a_thinking_block_then_a_boxed_answer():
  right = symbolic.compute_score_symbolic(THINK + "The product is $\\boxed{156}$.", "156")
  assert right["acc"] and right["score"] == 1.0
  # Equivalent forms count; the thinking's Answer: 146 and \boxed{146} do not.
  assert symbolic.compute_score_symbolic(THINK + "So $\\boxed{\\frac{312}{2}}$.", "156")["acc"]
  assert not symbolic.compute_score_symbolic(THINK + "So $\\boxed{155}$.", "156")["acc"]
  assert not symbolic.compute_score_symbolic(THINK + "So it is 156.", "146")["acc"]
  assert symbolic.compute_score_symbolic(THINK + "Answer: 156", "156")["acc"]
