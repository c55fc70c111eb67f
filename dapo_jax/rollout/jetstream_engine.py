"""Qwen2.5 behind JetStream's `Engine` API: a slot-based KV cache with prefill / insert / generate.

`prefill` runs one prompt (right-padded to a bucket) and samples its first response token;
`insert` puts that prefix into a slot; `generate` feeds every slot's pending token and samples the
next. All three are module-level programs compiled once per shape, with the model state passed
as an argument and the decode state donated. The pure pieces behind them are in
`rollout/slots.py`. The decode state's KV cache (`kv_cache`, the keys of `rollout.kv_cache`):

* dense: `max_concurrent_decodes` rows of one cache of max_prefill_length + max_new_tokens
  positions; rows sit at different cache indices, `insert` copies the prefix row in.
* paged (`models/paged_kv.py`, as the continuous engine): one page pool, a page table per slot.
  `insert` frees the slot's old pages, allocates the pages the prompt's real tokens need and
  writes them there; `generate` runs the model's `decode_step_paged` (a fresh page when a slot
  crosses a page boundary, attention over live pages only) and frees a slot's pages once it
  emits a stop token or `max_new_tokens` tokens.
  JetStream has no way to pause or preempt a request (its orchestrator ends a request at the
  first invalid token), so pages are never overcommitted: each insert reserves, on the host,
  the pages its slot can reach (prompt bucket + max_new_tokens), and the default pool holds
  every slot at full length. A smaller `kv_pages` (at least one full-length request) is taken
  only when asked for; an insert it cannot hold raises, naming the setting.

Streaming order: a slot's pending token is emitted by the `generate` step that feeds it, so the
prefill token is the first one JetStream's orchestrator sees (JetStream 0.2.2 drops anything
`prefill` returns besides the prefix). Each emitted token carries its sampling log-prob, stored in
the same int32 array as the tokens (bitcast) so one host copy serves both.

Randomness is per request: token at absolute position q is drawn with fold_in(request_key, q), so a
request's sample does not depend on which slot or step it ran in.

    engine = QwenEngine(model, tokenizer, max_concurrent_decodes=8, max_prefill_length=128)
    params = engine.load_params()
    state = engine.init_decode_state()
    prefix = engine.prefill(params=params, padded_tokens=ids_P, true_length=n)
    state = engine.insert(prefix, state, slot=0)
    state, result = engine.generate(params, state)   # result.get_logprobs_at_slot(0)

One piece: JetStream's `Engine` interface for this model: its compiled programs (dense and paged)
and the class that calls them implement one API.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dapo_jax.infra import sharding as shd
from dapo_jax.models import paged_attention, paged_kv
from dapo_jax.models.kv_cache import KVCache, per_layer
from dapo_jax.models.qwen2 import Qwen2ForCausalLM
from dapo_jax.rollout import slots as sl
from dapo_jax.rollout.jetstream_api import engine_api, token_utils, tokenizer_api, tokenizer_pb2
from dapo_jax.rollout.sampling import SamplingParams, is_stop, request_keys
from dapo_jax.rollout.slot_programs import PagedSpec
from dapo_jax.rollout.slots import PREFILL_BUCKETS, DecodeState, Prefix
from dapo_jax.infra.tracing import TraceCounter

# Qwen2.5 has no BOS token, but JetStream prepends `bos_id` to every new request. We hand it this
# sentinel and mask the slot out in prefill, so text and token requests see the same context.
NO_TOKEN = -1
# Column layout of `generate`'s ResultTokens.data (int32): token, valid, length, log-prob bits.
_TOKEN, _VALID, _LENGTH, _LOGPROB = 0, 1, 2, 3

# Traces per program, so tests can catch silent recompiles.
TRACES = TraceCounter()


@flax.struct.dataclass
class QwenResultTokens(engine_api.ResultTokens):
  """JetStream's ResultTokens plus a log-prob column (fp32 bits in the int32 data)."""
  logprob_idx: tuple[int, int] = flax.struct.field(pytree_node=False,
                                                   default=(_LOGPROB, _LOGPROB + 1))

  def convert_to_numpy(self) -> "QwenResultTokens":
    return self.replace(data=np.array(self.data))

  def get_logprobs_at_slot(self, slot: int) -> np.ndarray:
    """[samples_per_slot, 1] fp32 log-probs of the tokens `get_result_at_slot` returns."""
    rows = slice(slot * self.samples_per_slot, (slot + 1) * self.samples_per_slot)
    bits = np.asarray(self.data[rows, self.logprob_idx[0]:self.logprob_idx[1]])
    return bits.astype(np.int32).view(np.float32)


