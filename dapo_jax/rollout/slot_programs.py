"""The continuous-batching engine's compiled programs: a queue of prefilled prompts and N slots.

Shapes: Q queued prompts, G samples per prompt, P prompt slots, N decode slots, S = P + R cache
slots, K decode steps per chunk, A most slots admitted per step.

* `init_program`: an empty queue and N empty slots (slots laid out over the batch axes).
* `enqueue_program`: prefills M prompts ONCE each into free queue entries (their cache and the
  hidden state of their last token); their G samples wait there for slots.
* `chunk_program`: a `lax.while_loop` of up to K steps. Each step first admits queued samples
  into the free slots (first come, first served: the prompt's cache row is copied, in place,
  into each of its samples' slots and the sample's first token drawn from the prompt's hidden
  state), then runs one `slots.decode_step` over all N slots (the static sampler's
  `model.decode_step`). Every live slot emits the token it feeds; a slot frees itself after its
  stop token or budget.
  The loop ends after K steps, when nothing is left to decode, or when the queue runs dry while
  a slot is free and the host has prompts to enqueue. Its outputs are replicated, so the host
  reads them (once per chunk) on every process.

The host driver is `rollout/continuous.py`.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from dapo_jax import sharding as shd
from dapo_jax.models.kv_cache import KVCache, per_layer
from dapo_jax.rollout import slots as sl
from dapo_jax.rollout.sampling import SamplingParams, is_stop, request_keys
from dapo_jax.tracing import TraceCounter

TRACES = TraceCounter()  # per program: tests assert no retrace
EMPTY_SEQ = jnp.iinfo(jnp.int32).max  # `seq` of a free queue entry (sorts last)
SMALL_ADMIT = 4  # admission variant for steps with few free slots


@flax.struct.dataclass
class Queue:
  """Q prefilled prompts whose samples wait for slots."""
  cache: KVCache  # [Q, P]
  hidden: jax.Array  # [Q, D] hidden state at the prompt's last token
  position: jax.Array  # [Q] int32 prompt tokens = position of the first response token
  key_id: jax.Array  # [Q] int32 prompt index (first fold of the request keys)
  seq: jax.Array  # [Q] int32 admission order; EMPTY_SEQ when free
  budget: jax.Array  # [Q, G] int32 per-sample response budgets
  placed: jax.Array  # [Q] int32 samples already in slots (G: all placed, or free)


@flax.struct.dataclass
class Slots:
  """N decode slots and who holds them."""
  decode: sl.DecodeState
  live: jax.Array  # [N] bool: holds a sample still generating
  owner: jax.Array  # [N] int32 seq * G + sample of the holder
  count: jax.Array  # [N] int32 tokens emitted
  budget: jax.Array  # [N] int32


@flax.struct.dataclass
class Engine:
  queue: Queue
  slots: Slots


@flax.struct.dataclass
class ChunkOut:
  """What one chunk emitted, replicated: [K, N] with owner -1 where a slot emitted nothing."""
  tokens_KxN: jax.Array
  logprobs_KxN: jax.Array
  owner_KxN: jax.Array
  done_KxN: jax.Array  # the token ended its sample
  steps: jax.Array  # [] decode steps run
  queued: jax.Array  # [Q] samples of each entry not yet in a slot (0: entry free)


_STATIC = ("graphdef", "params", "mesh")


def _slot_rows(x: jax.Array) -> jax.Array:
  return shd.constrain(x, ("batch",) + (None,) * (x.ndim - 1))


def _replicated(x: jax.Array) -> jax.Array:
  return shd.constrain(x, (None,) * x.ndim)


@functools.partial(jax.jit, static_argnames=("graphdef", "num_slots", "queue_size",
                                             "num_samples", "prompt_length", "cache_length",
                                             "mesh"))
def init_program(state, *, graphdef, num_slots: int, queue_size: int, num_samples: int,
                 prompt_length: int, cache_length: int, mesh: Mesh | None) -> Engine:
  TRACES.record("init")
  with shd.activation_sharding(mesh, shd.SAMPLE_RULES):
    model = nnx.merge(graphdef, state)
    decode = sl.empty_decode_state(model, num_slots, cache_length)
    kv = lambda x: shd.constrain(x, ("batch", "kv_heads", None, None))
    decode = decode.replace(cache=decode.cache.replace(
        k=per_layer(kv, decode.cache.k), v=per_layer(kv, decode.cache.v),
        valid=_slot_rows(decode.cache.valid)))
    zn = jnp.zeros((num_slots,), jnp.int32)
    slots = Slots(decode=decode, live=_slot_rows(zn.astype(bool)), owner=_slot_rows(zn - 1),
                  count=_slot_rows(zn), budget=_slot_rows(zn))
    zq = jnp.zeros((queue_size,), jnp.int32)
    # Queue rows are whole on every device (any slot may take any queued prompt, so admission
    # copies rows without collectives) but KV heads split over `tensor` as the slots' do:
    # left to XLA, the queue came out fully replicated (16 GiB per chip for the 32B config).
    heads = lambda x: shd.constrain(x, (None, "kv_heads", None, None))
    qcache = model.init_cache(queue_size, prompt_length)
    qcache = qcache.replace(k=per_layer(heads, qcache.k), v=per_layer(heads, qcache.v))
    queue = Queue(cache=qcache,
                  hidden=jnp.zeros((queue_size, model.config.hidden_size),
                                   model.config.jnp_dtype),
                  position=zq, key_id=zq, seq=zq + EMPTY_SEQ,
                  budget=jnp.zeros((queue_size, num_samples), jnp.int32), placed=zq + num_samples)
  return Engine(queue=queue, slots=slots)


@functools.partial(jax.jit, static_argnames=("graphdef", "mesh"), donate_argnames=("engine",))
def enqueue_program(state, engine: Engine, tokens_MxP, true_length_M, key_id_M, seq_M,
                    budget_MxG, entry_M, *, graphdef, mesh: Mesh | None) -> Engine:
  """Prefills M right-padded prompts into queue entries `entry_M` (Q = padding, dropped)."""
  TRACES.record("enqueue")
  with shd.activation_sharding(mesh, shd.SAMPLE_RULES):
    cache, h_MxD, position_M = sl.prefill_hidden(nnx.merge(graphdef, state), tokens_MxP,
                                                 true_length_M)
  q = engine.queue
  put = lambda dst, src: dst.at[entry_M].set(src.astype(dst.dtype), mode="drop")
  queue = Queue(cache=q.cache.insert(cache, entry_M), hidden=put(q.hidden, h_MxD),
                position=put(q.position, position_M), key_id=put(q.key_id, key_id_M),
                seq=put(q.seq, seq_M), budget=put(q.budget, budget_MxG),
                placed=put(q.placed, jnp.zeros_like(entry_M)))
  return engine.replace(queue=queue)


@flax.struct.dataclass
class _Admission:
  """The samples one step places, padded to `max_admit`: entries past `count` have slot N
  (dropped). Small arrays only: the cache rows are copied by `_place`."""
  slot: jax.Array  # [A] int32
  entry: jax.Array  # [A] int32 queue entry of the prompt
  token: jax.Array  # [A] int32 first response token
  logprob: jax.Array  # [A] fp32
  position: jax.Array  # [A] int32
  key: jax.Array  # [A, 2] uint32
  owner: jax.Array  # [A] int32
  budget: jax.Array  # [A] int32
  count: jax.Array  # [] int32 samples placed (the first `count` entries)
  placed: jax.Array  # [Q] int32 the queue's `placed` after this admission


def _no_admission(engine: Engine, pad_to: int) -> _Admission:
  n, z = engine.slots.live.shape[0], jnp.zeros((pad_to,), jnp.int32)
  return _Admission(slot=z + n, entry=z, token=z, logprob=z.astype(jnp.float32), position=z,
                    key=jnp.zeros((pad_to, 2), jnp.uint32), owner=z - 1, budget=z,
                    count=jnp.zeros((), jnp.int32), placed=engine.queue.placed)


def _choose(model, engine: Engine, base_key_data, params: SamplingParams, max_admit: int,
            pad_to: int) -> _Admission:
  """Up to `max_admit` queued samples, oldest prompt first, for the free slots; their first
  tokens sampled from the prompts' hidden states."""
  q, s = engine.queue, engine.slots
  g, n = q.budget.shape[1], s.live.shape[0]
  free_N = ~s.live
  order_Q = jnp.argsort(q.seq)  # first come, first served
  left_Q = (g - q.placed)[order_Q]
  end_Q = jnp.cumsum(left_Q)
  r_A = jnp.arange(max_admit)
  count = jnp.minimum(jnp.minimum(end_Q[-1], free_N.sum()), max_admit).astype(jnp.int32)
  ok_A = r_A < count
  # The r-th free slot takes the r-th waiting sample.
  slot_A = jnp.where(ok_A, jnp.nonzero(free_N, size=max_admit, fill_value=n)[0], n)
  j_A = jnp.minimum(jnp.searchsorted(end_Q, r_A, side="right"), end_Q.shape[0] - 1)
  entry_A = order_Q[j_A]
  sample_A = q.placed[entry_A] + r_A - (end_Q[j_A] - left_Q[j_A])
  keys_Ax2 = request_keys(base_key_data, jnp.stack([q.key_id[entry_A], sample_A], -1))
  position_A = q.position[entry_A]
  token_A, logprob_A = sl.sample_first(model, q.hidden[entry_A], position_A, keys_Ax2, params)
  pad = lambda x, v: jnp.pad(x, [(0, pad_to - max_admit)] + [(0, 0)] * (x.ndim - 1),
                             constant_values=v)
  return _Admission(slot=pad(slot_A, n), entry=pad(entry_A, 0), token=pad(token_A, 0),
                    logprob=pad(logprob_A, 0), position=pad(position_A, 0),
                    key=pad(keys_Ax2, 0), owner=pad(q.seq[entry_A] * g + sample_A, -1),
                    budget=pad(q.budget[entry_A, jnp.minimum(sample_A, g - 1)], 0), count=count,
                    placed=q.placed.at[entry_A].add(ok_A.astype(jnp.int32)))


