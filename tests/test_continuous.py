"""Continuous-batching engine: greedy parity with the static sampler, budgets, in-loop refill,
one prefill per prompt, schedule-independent sampling, the stream interface, a sharded mesh."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dapo_jax.infra import sharding as shd
from dapo_jax.models import create_model, get_preset
from dapo_jax.rollout import continuous
from dapo_jax.rollout import slot_programs as prog
from dapo_jax.rollout.sampler import Sampler
from dapo_jax.rollout.sampling import SamplingParams
from tests.hlo_checks import big_copies

R = 12
G = 3
NUM_SLOTS = 4  # fewer than the 5 x 3 rows: slots are refilled inside the compiled loop
BUDGETS = [3, 9, 1, 12, 5, 12, 2, 7, 12, 4, 12, 6, 1, 8, 12]  # one per row (b*G + g)


def _prompts(b=5):
  """Left-padded prompts of different lengths."""
  rng = np.random.default_rng(0)
  ids = rng.integers(4, 100, (b, 9)).astype(np.int32)
  mask = np.ones_like(ids, bool)
  for i, pad in enumerate(rng.integers(0, 6, b)):
    mask[i, :pad] = False
  return np.where(mask, ids, 0), mask


@pytest.fixture(scope="module")
def reference(split_model):
  """Static-sampler greedy rows and a stop id row 3 emits at its 5th token."""
  graphdef, state = split_model
  ids, mask = _prompts()
  params = SamplingParams(temperature=0.0, max_new_tokens=R)
  out = Sampler(graphdef).generate(state, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(0),
                                   params, num_samples=G)
  return np.asarray(out.response_ids), np.asarray(out.logprobs), int(out.response_ids[3, 4])


def test_greedy_rows_match_the_static_sampler_with_budgets_and_refill(split_model, reference):
  graphdef, state = split_model
  ref_tokens, ref_logprobs, eos = reference
  ids, mask = _prompts()
  params = SamplingParams(temperature=0.0, max_new_tokens=R, eos_ids=(eos,), pad_id=0)
  sampler = continuous.ContinuousSampler(graphdef, num_slots=NUM_SLOTS, chunk_steps=5,
                                         max_prefill_length=16)
  batch = sampler.generate(state, ids, mask, jax.random.key(0), params, num_samples=G,
                           max_new_tokens=BUDGETS)
  stats = sampler.last_stats
  lengths = np.asarray(batch.lengths)
  for i, budget in enumerate(BUDGETS):
    row = ref_tokens[i, :budget].tolist()
    expected = row[:row.index(eos) + 1] if eos in row else row
    assert np.asarray(batch.response_ids[i, :lengths[i]]).tolist() == expected, i
    np.testing.assert_allclose(batch.logprobs[i, :lengths[i]], ref_logprobs[i, :len(expected)],
                               atol=1e-5)
    assert bool(batch.truncated[i]) == (expected[-1] != eos)
  assert not np.all(batch.truncated) and np.any(batch.truncated)  # both endings exercised
  np.testing.assert_array_equal(batch.response_mask, np.arange(R)[None] < lengths[:, None])
  assert np.all(np.asarray(batch.response_ids)[~np.asarray(batch.response_mask)] == 0)
  np.testing.assert_array_equal(batch.prompt_ids, np.repeat(ids, G, axis=0))
  # Each prompt prefilled once; every emitted token took one slot-step; several rows per slot
  # refilled inside a chunk (fewer chunks than rows, which a host-side refill would need).
  assert stats.prompts_prefilled == len(ids) and stats.busy_slot_steps == lengths.sum()
  assert stats.chunks < len(BUDGETS) and stats.decode_steps < lengths.sum() / 2

  # Same shapes again: nothing retraces.
  traces = continuous.TRACES.snapshot()
  again = sampler.generate(state, ids, mask, jax.random.key(0), params, num_samples=G,
                           max_new_tokens=BUDGETS)
  assert continuous.TRACES.snapshot() == traces
  np.testing.assert_array_equal(again.response_ids, batch.response_ids)


def test_sampled_tokens_do_not_depend_on_the_schedule(split_model):
  """Sample g of prompt i draws from (key, i, g): slots, chunk size and admission order do not
  change it, so a stream fed in reverse gives the same rows."""
  graphdef, state = split_model
  ids, mask = _prompts()
  params = SamplingParams(temperature=1.0, max_new_tokens=R, pad_id=0)
  wide = continuous.ContinuousSampler(graphdef, num_slots=16, chunk_steps=32)
  forward = wide.generate(state, ids, mask, jax.random.key(3), params, num_samples=G)
  narrow = continuous.ContinuousSampler(graphdef, num_slots=2, chunk_steps=3, queue_prompts=1)
  stream = narrow.open_stream(state, params=params, num_samples=G, key=jax.random.key(3),
                              prompt_length=9)
  for i in reversed(range(len(ids))):
    stream.admit(ids[i][mask[i]], prompt_index=i)
  with pytest.raises(ValueError, match="already admitted"):
    stream.admit(ids[0][mask[0]], prompt_index=0)
  groups = {}
  while stream.num_pending:
    polled = stream.poll()
    assert polled  # a poll returns at least one group while any is pending
    groups.update((f.prompt_index, f) for f in polled)
  assert stream.poll() == [] and stream.stats()["prompts"] == len(ids)
  stream.close()
  for i, f in groups.items():
    rows = slice(i * G, (i + 1) * G)
    np.testing.assert_array_equal(f.response_ids, forward.response_ids[rows])
    np.testing.assert_allclose(f.logprobs, forward.logprobs[rows], atol=1e-5)
    np.testing.assert_array_equal(f.prompt_ids, ids[i][mask[i]])
  assert len({tuple(r) for r in np.asarray(forward.response_ids).tolist()}) == len(BUDGETS)


def test_slots_sharded_over_the_mesh_match_one_device(split_model):
  graphdef, state = split_model
  ids, mask = _prompts(4)
  params = SamplingParams(temperature=1.0, max_new_tokens=R, eos_ids=(5, 7, 9))
  one = continuous.ContinuousSampler(graphdef, num_slots=8, chunk_steps=5)
  ref = one.generate(state, ids, mask, jax.random.key(1), params, num_samples=G)
  mesh = shd.make_mesh([("data", 2), ("fsdp", 2), ("tensor", 2)])
  sharded = continuous.ContinuousSampler(graphdef, num_slots=8, chunk_steps=5, mesh=mesh)
  out = sharded.generate(state, ids, mask, jax.random.key(1), params, num_samples=G)
  np.testing.assert_array_equal(out.response_ids, ref.response_ids)
  np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5)
  assert sharded.last_stats.decode_steps == one.last_stats.decode_steps
  # Layout of the engine: slots over the batch axes and KV heads over `tensor`; the prompt
  # queue's rows whole on every device, its KV heads split like the slots'.
  dense = continuous.ContinuousSampler(graphdef, num_slots=8, chunk_steps=5, mesh=mesh,
                                       kv_cache="dense")
  stream = dense.open_stream(state, params=params, num_samples=G, key=jax.random.key(1))
  engine = stream._engine  # pylint: disable=protected-access
  slot_k, queue_k = engine.slots.decode.cache.k[0], engine.queue.cache.k[0]
  assert slot_k.sharding.shard_shape(slot_k.shape)[:2] == (8 // 4, slot_k.shape[1] // 2)
  assert queue_k.sharding.shard_shape(queue_k.shape)[:2] == (queue_k.shape[0],
                                                              queue_k.shape[1] // 2)
  with pytest.raises(ValueError, match="batch shards"):
    continuous.ContinuousSampler(graphdef, num_slots=6, mesh=mesh)


def test_bad_budget_raises(split_model):
  graphdef, state = split_model
  sampler = continuous.ContinuousSampler(graphdef, num_slots=2)
  params = SamplingParams(temperature=0.0, max_new_tokens=R)
  stream = sampler.open_stream(state, params=params, num_samples=2, key=jax.random.key(0),
                               prompt_length=4)
  with pytest.raises(ValueError, match="max_new_tokens"):
    stream.admit([5, 6], prompt_index=0, max_new_tokens=[1, R + 1])
  with pytest.raises(ValueError, match="at most 16"):
    stream.admit(list(range(1, 20)), prompt_index=1)


def test_scanned_model_decodes_the_same_rows(split_model, reference):
  """A scanned model (`scan_layers`: one stacked cache, row copies of all layers at once): the
  continuous sampler's rows (greedy, with budgets) and the static sampler's G sampled rows are
  the unrolled model's (same seed, same weights)."""
  ref_tokens, ref_logprobs, eos = reference
  graphdef, state = nnx.split(create_model(get_preset("test").replace(scan_layers=True), seed=0))
  ids, mask = _prompts()
  params = SamplingParams(temperature=0.0, max_new_tokens=R, eos_ids=(eos,), pad_id=0)
  batch = continuous.ContinuousSampler(graphdef, num_slots=NUM_SLOTS, chunk_steps=8,
                                       max_prefill_length=16).generate(
      state, ids, mask, jax.random.key(0), params, num_samples=G, max_new_tokens=BUDGETS)
  lengths = np.asarray(batch.lengths)
  for i, budget in enumerate(BUDGETS):
    row = ref_tokens[i, :budget].tolist()
    expected = row[:row.index(eos) + 1] if eos in row else row
    assert np.asarray(batch.response_ids[i, :lengths[i]]).tolist() == expected, i
    np.testing.assert_allclose(batch.logprobs[i, :lengths[i]], ref_logprobs[i, :len(expected)],
                               atol=1e-5)
  sampled = SamplingParams(temperature=1.0, max_new_tokens=R, pad_id=0)
  ids, mask = jnp.asarray(ids[:3]), jnp.asarray(mask[:3])
  scanned = Sampler(graphdef).generate(state, ids, mask, jax.random.key(2), sampled,
                                       num_samples=2)
  unrolled = Sampler(split_model[0]).generate(split_model[1], ids, mask, jax.random.key(2),
                                              sampled, num_samples=2)
  np.testing.assert_array_equal(scanned.response_ids, unrolled.response_ids)
  np.testing.assert_allclose(scanned.logprobs, unrolled.logprobs, atol=1e-5)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_chunk_program_never_copies_the_cache(scan):
  """A decode step of the chunk loop, admission included, touches the KV cache in place: no
  copy or transpose of a cache-sized array in the compiled chunk (admitting through a
  `lax.switch` that returned the engine copied every layer's cache twice per step, 1.2x the
  static sampler's step time)."""
  graphdef, state = nnx.split(create_model(get_preset("test", scan_layers=scan), seed=0))
  sampler = continuous.ContinuousSampler(graphdef, num_slots=8, chunk_steps=4,
                                         max_prefill_length=16)
  params = SamplingParams(temperature=1.0, max_new_tokens=R)
  stream = sampler.open_stream(state, params=params, num_samples=2, key=jax.random.key(0))
  stream.admit([5, 6, 7], prompt_index=0)
  stream._enqueue()
  engine = stream._engine
  hlo = prog.chunk_program.lower(
      stream._state, engine, stream._key, np.asarray(True), graphdef=graphdef, params=params,
      mesh=None, chunk_steps=4, max_admit=sampler.max_admit).compile().as_text()
  k = engine.slots.decode.cache.k
  layer_elems = int(np.prod(k.shape[1:] if scan else k[0].shape))
  copies = big_copies(hlo, layer_elems)
  assert not copies, copies