# --- compiled programs ------------------------------------------------------------------------

_STATIC = ("graphdef", "sampling", "mesh")


@functools.partial(jax.jit, static_argnames=_STATIC)
def prefill_program(state: nnx.State, tokens_MxP, true_length_M, base_key_data, key_ids_Mx2, *,
                    graphdef: nnx.GraphDef, sampling: SamplingParams, mesh: Mesh | None
                    ) -> Prefix:
  TRACES.record("prefill")
  with shd.activation_sharding(mesh, shd.SAMPLE_RULES):
    keys = request_keys(base_key_data, key_ids_Mx2)
    return sl.prefill_rows(nnx.merge(graphdef, state), tokens_MxP, true_length_M, keys, sampling)


@functools.partial(jax.jit, donate_argnames=("decode_state",))
def insert_program(prefix: Prefix, decode_state: DecodeState, slots_M) -> DecodeState:
  TRACES.record("insert")
  return sl.insert_rows(prefix, decode_state, slots_M)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("decode_state",))
def generate_program(state: nnx.State, decode_state: DecodeState, *, graphdef: nnx.GraphDef,
                     sampling: SamplingParams, mesh: Mesh | None
                     ) -> tuple[DecodeState, jax.Array]:
  TRACES.record("generate")
  with shd.activation_sharding(mesh, shd.SAMPLE_RULES):
    new, token_N, logprob_N, valid_N = sl.decode_step(nnx.merge(graphdef, state), decode_state,
                                                   sampling)
  data_Nx4 = jnp.stack([token_N, valid_N.astype(jnp.int32), new.length,
                        jax.lax.bitcast_convert_type(logprob_N, jnp.int32)], axis=-1)
  return new, data_Nx4


@functools.partial(jax.jit, static_argnames=("graphdef", "num_slots", "cache_length"))
def init_program(state: nnx.State, *, graphdef: nnx.GraphDef, num_slots: int,
                 cache_length: int) -> DecodeState:
  return sl.empty_decode_state(nnx.merge(graphdef, state), num_slots, cache_length)


# --- the paged decode state ------------------------------------------------------------------


@flax.struct.dataclass
class PagedDecodeState:
  """N slots over one page pool: `decode.cache` is a `PagedKVCache` (table row n = slot n)."""
  decode: DecodeState
  active: jax.Array  # [N] bool: inserted and not yet finished (holds pages, decodes)
  lost: jax.Array  # [] int32 inserts the pool had no pages for, slots that ran out (0 while
  # the host's reservations hold; the tests check it)


def _prompt_first(cache: KVCache) -> tuple[Any, Any]:
  """A prefix's keys and values with its real tokens first, in order: JetStream's start marker
  (a masked slot before the prompt) must not take a page position, since paged attention reads
  a slot's first `length` positions with no mask."""
  order_S = jnp.argsort(~cache.valid[0], stable=True)
  return (jax.tree.map(lambda k: jnp.take(k, order_S, axis=-1), cache.k),  # [.., K, E, S]
          jax.tree.map(lambda v: jnp.take(v, order_S, axis=-2), cache.v))  # [.., K, S, E]


@functools.partial(jax.jit, static_argnames=("graphdef", "num_slots", "paged", "cache_length",
                                             "mesh"))
