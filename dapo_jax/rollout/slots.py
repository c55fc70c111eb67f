"""Decode slots: rows of one KV cache at different lengths, filled by prefill + insert.

The pure pieces behind the JetStream engine (rollout/jetstream_engine.py) and the
continuous-batching driver (rollout/continuous.py); nothing here imports jetstream. Shapes: M
prefilled prompts, P prompt slots, N decode slots, S cache slots, V vocab.

* `prefill_hidden`: right-padded prompts through `model.prefill` (cache + last hidden state).
* `sample_first` / `first_tokens` / `prefill_rows`: the first response token sampled from a
  prefilled row.
* `insert_rows`: prefixes copied into free slots of a `DecodeState`.
* `decode_step`: every slot's pending token through `model.decode_step`, the next one sampled.
* `decode_step_paged`: the same over a paged cache (`models/paged_kv.py`) for the active slots;
  a slot the pool had no page for stays where it was.

Token at absolute position q of a request is drawn with fold_in(request_key, q) (see
`sampling.sample_rows`).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from dapo_jax.models.kv_cache import KVCache
from dapo_jax.models.paged_kv import PagedKVCache
from dapo_jax.models.qwen2 import Qwen2ForCausalLM
from dapo_jax.rollout.sampling import SamplingParams, sample_rows

# JetStream's `pad_tokens` pads prompts to these lengths and only accepts a max_prefill_length
# from this list (it calls `.index()` on it); the continuous driver pads to them too.
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def prefill_bucket(length: int, max_length: int = PREFILL_BUCKETS[-1]) -> int:
  """The smallest JetStream prefill bucket holding `length` tokens."""
  for b in PREFILL_BUCKETS:
    if b >= length and b <= max_length:
      return b
  raise ValueError(f"A prompt of {length} tokens exceeds max_prefill_length={max_length}.")


@flax.struct.dataclass
class Prefix:
  """M prefilled prompts: their KV cache (P slots, right-padded) and first sampled token."""
  cache: KVCache  # [M, P]; index = cache slots used (the prompt, padding after it is invalid)
  token: jax.Array  # [M] int32 first response token
  logprob: jax.Array  # [M] fp32
  position: jax.Array  # [M] int32 real prompt tokens = position of the first response token
  key: jax.Array  # [M, 2] uint32 request key data


@flax.struct.dataclass
class DecodeState:
  """N decode slots. `token` is sampled but not yet fed; `decode_step` feeds and emits it."""
  cache: KVCache | PagedKVCache  # [N, S] rows, or a page pool with N page tables
  token: jax.Array  # [N] int32
  logprob: jax.Array  # [N] fp32
  position: jax.Array  # [N] int32 position of `token`
  length: jax.Array  # [N] int32 tokens emitted so far
  key: jax.Array  # [N, 2] uint32


def prefill_hidden(model: Qwen2ForCausalLM, tokens_MxP: jax.Array, true_length_M: jax.Array
                   ) -> tuple[KVCache, jax.Array, jax.Array]:
  """Prefills right-padded prompts; ids < 0 (JetStream's BOS sentinel) are masked out.

  Returns the P-slot cache (index = the prompt's real tokens, so decode overwrites the padding),
  the hidden state [M, D] at each prompt's last real token and the position [M] of the first
  response token.
  """
  p = tokens_MxP.shape[1]
  used_M = jnp.clip(true_length_M, 0, p)  # JetStream keeps true_length past a truncation
  real_MxP = (jnp.arange(p)[None] < used_M[:, None]) & (tokens_MxP >= 0)
  ids_MxP = jnp.where(real_MxP, tokens_MxP, 0)  # a negative id would gather garbage (NaN) rows
  pos_MxP = jnp.maximum(jnp.cumsum(real_MxP, axis=-1, dtype=jnp.int32) - 1, 0)
  h_MxPxD, cache = model.prefill(ids_MxP, pos_MxP, real_MxP)
  last_M = jnp.maximum(used_M - 1, 0)
  h_MxD = jnp.take_along_axis(h_MxPxD, last_M[:, None, None], axis=1)[:, 0]
  return cache.replace(index=used_M), h_MxD, real_MxP.sum(-1, dtype=jnp.int32)


def sample_first(model: Qwen2ForCausalLM, h_MxD: jax.Array, position_M: jax.Array,
                 keys_Mx2: jax.Array, sampling: SamplingParams) -> tuple[jax.Array, jax.Array]:
  """The first response token and its log-prob, from the hidden state at a prompt's end."""
  return sample_rows(model.logits_from_hidden(h_MxD[:, None])[:, 0], keys_Mx2, position_M,
                     sampling)


def first_tokens(model: Qwen2ForCausalLM, cache: KVCache, h_MxD: jax.Array, position_M: jax.Array,
                 keys_Mx2: jax.Array, sampling: SamplingParams) -> Prefix:
  """Samples each prefilled row's first response token (at `position_M`, key `keys_Mx2`)."""
  token_M, logprob_M = sample_first(model, h_MxD, position_M, keys_Mx2, sampling)
  return Prefix(cache=cache, token=token_M, logprob=logprob_M, position=position_M, key=keys_Mx2)


def prefill_rows(model: Qwen2ForCausalLM, tokens_MxP: jax.Array, true_length_M: jax.Array,
                 keys_Mx2: jax.Array, sampling: SamplingParams) -> Prefix:
  """Prefills right-padded prompts and samples their first response token."""
  cache, h_MxD, position_M = prefill_hidden(model, tokens_MxP, true_length_M)
  return first_tokens(model, cache, h_MxD, position_M, keys_Mx2, sampling)


def insert_rows(prefix: Prefix, state: DecodeState, slots_M: jax.Array) -> DecodeState:
  """Writes M prefixes into slots `slots_M` (out-of-range slots are dropped: batch padding)."""
  put = lambda dst, src: dst.at[slots_M].set(src, mode="drop")
  return DecodeState(cache=state.cache.insert(prefix.cache, slots_M),
                     token=put(state.token, prefix.token),
                     logprob=put(state.logprob, prefix.logprob),
                     position=put(state.position, prefix.position),
                     length=put(state.length, jnp.zeros_like(prefix.token)),
                     key=put(state.key, prefix.key))


def decode_step(model: Qwen2ForCausalLM, state: DecodeState, sampling: SamplingParams
                ) -> tuple[DecodeState, jax.Array, jax.Array, jax.Array]:
  """Feeds every slot's pending token and samples the next one.

  Returns the new state and the fed (emitted) tokens, their log-probs and validity: a token is
  valid when the one before it still fit in the cache (later samples would see a clamped write).
  """
  valid_N = state.cache.index <= state.cache.max_length
  logits_NxV, cache = model.decode_step(state.token, state.position, state.cache)
  next_pos_N = state.position + 1
  token_N, logprob_N = sample_rows(logits_NxV, state.key, next_pos_N, sampling)
  new = DecodeState(cache=cache, token=token_N, logprob=logprob_N, position=next_pos_N,
                    length=state.length + 1, key=state.key)
  return new, state.token, state.logprob, valid_N


def decode_step_paged(model: Qwen2ForCausalLM, state: DecodeState, active_N: jax.Array,
                      sampling: SamplingParams, impl: str = "auto"
                      ) -> tuple[DecodeState, jax.Array, jax.Array, jax.Array, jax.Array]:
  """`decode_step` for the `active_N` slots of a paged state.

  Returns the state, the fed tokens and their log-probs, `ok_N` (the token was stored and its
  successor sampled: emit it) and `out_of_pages_N` (active, but the pool had no page: the slot
  is unchanged and must be retried or preempted). Inactive slots are unchanged.
  """
  logits_NxV, cache, app = model.decode_step_paged(state.token, state.position, state.cache,
                                                   active_N, impl=impl)
  next_pos_N = state.position + 1
  token_N, logprob_N = sample_rows(logits_NxV, state.key, next_pos_N, sampling)
  keep = lambda new, old: jnp.where(app.ok, new, old)
  new = DecodeState(cache=cache, token=keep(token_N, state.token),
                    logprob=keep(logprob_N, state.logprob), position=keep(next_pos_N,
                                                                           state.position),
                    length=state.length + app.ok, key=state.key)
  return new, state.token, state.logprob, app.ok, app.out_of_pages


def empty_decode_state(model: Qwen2ForCausalLM, num_slots: int, cache_length: int
                       ) -> DecodeState:
  z = jnp.zeros((num_slots,), jnp.int32)
  return DecodeState(cache=model.init_cache(num_slots, cache_length), token=z,
                     logprob=jnp.zeros((num_slots,), jnp.float32), position=z, length=z,
                     key=jnp.zeros((num_slots, 2), jnp.uint32))
