"""A tiny random HF Qwen2 checkpoint plus a char tokenizer, written once per test process."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile

from dapo_jax.tokenizers import CharTokenizer
from tests import hf_fixtures


@functools.lru_cache(maxsize=None)
def tiny_checkpoint() -> str:
  """Directory with config.json, model.safetensors (vocab 128) and char_tokenizer.json."""
  out = tempfile.mkdtemp(prefix="dapo_rollout_ckpt_")
  atexit.register(shutil.rmtree, out, ignore_errors=True)
  hf_fixtures.write_tiny_qwen2(out, seed=3)
  CharTokenizer().save(out)  # 64 ids: ids 64..127 decode to nothing, like padded embedding rows
  return out