def init_paged_program(state: nnx.State, *, graphdef: nnx.GraphDef, num_slots: int,
                       paged: PagedSpec, cache_length: int, mesh: Mesh | None
                       ) -> PagedDecodeState:
  with shd.activation_sharding(mesh, shd.SAMPLE_RULES):
    model = nnx.merge(graphdef, state)
    pool = model.init_paged_cache(num_slots, paged.num_pages, paged.page_size,
                                  paged.max_pages(cache_length))
    heads = lambda x: shd.constrain(x, ("kv_heads", None, None, None))  # as the slots' KV
    pool = pool.replace(k=per_layer(heads, pool.k), v=per_layer(heads, pool.v))
    decode = sl.empty_decode_state(model, num_slots, 1).replace(cache=pool)
  return PagedDecodeState(decode=decode, active=jnp.zeros((num_slots,), bool),
                          lost=jnp.zeros((), jnp.int32))


@functools.partial(jax.jit, donate_argnames=("decode_state",))
def insert_paged_program(prefix: Prefix, decode_state: PagedDecodeState, slot_1
                         ) -> PagedDecodeState:
  """The slot's old pages are freed, the prompt's real tokens written into fresh pages."""
  TRACES.record("insert_paged")
  d = decode_state.decode
  n = d.token.shape[0]
  cache = paged_kv.free_slots(d.cache, jnp.arange(n) == slot_1[0])
  length_1 = prefix.position  # real prompt tokens
  cache, pages_M, ok = paged_kv.alloc(cache, length_1[0])
  k, v = _prompt_first(prefix.cache)
  cache = paged_kv.write_prompts(cache, pages_M[None], k, v, length_1)
  cache = paged_kv.attach(cache, jnp.where(ok, slot_1, n), pages_M[None], length_1)
  cache = paged_kv.release(cache, pages_M[None])  # the slot's hold is now the only one
  put = lambda dst, src: dst.at[slot_1].set(src, mode="drop")
  decode = DecodeState(cache=cache, token=put(d.token, prefix.token),
                       logprob=put(d.logprob, prefix.logprob),
                       position=put(d.position, prefix.position),
                       length=put(d.length, jnp.zeros_like(prefix.token)),
                       key=put(d.key, prefix.key))
  return PagedDecodeState(decode=decode, active=put(decode_state.active, ok[None]),
                          lost=decode_state.lost + (~ok).astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=_STATIC + ("impl",), donate_argnames=("decode_state",))
def generate_paged_program(state: nnx.State, decode_state: PagedDecodeState, *,
                           graphdef: nnx.GraphDef, sampling: SamplingParams, mesh: Mesh | None,
                           impl: str) -> tuple[PagedDecodeState, jax.Array]:
  """One paged decode step of the active slots; a slot that emits a stop token (`sampling.
  eos_ids`) or its `max_new_tokens`-th token gives its pages back. Finished and empty slots
  emit invalid tokens."""
  TRACES.record("generate_paged")
  active_N = decode_state.active
  with shd.activation_sharding(mesh, shd.SAMPLE_RULES):
    new, token_N, logprob_N, ok_N, short_N = sl.decode_step_paged(
        nnx.merge(graphdef, state), decode_state.decode, active_N, sampling, impl)
  end_N = (ok_N & (is_stop(token_N, sampling.eos_ids) | (new.length >= sampling.max_new_tokens))
           | short_N)
  new = new.replace(cache=paged_kv.free_slots(new.cache, end_N))
  data_Nx4 = jnp.stack([token_N, ok_N.astype(jnp.int32), new.length,
                        jax.lax.bitcast_convert_type(logprob_N, jnp.int32)], axis=-1)
  return PagedDecodeState(decode=new, active=active_N & ~end_N,
                          lost=decode_state.lost + short_N.sum(dtype=jnp.int32)), data_Nx4


# --- tokenizer adapter ------------------------------------------------------------------------


