"""Architecture presets: Qwen2.5, Qwen2.5-Math and the dense Qwen3 base models from their public
``config.json`` values."""

from __future__ import annotations

from dapo_jax.models.config import Qwen2Config

_SMALL_VOCAB = 151936  # 0.5B / 1.5B / 3B / Math-1.5B
_LARGE_VOCAB = 152064  # 7B and up



def _qwen3(hidden: int, mlp: int, layers: int, heads: int, kv_heads: int, *, tie: bool
           ) -> Qwen2Config:
  """A dense Qwen3 shape; head_dim 128 whatever hidden / heads is (0.6B: 1024 / 16 = 64)."""
  head_dim = 0 if hidden // heads == 128 else 128  # 0: the default hidden / heads (from_hf)
  return Qwen2Config(_SMALL_VOCAB, hidden, mlp, layers, heads, kv_heads, head_dim=head_dim,
                     attention_bias=False, qk_norm=True, rope_theta=1_000_000.0,
                     rms_norm_eps=1e-6, tie_word_embeddings=tie, max_position_embeddings=32768)


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
    # Qwen3 dense base models (Qwen/Qwen3-*-Base config.json on the Hugging Face Hub, as published
    # with Qwen3 in April 2025): QK-norm, no q/k/v bias, head_dim 128, rope_theta 1e6, eps 1e-6,
    # 32,768 positions, eos = bos = <|endoftext|> (151643); embeddings tied up to 4B.
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, 8, tie=True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, 8, tie=True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, 8, tie=True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, 8, tie=False),
    "qwen3-14b": _qwen3(5120, 17408, 40, 40, 8, tie=False),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, 8, tie=False),
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