def _place(engine: Engine, adm: _Admission) -> Engine:
  """Writes an admission into its slots. The prompts' cache rows are copied one by one by a
  loop of `count` in-place row copies (none on the usual step), never the whole cache."""
  q, s = engine.queue, engine.slots
  d = s.decode
  cache = jax.lax.fori_loop(
      0, adm.count, lambda i, c: c.copy_row(q.cache, adm.entry[i], adm.slot[i], adm.position[i]),
      d.cache)
  put = lambda dst, src: dst.at[adm.slot].set(src.astype(dst.dtype), mode="drop")
  zeros = jnp.zeros_like(adm.slot)
  decode = d.replace(cache=cache, token=put(d.token, adm.token),
                     logprob=put(d.logprob, adm.logprob), position=put(d.position, adm.position),
                     length=put(d.length, zeros), key=put(d.key, adm.key))
  slots = Slots(decode=decode, live=put(s.live, zeros == 0), owner=put(s.owner, adm.owner),
                count=put(s.count, zeros), budget=put(s.budget, adm.budget))
  return Engine(queue=q.replace(placed=adm.placed), slots=slots)


@flax.struct.dataclass
class _Carry:
  step: jax.Array
  engine: Engine
  out: ChunkOut


@functools.partial(jax.jit, static_argnames=_STATIC + ("chunk_steps", "max_admit"),
                   donate_argnames=("engine",))