class JetStreamTokenizer(tokenizer_api.Tokenizer):
  """Adapts a `dapo_jax.tokenizers.Tokenizer` to JetStream's tokenizer interface.

  Streaming detokenisation decodes one id at a time (as JetStream does): a character split over
  several byte-level tokens arrives as U+FFFD in `text`; `token_ids` are always exact.
  """

  def __init__(self, tokenizer: Any):
    self.tokenizer = tokenizer

  def encode(self, s: str, **kwargs) -> tuple[jax.Array | np.ndarray, int]:
    ids = np.asarray(self.tokenizer.encode(s), np.int32)
    return token_utils.pad_tokens(
        ids, self.bos_id, self.pad_id, is_bos=kwargs.get("is_bos", True),
        prefill_lengths=kwargs.get("prefill_lengths"),
        max_prefill_length=kwargs.get("max_prefill_length"),
        jax_padding=kwargs.get("jax_padding", True))

  def decode(self, token_ids: list[int], **kwargs) -> str:
    del kwargs  # is_streaming: one id decodes the same either way here
    return self.tokenizer.decode([int(t) for t in token_ids])

  @property
  def pad_id(self) -> int:
    return int(self.tokenizer.pad_id)

  @property
  def eos_id(self) -> int:
    return int(self.tokenizer.eos_id)

  @property
  def bos_id(self) -> int:
    return NO_TOKEN

  @property
  def stop_tokens(self) -> set[int]:
    # The checkpoint's stop set (e.g. <|im_end|> and <|endoftext|>), as the static sampler uses;
    # JetStream's default {eos, pad} would stop the char tokenizer on <pad> and miss <|im_end|>.
    return {int(t) for t in self.tokenizer.eos_ids}


# --- the engine -------------------------------------------------------------------------------


