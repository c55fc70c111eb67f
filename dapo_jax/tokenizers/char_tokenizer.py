"""A character tokenizer for the CPU arithmetic task: 64 ids, one per char.

Small enough that a toy model trains in seconds, and 64 divides evenly over
the 8 simulated test devices when the embedding is sharded.
"""

import json
import os
import pathlib
import re
from typing import Iterable

from dapo_jax.tokenizers import chat_templates
from dapo_jax.tokenizers.tokenizer_base import Tokenizer

PAD, EOS, IM_START, IM_END = "<pad>", "<eos>", "<|im_start|>", "<|im_end|>"
CHAR_SPECIAL_TOKENS = (PAD, EOS, IM_START, IM_END)
# Digits, arithmetic, lowercase words, and the capitals that start the
# prompt words the task uses (Answer, Compute, Question, Solve, What, ...).
CHAR_ALPHABET = ("\n !$()*+,-./0123456789:=?"
                 "ACEFQRSTW"
                 "abcdefghijklmnopqrstuvwxyz")


class CharTokenizer(Tokenizer):
  """Ids 0-3 are `<pad> <eos> <|im_start|> <|im_end|>`, then one per char.

  Args:
    alphabet: the characters, in id order; each may appear once.
    chat_template: jinja source; defaults to ChatML without a system turn.
  """

  FILE_NAME = "char_tokenizer.json"

  def __init__(self, alphabet: str = CHAR_ALPHABET,
               chat_template: str = chat_templates.CHAR_CHAT_TEMPLATE):
    if len(set(alphabet)) != len(alphabet):
      raise ValueError(f"alphabet repeats characters: {alphabet!r}")
    self.alphabet = alphabet
    self.chat_template = chat_template
    self._id_to_token = [*CHAR_SPECIAL_TOKENS, *alphabet]
    self._token_to_id = {t: i for i, t in enumerate(self._id_to_token)}
    # Specials first so "<|im_end|>" is one token, not ten characters.
    self._pattern = re.compile(
        "|".join(re.escape(t) for t in CHAR_SPECIAL_TOKENS) + "|.", re.S)
    self.pad_id = self._token_to_id[PAD]
    self.eos_id = self._token_to_id[EOS]
    self.eos_ids = (self.eos_id, self._token_to_id[IM_END])
    self._special_tokens_map = {"eos_token": EOS, "pad_token": PAD}

  @property
  def vocab_size(self) -> int:
    return len(self._id_to_token)

  def encode(self, text: str) -> list[int]:
    try:
      return [self._token_to_id[t] for t in self._pattern.findall(text)]
    except KeyError as e:
      # Dropping the character would silently change the problem.
      raise ValueError(f"character {e.args[0]!r} is not in the CharTokenizer "
                       f"alphabet {self.alphabet!r}") from None

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = False
             ) -> str:
    first = len(CHAR_SPECIAL_TOKENS) if skip_special_tokens else 0
    # Out-of-range ids decode to nothing, as in the BPE tokenizers.
    return "".join(self._id_to_token[i] for i in map(int, ids)
                   if first <= i < len(self._id_to_token))

  def token_to_id(self, token: str) -> int | None:
    return self._token_to_id.get(token)

  def save(self, path: str | os.PathLike[str]) -> pathlib.Path:
    """Writes the tokenizer to a JSON file, or FILE_NAME in a directory."""
    path = pathlib.Path(path)
    if path.is_dir():
      path = path / self.FILE_NAME
    path.write_text(json.dumps({
        "type": "CharTokenizer",
        "special_tokens": list(CHAR_SPECIAL_TOKENS),
        "alphabet": self.alphabet,
        "chat_template": self.chat_template,
    }, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path

  @classmethod
  def load(cls, path: str | os.PathLike[str]) -> "CharTokenizer":
    """Reads a file written by `save` (or a directory holding FILE_NAME)."""
    path = pathlib.Path(path)
    if path.is_dir():
      path = path / cls.FILE_NAME
    if not path.is_file():
      raise FileNotFoundError(f"{path} not found; write it with "
                              "CharTokenizer().save(checkpoint_dir)")
    data = json.loads(path.read_text(encoding="utf-8"))
    if (data.get("type") != "CharTokenizer"
        or data.get("special_tokens") != list(CHAR_SPECIAL_TOKENS)):
      raise ValueError(f"{path} is not a CharTokenizer file of this version "
                       f"(special tokens must be {list(CHAR_SPECIAL_TOKENS)})")
    tokenizer = cls(data["alphabet"], data["chat_template"])
    tokenizer.path = path
    return tokenizer
