"""Which tokenizer a run uses, said in one line, and the check that the model's vocabulary is
that tokenizer's (issue 50: "auto" used to fall back to the built-in Qwen2.5 BPE without a word,
whatever the checkpoint's vocabulary)."""

from __future__ import annotations

from typing import Any

from dapo_jax.infra import run_files
from dapo_jax.tokenizers import qwen_vocab
from dapo_jax.tokenizers.char_tokenizer import CharTokenizer
from dapo_jax.tokenizers.tokenizer import HFTokenizer, QwenTiktokenTokenizer, load_tokenizer

# The largest embedding a Qwen2.5 / Qwen3 checkpoint pads the 151,665 tokens to (7B and up; the
# smaller ones 151,936): `models.presets` holds the same two sizes.
QWEN_MAX_VOCAB = 152064


def choose_tokenizer(kind: str, path: str = "", checkpoint: str = "") -> tuple[Any, str, bool]:
  """``(tokenizer, the line saying which and why, fell_back)`` for ``tokenizer.kind`` ``kind``
  over the files of ``path`` (``tokenizer.path``), else ``checkpoint`` (``model.checkpoint``).
  ``fell_back``: "auto" found no tokenizer files in that directory and took the built-in BPE."""
  where = path or checkpoint
  named = f"tokenizer.path={path}" if path else f"model.checkpoint={checkpoint}"
  fell_back = False
  if kind == "char":
    if where and (run_files.resolve(where) / CharTokenizer.FILE_NAME).exists():
      tokenizer, why = CharTokenizer.load(where), f"tokenizer.kind=char, the one {named} holds"
    else:
      tokenizer, why = CharTokenizer(), "tokenizer.kind=char, the built-in alphabet"
  elif kind in ("qwen2.5", "qwen2.5-math"):
    tokenizer, why = load_tokenizer(None, fallback=kind), f"tokenizer.kind={kind}"
  elif kind == "hf":
    tokenizer, why = load_tokenizer(where, fallback=None), f"tokenizer.kind=hf, from {named}"
  elif not where:
    tokenizer, why = (load_tokenizer(None, fallback="qwen2.5"), "tokenizer.kind=auto, and "
                      "neither tokenizer.path nor model.checkpoint names tokenizer files")
  elif _has_no_tokenizer_files(where):
    tokenizer, fell_back = load_tokenizer(None, fallback="qwen2.5"), True
    why = (f"tokenizer.kind=auto, and {named} holds neither tokenizer.json nor "
           f"{CharTokenizer.FILE_NAME}")
  else:
    tokenizer, why = load_tokenizer(where, fallback=None), f"tokenizer.kind=auto, from {named}"
  return tokenizer, f"tokenizer: {describe(tokenizer)} ({why})", fell_back


def _has_no_tokenizer_files(path: str) -> bool:
  directory = run_files.resolve(path)
  return directory.is_dir() and not any(
      (directory / f).exists() for f in ("tokenizer.json", CharTokenizer.FILE_NAME))


def describe(tokenizer) -> str:
  """``tokenizer`` in a few words: which files or built-in vocabulary, and its size."""
  if isinstance(tokenizer, HFTokenizer):
    return f"{tokenizer.path}/tokenizer.json ({tokenizer.vocab_size} tokens)"
  if isinstance(tokenizer, QwenTiktokenTokenizer):
    return f"the built-in {tokenizer.variant} BPE ({tokenizer.vocab_size} tokens)"
  if isinstance(tokenizer, CharTokenizer):
    return f"the char tokenizer ({tokenizer.vocab_size} symbols)"
  return f"a vocabulary of {tokenizer.vocab_size} tokens"


def check_vocabulary(vocab_size: int, tokenizer, where: str, pretrained: bool) -> None:
  """Refuses a model (``vocab_size`` embedding rows, from ``where``) whose vocabulary is not the
  tokenizer's: an id past the embedding, or ``pretrained`` weights that are no Qwen2.5 / Qwen3
  checkpoint's under the built-in Qwen BPE (its ids would mean other words to them, and
  training would not say so)."""
  if vocab_size < tokenizer.vocab_size:
    fix = ("copy the checkpoint's tokenizer.json there or set config.tokenizer.path to it"
           if pretrained else "set config.model.overrides.vocab_size")
    raise ValueError(f"{where}: vocab_size={vocab_size} is smaller than the tokenizer's "
                     f"({describe(tokenizer)}): {fix}.")
  if pretrained and isinstance(tokenizer, QwenTiktokenTokenizer) and vocab_size > QWEN_MAX_VOCAB:
    raise ValueError(
        f"{where}: vocab_size={vocab_size} is not a Qwen2.5 / Qwen3 vocabulary "
        f"({qwen_vocab.QWEN25_TOKENIZER_SIZE} tokens padded to at most {QWEN_MAX_VOCAB}), but "
        f"the tokenizer is {describe(tokenizer)}: copy the checkpoint's tokenizer.json there or "
        "set config.tokenizer.path to it.")
