"""Architecture presets: Qwen2.5 and Qwen2.5-Math from their public ``config.json`` values."""

from __future__ import annotations

from dapo_jax.models.config import Qwen2Config

_SMALL_VOCAB = 151936  # 0.5B / 1.5B / 3B / Math-1.5B
_LARGE_VOCAB = 152064  # 7B and up

PRESETS: dict[str, Qwen2Config] = {
    "qwen2.5-0.5b": Qwen2Config(_SMALL_VOCAB, 896, 4864, 24, 14, 2, tie_word_embeddings=True,
                                max_position_embeddings=32768),
    "qwen2.5-1.5b": Qwen2Config(_SMALL_VOCAB, 1536, 8960, 28, 12, 2, tie_word_embeddings=True,
                                max_position_embeddings=131072),
    "qwen2.5-3b": Qwen2Config(_SMALL_VOCAB, 2048, 11008, 36, 16, 2, tie_word_embeddings=True,
                              max_position_embeddings=32768),
    "qwen2.5-7b": Qwen2Config(_LARGE_VOCAB, 3584, 18944, 28, 28, 4, tie_word_embeddings=False,
                              max_position_embeddings=131072),
    "qwen2.5-14b": Qwen2Config(_LARGE_VOCAB, 5120, 13824, 48, 40, 8, rms_norm_eps=1e-5,
                               tie_word_embeddings=False, max_position_embeddings=131072),
    "qwen2.5-32b": Qwen2Config(_LARGE_VOCAB, 5120, 27648, 64, 40, 8, rms_norm_eps=1e-5,
                               tie_word_embeddings=False, max_position_embeddings=131072),
    "qwen2.5-72b": Qwen2Config(_LARGE_VOCAB, 8192, 29568, 80, 64, 8, rms_norm_eps=1e-5,
                               tie_word_embeddings=False, max_position_embeddings=131072),
    "qwen2.5-math-1.5b": Qwen2Config(_SMALL_VOCAB, 1536, 8960, 28, 12, 2, rope_theta=10000.0,
                                     tie_word_embeddings=True, max_position_embeddings=4096),
    "qwen2.5-math-7b": Qwen2Config(_LARGE_VOCAB, 3584, 18944, 28, 28, 4, rope_theta=10000.0,
                                   tie_word_embeddings=False, max_position_embeddings=4096),
    # The tiny shape of the CPU benchmarks (4 layers, hidden 256, 8 heads, 2 kv heads, vocab 512).
    "tiny": Qwen2Config(512, 256, 768, 4, 8, 2, rope_theta=10000.0, tie_word_embeddings=False,
                        max_position_embeddings=2048, bos_token_id=None, eos_token_id=None),
    # Smallest shape that still has GQA, biases and several layers: unit tests.
    "test": Qwen2Config(128, 64, 128, 2, 4, 2, rope_theta=10000.0, tie_word_embeddings=False,
                        max_position_embeddings=512, bos_token_id=None, eos_token_id=None),
}


def get_preset(name: str, **overrides) -> Qwen2Config:
  """A preset by name (case-insensitive), with run-time fields overridden."""
  key = name.lower()
  if key not in PRESETS:
    raise KeyError(f"Unknown model preset {name!r}; available: {sorted(PRESETS)}.")
  return PRESETS[key].replace(**overrides)
