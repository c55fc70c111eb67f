"""The verifiers on Qwen3's output format: a <think>...</think> block, then the answer.

Both read the answer after the last </think> (`math_dapo.answer_region`): an `Answer:` line or a
\\boxed{} the model tried inside its thinking is not scored, and a response cut off inside an
open <think> has no answer. Without the tags both are verl's math_dapo as before.
"""

import json

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


def test_thinking_tags_survive_decoding_and_the_prompt_leaves_thinking_on(tmp_path):
  """A tokenizer.json laid out as Qwen3's (<think>/</think> added but not special, <|im_end|>
  special): the rendered generation prompt ends at the assistant header (thinking mode, no
  enable_thinking), decoding with skip_special_tokens keeps the tags, and the verifier scores
  the answer after </think>."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers  # pylint: disable=g-import-not-at-top
  from dapo_jax.tokenizers import tokenizer as tok_lib  # pylint: disable=g-import-not-at-top
  from dapo_jax.trainer.generation import decode_responses  # pylint: disable=g-import-not-at-top
  words = ["[UNK]", "Answer:", "7", "5", "maybe", "\n"]
  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
  tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
  tok.add_special_tokens(["<|im_end|>", "<|endoftext|>", "<|im_start|>"])
  tok.save(str(tmp_path / "tokenizer.json"))
  # Our own minimal ChatML template with the enable_thinking switch Qwen3's template has.
  template = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
              "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
              "{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and "
              "enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
              "{%- endif %}")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": template, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
  hf = tok_lib.load_tokenizer(str(tmp_path), fallback=None)
  prompt = hf.apply_chat_template([{"role": "user", "content": "7"}], add_generation_prompt=True)
  assert prompt.endswith("<|im_start|>assistant\n")  # thinking mode: the model opens <think>
  ids = hf.encode("<think> maybe Answer: 7 </think> Answer: 5 <|im_end|>")
  texts = decode_responses(hf, np.asarray([ids], np.int32), np.asarray([len(ids)]), hf.eos_ids)
  assert "<think>" in texts[0] and "</think>" in texts[0] and "<|im_end|>" not in texts[0]
  assert math_dapo.compute_score(texts[0], "5")["acc"]
  assert not math_dapo.compute_score(texts[0], "7")["acc"]
