"""Token-level sampling: temperature, top-k and top-p (nucleus), stop tokens, per-request keys.

The switches are static Python values, so a disabled feature compiles to nothing: the DAPO
training rollout (spec section 6 point 1: temperature 1.0, top_p 1.0, no top_k) is a single
`categorical` draw over the full vocabulary, with no sort.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dapo_jax.models.logprobs import token_log_probs
from dapo_jax.infra.profiling import scoped


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Static generation settings (hashable, so they can key a compiled program).

  Attributes:
    temperature: softmax temperature; 0 means greedy (argmax).
    top_p: nucleus mass in (0, 1]; 1.0 turns it off.
    top_k: keep the k most likely tokens; 0 turns it off.
    max_new_tokens: response budget R (the response arrays are [B*G, R]).
    eos_ids: stop tokens; the first one emitted ends the row and stays inside the mask.
    pad_id: written after the stop token and in the unused tail.
  """
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  max_new_tokens: int = 256
  eos_ids: tuple[int, ...] = ()
  pad_id: int = 0

  def __post_init__(self):
    _check_switches(self.temperature, self.top_p, self.top_k)
    if self.max_new_tokens < 1:
      raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}.")
    # Accept any iterable of ints (e.g. a list from a config) but store a tuple to stay hashable.
    object.__setattr__(self, "eos_ids", tuple(int(t) for t in self.eos_ids))


def _check_switches(temperature: float, top_p: float, top_k: int) -> None:
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}.")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p must be in (0, 1] (1.0 = off), got {top_p}.")
  if top_k < 0:
    raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}.")


def _gather(x_BxV: jax.Array, idx_B: jax.Array) -> jax.Array:
  return jnp.take_along_axis(x_BxV, idx_B[:, None], axis=-1)[:, 0]


def _argmax(x_BxV: jax.Array) -> jax.Array:
  """First index of the row maximum, as int32.

  Same result as `jnp.argmax`, but two plain reductions instead of one variadic (value, index)
  reduce, which XLA CPU does not vectorise (about 2.5x slower per decode step at V = 512).
  """
  max_Bx1 = jnp.max(x_BxV, axis=-1, keepdims=True)
  iota_BxV = jax.lax.broadcasted_iota(jnp.int32, x_BxV.shape, 1)
  vocab = x_BxV.shape[-1]
  # The clamp keeps a NaN row (no element equals its max) a valid token id.
  return jnp.minimum(jnp.min(jnp.where(x_BxV == max_Bx1, iota_BxV, vocab), axis=-1), vocab - 1)


def _categorical(key: jax.Array, logits_BxV: jax.Array) -> jax.Array:
  """Gumbel-max draw, the same distribution as `jax.random.categorical` (masked = -inf)."""
  return _argmax(logits_BxV + jax.random.gumbel(key, logits_BxV.shape, logits_BxV.dtype))


@scoped("sample")
def sample_logits(
    logits_BxV: jax.Array,
    key: jax.Array,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
) -> tuple[jax.Array, jax.Array]:
  """Samples one token per row.

  Order as in Hugging Face warpers: divide by the temperature, keep the top-k, then keep the
  nucleus of the renormalised top-k distribution (the smallest prefix of the sorted
  distribution whose mass reaches `top_p`; always at least one token).

  Args:
    logits_BxV: raw logits (any float dtype; computed in fp32).
    key: one PRNG key; rows draw independent noise from it.
    temperature: 0 = greedy.
    top_p: nucleus mass, 1.0 = off.
    top_k: 0 = off.

  Returns:
    tokens_B int32 and logprobs_B fp32: the log-prob of each sampled token under the FULL
    softmax of logits / temperature (not the truncated distribution), the quantity the trainer
    recomputes (spec section 4), by the trainer's own formula (`logprobs.token_log_probs`).
    Greedy (temperature 0) reports log_softmax(logits) at T = 1.
  """
  _check_switches(temperature, top_p, top_k)
  logits_BxV = logits_BxV.astype(jnp.float32)
  vocab = logits_BxV.shape[-1]

  if temperature == 0.0:
    tokens_B = _argmax(logits_BxV)
    return tokens_B, token_log_probs(logits_BxV, tokens_B)

  scaled_BxV = logits_BxV / temperature if temperature != 1.0 else logits_BxV
  logprob_of = lambda tokens_B: token_log_probs(logits_BxV, tokens_B, temperature=temperature)

  use_top_k = 0 < top_k < vocab
  if not use_top_k and top_p >= 1.0:
    # The DAPO training setting: one categorical draw over the full vocabulary, no sort.
    tokens_B = _categorical(key, scaled_BxV)
    return tokens_B, logprob_of(tokens_B)

  # Candidates in descending order: top_k is a partial sort, cheaper than sorting all of V.
  if use_top_k:
    cand_BxK, idx_BxK = jax.lax.top_k(scaled_BxV, top_k)
  else:
    iota_BxV = jax.lax.broadcasted_iota(jnp.int32, scaled_BxV.shape, 1)
    neg_BxV, idx_BxK = jax.lax.sort_key_val(-scaled_BxV, iota_BxV, dimension=-1)
    cand_BxK = -neg_BxV

  if top_p < 1.0:
    probs_BxK = jax.nn.softmax(cand_BxK, axis=-1)
    # Mass strictly before each candidate: keep it while the prefix has not yet reached top_p,
    # so the kept set is the smallest prefix whose mass reaches top_p. The first is always kept.
    mass_before_BxK = jnp.cumsum(probs_BxK, axis=-1) - probs_BxK
    first_BxK = jax.lax.broadcasted_iota(jnp.int32, cand_BxK.shape, 1) == 0
    keep_BxK = (mass_before_BxK < top_p) | first_BxK
    cand_BxK = jnp.where(keep_BxK, cand_BxK, -jnp.inf)

  choice_B = _categorical(key, cand_BxK)
  tokens_B = _gather(idx_BxK, choice_B).astype(jnp.int32)
  return tokens_B, logprob_of(tokens_B)


def is_stop(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
  """Where `tokens` is one of the stop ids (any shape)."""
  stop = jnp.zeros(tokens.shape, bool)
  for eos in eos_ids:  # a handful of ids: unrolled compares beat a gather
    stop |= tokens == eos
  return stop


def request_keys(base_key_data: jax.Array, ids_Mx2: jax.Array) -> jax.Array:
  """Key data [M, 2] of fold_in(fold_in(base, ids[:, 0]), ids[:, 1]): one stream per request."""
  base = jax.random.wrap_key_data(base_key_data)
  fold = lambda i: jax.random.key_data(jax.random.fold_in(jax.random.fold_in(base, i[0]), i[1]))
  return jax.vmap(fold)(ids_Mx2)


def sample_rows(logits_NxV: jax.Array, keys_Nx2: jax.Array, positions_N: jax.Array,
                params: SamplingParams) -> tuple[jax.Array, jax.Array]:
  """One token per row, row n keyed by fold_in(keys[n], positions[n]), so a request's draws do
  not depend on which slot or step it ran in."""
  def one(logits_V, key_data, pos):
    key = jax.random.fold_in(jax.random.wrap_key_data(key_data), pos)
    tok, lp = sample_logits(logits_V[None], key, temperature=params.temperature,
                            top_p=params.top_p, top_k=params.top_k)
    return tok[0], lp[0]
  return jax.vmap(one)(logits_NxV, keys_Nx2, positions_N)