def test_programs_are_compiled_once_per_stream_shape_and_hold_the_state_in_their_layouts(
    split_model):
  graphdef, state = split_model
  sampler = continuous.ContinuousSampler(graphdef, num_slots=NUM_SLOTS, chunk_steps=4,
                                         max_prefill_length=16)
  params = SamplingParams(temperature=1.0, max_new_tokens=6, pad_id=0)
  twin = continuous.ContinuousSampler(graphdef, num_slots=NUM_SLOTS, chunk_steps=4,
                                      max_prefill_length=16)
  streams = [s.open_stream(state, params=params, num_samples=G, key=jax.random.key(i))
             for i, s in enumerate((sampler, sampler, twin))]
  progs = streams[0]._progs  # pylint: disable=protected-access
  # One set of programs per shape for the process, another sampler of that shape included.
  assert all(s._progs is progs for s in streams)  # pylint: disable=protected-access
  stream = streams[0]
  stream.admit([5, 6, 7], prompt_index=0)
  while stream.num_pending:
    stream.poll()
  # The engine state lives in the layouts the compiled chunk takes (and returns).
  engine = stream._engine  # pylint: disable=protected-access
  assert [a.format for a in jax.tree.leaves(engine)] == jax.tree.leaves(progs.formats)
  # Another response budget is another program; other weights of the same layout are not.
  longer = sampler.open_stream(state, params=dataclasses.replace(params, max_new_tokens=8),
                               num_samples=G, key=jax.random.key(0))
  doubled = sampler.open_stream(jax.tree.map(lambda x: x * 2, state), params=params,
                                num_samples=G, key=jax.random.key(0))
  assert longer._progs is not progs and doubled._progs is progs  # pylint: disable=protected-access
  streams += [longer, doubled]
  for s in streams:
    s.close()


