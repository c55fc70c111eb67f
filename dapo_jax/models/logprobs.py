"""Response-token log-probs and entropy, computed without [B, T, V] logits.

The policy loss needs, per response token, `log softmax(z / temperature)` at
the sampled token and the entropy of that distribution (spec section 4). With
a 152k vocabulary and 20k-token responses, full fp32 logits of a whole batch
do not fit in memory. So the model runs to its final hidden states once, and
a `lax.scan` over chunks of the response computes each chunk's logits,
reduces them to [B, C] statistics, and drops them. The chunk body is under
`jax.checkpoint`, so the backward pass recomputes one chunk's logits at a time
instead of saving all of them. `forward_log_probs` is the no-grad version
for old and reference log-probs, run in micro-batches.

Shapes: B sequences, L = P + R prompt plus response tokens, R response tokens,
C chunk length, D hidden, V vocabulary.

`token_log_probs` is the one log-prob formula: the trainer's chunks and the sampler
(`rollout.sampling.sample_logits`) both call it, so equal logits give bit-equal log-probs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from dapo_jax.infra.sharding import constrain
from dapo_jax.models import default_positions


def fixed_order_sum(x_xN: jax.Array, radix: int = 16) -> jax.Array:
  """Sum over the last axis in an order fixed by its length alone: the axis, zero-padded to a
  multiple of ``radix``, is cut into ``radix`` equal blocks that are added elementwise left to
  right, until one value is left (log_radix N rounds).

  `jnp.sum` lets XLA pick the accumulation order by the whole shape: on CPU the same row summed
  in a [B, V] array and in a [B, C, V] one differed by 1 ULP on 10-18% of rows (measured, tiny
  model). Elementwise adds have one rounding each, so this sum is the same bits for a row
  whatever the other axes are (a decode step's [N, V], a training chunk's [B, C, V]). Radix 16
  (each round one fused pass) took about half the time of pairwise halving at V = 151,936.
  """
  x = x_xN
  while x.shape[-1] > 1:
    width = -(-x.shape[-1] // radix)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, radix * width - x.shape[-1])])
    blocks = x.reshape(*x.shape[:-1], radix, width)
    acc = blocks[..., 0, :]
    for i in range(1, radix):
      acc = acc + blocks[..., i, :]
    x = acc
  return x[..., 0]


def token_log_probs(logits_xV: jax.Array, targets_x: jax.Array, *,
                    temperature: float = 1.0) -> jax.Array:
  """``log softmax(logits / temperature)`` at ``targets`` (fp32), the ONE formula of the
  sampler and the trainer (issue 29): ``(z_t - m) - log(sum_v exp(z_v - m))``, m = max_v z_v.

  Any leading shape (``[N, V]`` in a decode step, ``[B, C, V]`` in a training chunk). The two
  sides used to differ here by up to 2 ULP on equal logits: log_softmax-and-gather rounds
  ``z_t - m`` first, ``z_t - logsumexp(z)`` rounds ``m + log(...)`` first. The target is a
  masked sum, not a gather: exact (it adds zeros) and local when the vocabulary is split over
  the tensor axis. ``temperature`` 1.0 skips the division (x / 1 is exact anyway).
  """
  z = logits_xV.astype(jnp.float32)
  if temperature != 1.0:
    z = z / temperature
  # The max only shifts: no gradient through it (as jax.nn.log_softmax).
  shifted = z - jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
  log_norm = jnp.log(fixed_order_sum(jnp.exp(shifted)))
  vocab = jax.lax.broadcasted_iota(jnp.int32, shifted.shape, shifted.ndim - 1)
  # One non-zero term: exact in any order.
  target = jnp.sum(jnp.where(vocab == targets_x[..., None], shifted, 0.0), axis=-1)
  return target - log_norm


def _chunk_stats(h_BxCxD: jax.Array, targets_BxC: jax.Array,
                 w_DxV: jax.Array, *, temperature: float,
                 entropy_grad: bool) -> tuple[jax.Array, jax.Array]:
  """Log-prob of each target and entropy, for one chunk (fp32)."""
  # Same numerics as Qwen2ForCausalLM.logits_from_hidden: matmul in the
  # compute dtype, fp32 accumulation.
  z_BxCxV = jnp.einsum("bcd,dv->bcv", h_BxCxD, w_DxV.astype(h_BxCxD.dtype),
                       preferred_element_type=jnp.float32)
  z_BxCxV = constrain(z_BxCxV, ("batch", "length", "act_vocab"))
  # spec 4: at the rollout temperature; the sampler's own formula (bit-equal on equal logits).
  logp_BxC = token_log_probs(z_BxCxV, targets_BxC, temperature=temperature)
  z_BxCxV = z_BxCxV / temperature
  # Entropy is a metric unless an entropy bonus is on: no gradient through it
  # then, so the backward pass does no work for it.
  z_ent = z_BxCxV if entropy_grad else jax.lax.stop_gradient(z_BxCxV)
  return logp_BxC, entropy_from_logits(z_ent)


def chunked_token_stats(h_BxRxD: jax.Array, w_DxV: jax.Array,
                        targets_BxR: jax.Array, *, temperature: float = 1.0,
                        chunk_size: int = 512, entropy_grad: bool = False
                        ) -> tuple[jax.Array, jax.Array]:
  """Token log-probs and entropies from hidden states, `chunk_size` at a time.

  Args:
    h_BxRxD: hidden state that predicts each target (position t-1 for token t).
    w_DxV: output projection (`model.lm_head_kernel()`).
    targets_BxR: int token ids.
    temperature: logits are divided by it (the rollout temperature).
    chunk_size: sequence positions per chunk; any value >= 1 (the last chunk
      is padded). Peak extra memory is about 4 x B x chunk_size x V x 4 bytes.
      0 (or >= R) computes all logits at once (the reference path).
    entropy_grad: whether gradients flow through the entropy.

  Returns:
    (log_probs_BxR, entropy_BxR), float32.
  """
  stats = functools.partial(_chunk_stats, temperature=temperature,
                            entropy_grad=entropy_grad)
  # Cast once, not in every chunk (fp32 master weights of a bf16-compute model).
  w_DxV = w_DxV.astype(h_BxRxD.dtype)
  b, r, d = h_BxRxD.shape
  if chunk_size <= 0 or chunk_size >= r:
    return stats(h_BxRxD, targets_BxR, w_DxV)
  n = -(-r // chunk_size)
  pad = n * chunk_size - r
  # Zero hidden states and token 0 in the padding: finite, sliced off below.
  h = jnp.pad(h_BxRxD, ((0, 0), (0, pad), (0, 0)))
  t = jnp.pad(targets_BxR, ((0, 0), (0, pad)))
  # Chunks on the leading (scanned) axis; the batch axis keeps its sharding.
  h_NxBxCxD = jnp.moveaxis(h.reshape(b, n, chunk_size, d), 1, 0)
  t_NxBxC = jnp.moveaxis(t.reshape(b, n, chunk_size), 1, 0)
  body = jax.checkpoint(stats)  # Backward recomputes a chunk's logits.

  def step(carry, xs):
    return carry, body(xs[0], xs[1], w_DxV)

  _, (logp_NxBxC, ent_NxBxC) = jax.lax.scan(step, None, (h_NxBxCxD, t_NxBxC))
  unchunk = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, n * chunk_size)[:, :r]
  return unchunk(logp_NxBxC), unchunk(ent_NxBxC)


def response_log_probs(model: nnx.Module, input_ids_BxL: jax.Array,
                       attention_mask_BxL: jax.Array,
                       positions_BxL: jax.Array | None, response_len: int, *,
                       temperature: float = 1.0, chunk_size: int = 512,
                       entropy_grad: bool = False
                       ) -> tuple[jax.Array, jax.Array]:
  """Log-probs and entropy of the last `response_len` tokens of each row.

  Rows are a left-padded prompt of fixed length P followed by a right-padded
  response of length R = `response_len`; token P + t is predicted by the
  hidden state at P + t - 1.

  Returns:
    (log_probs_BxR, entropy_BxR), float32; values at response padding are
    finite but meaningless (mask them).
  """
  seq_len = input_ids_BxL.shape[1]
  prompt_len = seq_len - response_len
  if prompt_len < 1:
    raise ValueError(
        f"input_ids has {seq_len} tokens but the response has {response_len}: "
        f"each row needs at least one prompt token before the response.")
  if positions_BxL is None:
    positions_BxL = default_positions(attention_mask_BxL)
  h_BxLxD, _ = model.hidden_states(input_ids_BxL, positions_BxL,
                                   attention_mask_BxL)
  h_BxRxD = h_BxLxD[:, prompt_len - 1:seq_len - 1]
  return chunked_token_stats(h_BxRxD, model.lm_head_kernel(),
                             input_ids_BxL[:, prompt_len:],
                             temperature=temperature, chunk_size=chunk_size,
                             entropy_grad=entropy_grad)


def packed_response_log_probs(model: nnx.Module, input_ids_BxL: jax.Array,
                              positions_BxL: jax.Array, segment_ids_BxL: jax.Array,
                              token_index_CxR: jax.Array, num_shards: int, *,
                              temperature: float = 1.0, chunk_size: int = 512,
                              entropy_grad: bool = False) -> tuple[jax.Array, jax.Array]:
  """`response_log_probs` of packed rows (trainer/packing.py), back in the row layout.

  The B packed rows hold several sequences each (``segment_ids``, positions restarting per
  sequence); the pass computes every position's next-token log-prob and entropy ([B, L]), and
  ``token_index`` [C, R] picks each response token's from the position before it: an index into
  one shard's packed rows flattened (the batch axis is ``num_shards`` equal blocks of rows, as
  the batch sharding lays them, and the C rows too), so the gather stays on its shard.

  Returns:
    (log_probs_CxR, entropy_CxR), float32; values where the index is a placeholder are finite
    but meaningless (mask them).
  """
  b, seq_len = input_ids_BxL.shape
  h_BxLxD, _ = model.hidden_states(input_ids_BxL, positions_BxL, segment_ids_BxT=segment_ids_BxL)
  # Position p predicts token p + 1 (across a segment's end the value is never gathered).
  targets_BxL = jnp.pad(input_ids_BxL[:, 1:], ((0, 0), (0, 1)))
  logp_BxL, ent_BxL = chunked_token_stats(h_BxLxD, model.lm_head_kernel(), targets_BxL,
                                          temperature=temperature, chunk_size=chunk_size,
                                          entropy_grad=entropy_grad)
  c, r = token_index_CxR.shape
  if b % num_shards or c % num_shards:
    raise ValueError(f"{b} packed rows and {c} sequence slots must split into {num_shards} "
                     f"shards (trainer/packing.py lays them out so).")
  idx_SxN = token_index_CxR.reshape(num_shards, (c // num_shards) * r)

  def gather(x_BxL):
    x_SxM = x_BxL.reshape(num_shards, (b // num_shards) * seq_len)
    return jnp.take_along_axis(x_SxM, idx_SxN, axis=1, mode="clip").reshape(c, r)

  return gather(logp_BxL), gather(ent_BxL)


def split_micro(x: jax.Array, num_micro: int) -> jax.Array:
  """[B, ...] -> [num_micro, B / num_micro, ...], row i to micro-batch i % n.

  Strided, not blocked: each device's contiguous slice of a batch sharded
  over the data axes stays on that device in every micro-batch.
  """
  b = x.shape[0]
  if b % num_micro:
    raise ValueError(f"Batch of {b} rows does not split into {num_micro} "
                     f"micro-batches; pick a divisor of the batch size.")
  return jnp.swapaxes(x.reshape(b // num_micro, num_micro, *x.shape[1:]), 0, 1)


def merge_micro(x: jax.Array) -> jax.Array:
  """Inverse of `split_micro`."""
  n, m = x.shape[:2]
  return jnp.swapaxes(x, 0, 1).reshape(n * m, *x.shape[2:])


def forward_log_probs(graphdef: nnx.GraphDef, params: nnx.State, rest: nnx.State,
                      input_ids_BxL: jax.Array, attention_mask_BxL: jax.Array,
                      positions_BxL: jax.Array | None, response_len: int, *,
                      temperature: float = 1.0, chunk_size: int = 512,
                      micro_batch_size: int = 0) -> tuple[jax.Array, jax.Array]:
  """No-grad [B, R] log-probs and entropy (old or reference policy, spec 6.2).

  Runs `micro_batch_size` rows at a time (a `lax.map`; 0: all at once) to bound
  activation memory.
  """
  params = jax.lax.stop_gradient(params)
  if positions_BxL is None:
    positions_BxL = default_positions(attention_mask_BxL)
  rows = (input_ids_BxL, attention_mask_BxL, positions_BxL)

  def one(weights, xs):
    ids, attn, pos = (constrain(x, ("batch", None)) for x in xs)
    model = nnx.merge(graphdef, *weights)
    return response_log_probs(model, ids, attn, pos, response_len, temperature=temperature,
                              chunk_size=chunk_size)

  b = input_ids_BxL.shape[0]
  if micro_batch_size <= 0 or micro_batch_size >= b:
    return one((params, rest), rows)
  if b % micro_batch_size:
    raise ValueError(f"forward_micro_batch_size={micro_batch_size} does not divide the "
                     f"batch of {b} rows.")
  # The weights ride in the loop carry, unchanged: the model is then built from values of the
  # loop body's own trace, which `nnx.remat` requires (closed-over weights raise
  # TraceContextError with rematerialisation on).
  _, out = jax.lax.scan(lambda w, xs: (w, one(w, xs)), (params, rest),
                        tuple(split_micro(x, b // micro_batch_size) for x in rows))
  return tuple(merge_micro(x) for x in out)


def forward_packed_log_probs(graphdef: nnx.GraphDef, params: nnx.State, rest: nnx.State,
                             input_ids_BxL: jax.Array, positions_BxL: jax.Array,
                             segment_ids_BxL: jax.Array, token_index_CxR: jax.Array,
                             num_shards: int, *, temperature: float = 1.0,
                             chunk_size: int = 512, num_micro: int = 1
                             ) -> tuple[jax.Array, jax.Array]:
  """No-grad `packed_response_log_probs` ([C, R] log-probs and entropy), in ``num_micro``
  micro-batches of the packed rows (a `lax.scan`; the packer lays the rows out for the update's
  micro-batches, `split_micro`'s strided order, so the same split serves here)."""
  params = jax.lax.stop_gradient(params)
  packed = (input_ids_BxL, positions_BxL, segment_ids_BxL)

  def one(weights, xs, idx):
    ids, pos, seg = (constrain(x, ("batch", None)) for x in xs)
    model = nnx.merge(graphdef, *weights)
    return packed_response_log_probs(model, ids, pos, seg, constrain(idx, ("batch", None)),
                                     num_shards, temperature=temperature, chunk_size=chunk_size)

  if num_micro <= 1:
    return one((params, rest), packed, token_index_CxR)
  xs = (tuple(split_micro(x, num_micro) for x in packed), split_micro(token_index_CxR, num_micro))
  _, out = jax.lax.scan(lambda w, x: (w, one(w, *x)), (params, rest), xs)
  return tuple(merge_micro(x) for x in out)


def forward_with_reference(graphdef: nnx.GraphDef, params: nnx.State, ref_params: nnx.State,
                           rest: nnx.State, input_ids_BxL: jax.Array,
                           attention_mask_BxL: jax.Array, positions_BxL: jax.Array | None,
                           response_len: int, **kwargs) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Old log-probs and entropy of ``params`` and the reference policy's log-probs, in one
  program (spec 6.2): ``(old_BxR, entropy_BxR, ref_BxR)``. ``kwargs`` as `forward_log_probs`."""
  rows = (input_ids_BxL, attention_mask_BxL, positions_BxL)
  old_BxR, ent_BxR = forward_log_probs(graphdef, params, rest, *rows, response_len, **kwargs)
  ref_BxR, _ = forward_log_probs(graphdef, ref_params, rest, *rows, response_len, **kwargs)
  return old_BxR, ent_BxR, ref_BxR


def entropy_from_logits(logits: jax.typing.ArrayLike) -> jax.Array:
  """Entropy over the last axis: logsumexp(z) - sum(softmax(z) * z) (spec 4).

  Divide the logits by the rollout temperature first. Computed in float32;
  logsumexp subtracts the max, so large logits do not overflow.
  """
  z = jnp.asarray(logits, jnp.float32)
  lse = jax.nn.logsumexp(z, axis=-1)
  p = jax.nn.softmax(z, axis=-1)
  return lse - jnp.sum(p * z, axis=-1)