class QwenEngine(engine_api.Engine):
  """JetStream engine for a `Qwen2ForCausalLM`.

  Args:
    model: the policy; its state is split once and passed to every program.
    tokenizer: a `dapo_jax.tokenizers.Tokenizer`; when None, `build_tokenizer` loads
      `tokenizer_path` with `dapo_jax.tokenizers.load_tokenizer`.
    max_concurrent_decodes: decode slots N.
    max_prefill_length: longest prompt (a JetStream bucket: 16, 32, ..., 32768).
    sampling: temperature / top_p / top_k; `max_new_tokens` sizes the cache (a longer request
      ends with an invalid token). Default: greedy, 256 new tokens.
    seed: base of the per-request keys (request i uses fold_in(fold_in(key(seed), i), 0)).
    mesh: optional device mesh; parameters are laid out with `SAMPLE_RULES`.
    kv_cache: "paged", "dense" or "auto" (paged on TPU and GPU, and on CPU from
      `paged_kv.PAGED_MIN_CACHE_LENGTH_CPU` positions per slot), as `rollout.kv_cache`.
    page_size, attention_impl: the paged cache's tokens per page and decode attention kernel.
    kv_pages: pages in the pool; 0: every slot at full length (no insert can then run out).
      Sized by slots, not by `rollout.kv_hbm_fraction`: JetStream cannot preempt a request.
    Paged, a slot also stops at the stop tokens (`sampling.eos_ids`, else the tokenizer's).
  """

  def __init__(self, model: Qwen2ForCausalLM, tokenizer: Any = None, *,
               max_concurrent_decodes: int = 8, max_prefill_length: int = 128,
               sampling: SamplingParams | None = None, seed: int = 0,
               mesh: Mesh | None = None, tokenizer_path: str = "", kv_cache: str = "auto",
               page_size: int = 64, kv_pages: int = 0, attention_impl: str = "auto"):
    if max_prefill_length not in PREFILL_BUCKETS:
      raise ValueError(f"max_prefill_length={max_prefill_length} must be one of JetStream's "
                       f"prefill buckets {PREFILL_BUCKETS}.")
    if max_concurrent_decodes < 1:
      raise ValueError(f"max_concurrent_decodes must be >= 1, got {max_concurrent_decodes}.")
    self.graphdef, state = nnx.split(model)
    self.config = model.config
    self._mesh = mesh if mesh is not None else shd.make_mesh(devices=jax.devices()[:1])
    if self._mesh.size > 1:
      state = jax.device_put(state, shd.state_shardings(state, self._mesh, shd.SAMPLE_RULES))
    self._state = state
    self._program_mesh = self._mesh if self._mesh.size > 1 else None
    self._tokenizer = tokenizer
    self.tokenizer_path = tokenizer_path
    self.sampling = sampling or SamplingParams(temperature=0.0)
    self._num_slots = max_concurrent_decodes
    self._max_prefill_length = max_prefill_length
    self.cache_length = max_prefill_length + self.sampling.max_new_tokens
    self._base_key = jax.random.key_data(jax.random.key(seed))
    self._num_prefills = 0  # only JetStream's prefill thread calls `prefill`
    self.paged = self._paged_spec(kv_cache, page_size, kv_pages, attention_impl)
    if self.paged is not None and not self.sampling.eos_ids and tokenizer is not None:
      self.sampling = dataclasses.replace(self.sampling, eos_ids=tuple(tokenizer.eos_ids))
    # Pages each slot may reach (prompt bucket + max_new_tokens), set by `insert`: their sum
    # stays within the pool, so no decode step runs out (only JetStream's generate thread
    # inserts, into the one decode state it holds).
    self._reserved = np.zeros((max_concurrent_decodes,), np.int64)

  def _paged_spec(self, kv_cache: str, page_size: int, kv_pages: int,
                  attention_impl: str) -> PagedSpec | None:
    paged_attention.resolve_paged_impl(attention_impl)  # an unknown name fails here
    if paged_kv.resolve_kv_cache(kv_cache, self.cache_length) == "dense":
      return None
    if page_size < 1 or kv_pages < 0:
      raise ValueError(f"page_size ({page_size}) must be >= 1 and kv_pages ({kv_pages}) >= 0.")
    full = paged_kv.pages_for(self.cache_length, page_size)
    if 0 < kv_pages < full:
      raise ValueError(
          f"rollout.kv_pages={kv_pages} pages of {page_size} tokens cannot hold one request of "
          f"max_prefill_length + max_new_tokens = {self.cache_length} tokens; use at least "
          f"{full} ({self._num_slots * full} hold every slot at full length).")
    return PagedSpec(num_pages=kv_pages or self._num_slots * full, page_size=page_size,
                     impl=attention_impl)

  def _reserve(self, decode_state: PagedDecodeState, slot: int, bucket: int) -> None:
    """Reserves the pages `slot` may reach with a prompt of at most `bucket` tokens; raises
    when the pool cannot hold them besides the other slots' reservations."""
    t, pool = self.paged.page_size, self.paged.num_pages
    need = paged_kv.pages_for(bucket + self.sampling.max_new_tokens, t)
    others = lambda: int(self._reserved.sum() - self._reserved[slot])
    if others() + need > pool:  # slots that finished since gave their pages back: look
      self._reserved[~np.asarray(decode_state.active)] = 0
      if others() + need > pool:
        raise RuntimeError(
            f"The paged KV pool (rollout.kv_pages={pool} pages of {t} tokens) cannot take a "
            f"request into slot {slot}: it may reach {need} pages ({bucket}-token prompt bucket "
            f"+ max_new_tokens={self.sampling.max_new_tokens}) and the running requests hold "
            f"{others()}; raise rollout.kv_pages (0: every slot at full length) or lower "
            "max_concurrent_decodes.")
    self._reserved[slot] = need

  # --- accelerator functions --------------------------------------------------------------

  def load_params(self, *args, **kwargs) -> nnx.State:
    del args, kwargs  # the weights were loaded when the model was built
    return self._state

  def prefill(self, *, params: nnx.State, existing_prefix: Prefix | None = None,
              padded_tokens: jax.Array, true_length: int) -> Prefix:
    if existing_prefix is not None:
      raise NotImplementedError("QwenEngine does not continue from an existing prefix.")
    tokens_1xP = jnp.asarray(padded_tokens, jnp.int32).reshape(1, -1)
    if tokens_1xP.shape[1] > self._max_prefill_length:
      raise ValueError(f"Prefill of {tokens_1xP.shape[1]} tokens exceeds max_prefill_length="
                       f"{self._max_prefill_length}.")
    request = np.array([[self._num_prefills, 0]], np.int32)
    self._num_prefills += 1
    return prefill_program(params, tokens_1xP, np.array([true_length], np.int32),
                           self._base_key, request, graphdef=self.graphdef,
                           sampling=self.sampling, mesh=self._program_mesh)

  def insert(self, prefix: Prefix, decode_state: DecodeState | PagedDecodeState, slot: int
             ) -> DecodeState | PagedDecodeState:
    if self.paged is None:
      return insert_program(prefix, decode_state, np.array([slot], np.int32))
    self._reserve(decode_state, slot, prefix.cache.max_length)
    return insert_paged_program(prefix, decode_state, np.array([slot], np.int32))

  def generate(self, params: nnx.State, decode_state: DecodeState | PagedDecodeState
               ) -> tuple[DecodeState | PagedDecodeState, QwenResultTokens]:
    if self.paged is None:
      decode_state, data = generate_program(params, decode_state, graphdef=self.graphdef,
                                            sampling=self.sampling, mesh=self._program_mesh)
    else:
      decode_state, data = generate_paged_program(
          params, decode_state, graphdef=self.graphdef, sampling=self.sampling,
          mesh=self._program_mesh, impl=self.paged.impl)
    return decode_state, QwenResultTokens(
        data=data, tokens_idx=(_TOKEN, _TOKEN + 1), valid_idx=(_VALID, _VALID + 1),
        length_idx=(_LENGTH, _LENGTH + 1), samples_per_slot=1)

  def init_decode_state(self, *args, **kwargs) -> DecodeState | PagedDecodeState:
    del args, kwargs
    if self.paged is None:
      return init_program(self._state, graphdef=self.graphdef, num_slots=self._num_slots,
                          cache_length=self.cache_length)
    self._reserved[:] = 0
    return init_paged_program(self._state, graphdef=self.graphdef, num_slots=self._num_slots,
                              paged=self.paged, cache_length=self.cache_length,
                              mesh=self._program_mesh)

  def get_prefix_destination_sharding(self) -> Any:
    # A prefix is small (one prompt's cache); replicated is a valid layout on any mesh.
    return NamedSharding(self._mesh, PartitionSpec())

  # --- tokenizer --------------------------------------------------------------------------

  def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
    return tokenizer_pb2.TokenizerParameters(path=self.tokenizer_path, extra_ids=0)

  def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> JetStreamTokenizer:
    if self._tokenizer is None:
      from dapo_jax.tokenizers import load_tokenizer  # pylint: disable=g-import-not-at-top
      self._tokenizer = load_tokenizer(metadata.path or None)
    return JetStreamTokenizer(self._tokenizer)

  # --- capacity ---------------------------------------------------------------------------

  @property
  def max_concurrent_decodes(self) -> int:
    return self._num_slots

  @property
  def samples_per_slot(self) -> int:
    return 1

  @property
  def max_prefill_length(self) -> int:
    return self._max_prefill_length

  @property
  def mesh(self) -> Mesh:
    return self._mesh

  @property
  def colocated_cpus(self) -> None:
    return None


def response_tokens(results: Iterable[QwenResultTokens], slot: int) -> tuple[list[int],
                                                                             list[float]]:
  """Valid (token, log-prob) pairs of one slot across a sequence of `generate` results."""
  tokens, logprobs = [], []
  for r in results:
    r = r.convert_to_numpy()
    data = r.get_result_at_slot(slot)
    if data.valid[0, 0]:
      tokens.append(int(data.tokens[0, 0]))
      logprobs.append(float(r.get_logprobs_at_slot(slot)[0, 0]))
  return tokens, logprobs