def _drain(stream, ids, mask, swap=None):
  """Admits every prompt, polls to the end; ``swap(stream)`` after the first poll."""
  for i in range(len(ids)):
    stream.admit(ids[i][mask[i]], prompt_index=i)
  groups, first = {}, True
  while stream.num_pending:
    groups.update((f.prompt_index, f) for f in stream.poll())
    if first and swap is not None:
      swap(stream)
    first = False
  stream.close()
  return groups


def test_partial_rollout_continues_in_flight_samples_with_new_weights(split_model):
  """`set_weights` between polls: the samples in flight keep their KV and go on decoding with
  the new weights; each token records the version that sampled it. A swap to the same weights
  changes no token; a swap to other weights changes only tokens sampled after it."""
  graphdef, state = split_model
  ids, mask = _prompts()
  params = SamplingParams(temperature=1.0, max_new_tokens=R, pad_id=0)
  sampler = continuous.ContinuousSampler(graphdef, num_slots=2, chunk_steps=3, queue_prompts=1)
  opened = lambda: sampler.open_stream(state, params=params, num_samples=G,
                                       key=jax.random.key(5), prompt_length=9)
  plain = _drain(opened(), ids, mask)
  assert all(f.versions is None for f in plain.values())  # no swap: no labels

  def relabel(stream):
    stream.set_weights(None, 1)
  same = _drain(opened(), ids, mask, relabel)
  other_state = jax.tree.map(lambda x: x * 1.5, state)
  other = _drain(opened(), ids, mask, lambda s: s.set_weights(other_state, 1))
  # A group finished before the swap has no labels: all its tokens are the first version's.
  label = lambda f: f.versions if f.versions is not None else np.where(f.response_mask, 0, -1)
  versions_seen = set()
  changed = 0
  for i, f in plain.items():
    np.testing.assert_array_equal(same[i].response_ids, f.response_ids)
    v = label(same[i])
    assert ((v >= 0) == f.response_mask).all()
    versions_seen |= set(v[f.response_mask].tolist())
    # Within a sample the versions never go back; tokens before the swap are the same in
    # `other` (sampled with the old weights), after it they may differ.
    for g in range(G):
      row = v[g][f.response_mask[g]]
      assert (np.diff(row) >= 0).all()
      ov = label(other[i])[g][other[i].response_mask[g]]
      n0 = int((ov == 0).sum())
      np.testing.assert_array_equal(other[i].response_ids[g, :n0], f.response_ids[g, :n0])
      changed += int(not np.array_equal(other[i].response_ids[g], f.response_ids[g]))
  assert versions_seen == {0, 1}  # samples finished before and decoded across the swap
  assert changed > 0  # the new weights did decode something