def chunk_program(state, engine: Engine, base_key_data, host_has_more, *, graphdef,
                  params: SamplingParams, mesh: Mesh | None, chunk_steps: int, max_admit: int
                  ) -> tuple[Engine, ChunkOut]:
  """Up to `chunk_steps` steps of admit + decode; see the module docstring for when it stops."""
  TRACES.record("chunk")
  n, g = engine.slots.live.shape[0], engine.queue.budget.shape[1]
  with shd.activation_sharding(mesh, shd.SAMPLE_RULES):
    model = nnx.merge(graphdef, state)

    def queued(e: Engine) -> jax.Array:
      return (g - e.queue.placed).sum()

    def cond(c: _Carry) -> jax.Array:
      waiting, live = queued(c.engine), c.engine.slots.live
      starved = (waiting == 0) & ~jnp.all(live) & host_has_more
      return (c.step < chunk_steps) & (jnp.any(live) | (waiting > 0)) & ~starved

    def body(c: _Carry) -> _Carry:
      e = c.engine
      # Choosing costs the first-token logits of what it may place, so the usual step, with a
      # slot or two free, takes a small variant. The switch returns small arrays only: a
      # branch returning the engine made XLA copy the whole KV cache twice per step.
      can = jnp.minimum((~e.slots.live).sum(), queued(e))
      sizes = sorted({min(SMALL_ADMIT, max_admit), max_admit})
      branches = [functools.partial(_no_admission, pad_to=max_admit)] + [
          functools.partial(_choose, model, base_key_data=base_key_data, params=params,
                            max_admit=a, pad_to=max_admit) for a in sizes]
      adm = jax.lax.switch(jnp.where(can == 0, 0, jnp.where(can <= sizes[0], 1, len(sizes))),
                           branches, e)
      e = _place(e, adm)
      s = e.slots
      decode, fed_N, lp_N, _ = sl.decode_step(model, s.decode, params)
      count_N = s.count + s.live
      done_N = s.live & (is_stop(fed_N, params.eos_ids) | (count_N >= s.budget))
      put = lambda buf, row: jax.lax.dynamic_update_slice(buf, row[None], (c.step, 0))
      o = c.out
      out = o.replace(tokens_KxN=put(o.tokens_KxN, fed_N),
                      logprobs_KxN=put(o.logprobs_KxN, jnp.where(s.live, lp_N, 0.0)),
                      owner_KxN=put(o.owner_KxN, jnp.where(s.live, s.owner, -1)),
                      done_KxN=put(o.done_KxN, done_N))
      slots = s.replace(decode=decode, live=s.live & ~done_N, count=count_N)
      return _Carry(step=c.step + 1, engine=e.replace(slots=slots), out=out)

    full = lambda v, dtype: jnp.full((chunk_steps, n), v, dtype)
    out = ChunkOut(tokens_KxN=full(0, jnp.int32), logprobs_KxN=full(0.0, jnp.float32),
                   owner_KxN=full(-1, jnp.int32), done_KxN=full(False, bool),
                   steps=jnp.zeros((), jnp.int32), queued=engine.queue.placed)
    last = jax.lax.while_loop(cond, body, _Carry(step=jnp.zeros((), jnp.int32), engine=engine,
                                                 out=out))
    out = last.out.replace(steps=last.step, queued=g - last.engine.queue.placed)
    out = jax.tree.map(_replicated, out)
  return last.engine, out
