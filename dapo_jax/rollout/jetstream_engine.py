"""Qwen2.5 behind JetStream's `Engine` API: a slot-based KV cache with prefill / insert / generate.

A decode state holds `max_concurrent_decodes` rows (slots) of one KV cache; rows sit at different
cache indices. `prefill` runs one prompt (right-padded to a bucket) and samples its first response
token; `insert` copies that prefix into a slot; `generate` feeds every slot's pending token and
samples the next. All three are module-level programs compiled once per shape, with the model
state passed as an argument and the decode state donated. The pure pieces behind them (prefill,
insert, one decode step through the model's `decode_step`) are in `rollout/slots.py`.

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
"""

from __future__ import annotations

import functools
from typing import Any, Iterable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dapo_jax import sharding as shd
from dapo_jax.models.qwen2 import Qwen2ForCausalLM
from dapo_jax.rollout import slots as sl
from dapo_jax.rollout.jetstream_api import engine_api, token_utils, tokenizer_api, tokenizer_pb2
from dapo_jax.rollout.sampling import SamplingParams, request_keys
from dapo_jax.rollout.slots import PREFILL_BUCKETS, DecodeState, Prefix
from dapo_jax.tracing import TraceCounter

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
  """

  def __init__(self, model: Qwen2ForCausalLM, tokenizer: Any = None, *,
               max_concurrent_decodes: int = 8, max_prefill_length: int = 128,
               sampling: SamplingParams | None = None, seed: int = 0,
               mesh: Mesh | None = None, tokenizer_path: str = ""):
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

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
    return insert_program(prefix, decode_state, np.array([slot], np.int32))

  def generate(self, params: nnx.State, decode_state: DecodeState
               ) -> tuple[DecodeState, QwenResultTokens]:
    decode_state, data = generate_program(params, decode_state, graphdef=self.graphdef,
                                          sampling=self.sampling, mesh=self._program_mesh)
    return decode_state, QwenResultTokens(
        data=data, tokens_idx=(_TOKEN, _TOKEN + 1), valid_idx=(_VALID, _VALID + 1),
        length_idx=(_LENGTH, _LENGTH + 1), samples_per_slot=1)

  def init_decode_state(self, *args, **kwargs) -> DecodeState:
    del args, kwargs
    return init_program(self._state, graphdef=self.graphdef, num_slots=self._num_slots,
                        cache_length=self.cache_length)

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
