"""Tokenizers: a checkpoint's own files, an offline Qwen2.5 BPE, a char one for the CPU task.

`load_tokenizer(path)` picks the right one; every tokenizer implements `Tokenizer`.
"""

from dapo_jax.tokenizers.char_tokenizer import CharTokenizer
from dapo_jax.tokenizers.qwen_vocab import write_hf_tokenizer_files
from dapo_jax.tokenizers.tokenizer import HFTokenizer, QwenTiktokenTokenizer, load_tokenizer
from dapo_jax.tokenizers.tokenizer_base import Tokenizer

__all__ = ["CharTokenizer", "HFTokenizer", "QwenTiktokenTokenizer",
           "Tokenizer", "load_tokenizer", "write_hf_tokenizer_files"]
