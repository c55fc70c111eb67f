"""The continuous engine over a paged KV cache: the same tokens as the dense engine whatever the
page size, pool size (preemptions included), slot count or mesh; prompt pages stored once (in
one data shard's pool on a mesh); a pool too small for one sample is refused; the chunk never
copies the pool."""

import jax
import numpy as np
import pytest

from dapo_jax import config as config_lib
from dapo_jax.infra import sharding as shd
from dapo_jax.rollout import continuous
from dapo_jax.rollout import slot_programs as prog
from dapo_jax.rollout.sampling import SamplingParams
from tests.hlo_checks import big_copies

G, R = 3, 24
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=R, eos_ids=(5, 7), pad_id=0)


def _prompts(b=5):
  """Left-padded prompts of 3 to 9 tokens."""
  rng = np.random.default_rng(0)
  ids = rng.integers(10, 100, (b, 9)).astype(np.int32)
  mask = np.ones_like(ids, bool)
  for i, pad in enumerate(rng.integers(0, 7, b)):
    mask[i, :pad] = False
  return np.where(mask, ids, 0), mask


def _generate(graphdef, state, *, kv_cache, num_slots=4, mesh=None, **kw):
  ids, mask = _prompts()
  budgets = np.random.default_rng(1).integers(1, R + 1, len(ids) * G).tolist()
  sampler = continuous.ContinuousSampler(graphdef, num_slots=num_slots, chunk_steps=6,
                                         max_prefill_length=16, mesh=mesh, kv_cache=kv_cache,
                                         attention_impl="xla", **kw)
  out = sampler.generate(state, ids, mask, jax.random.key(7), PARAMS, num_samples=G,
                         max_new_tokens=budgets)
  return jax.device_get(out), sampler.last_stats


@pytest.fixture(scope="module")
def dense(split_model):
  return _generate(*split_model, kv_cache="dense")


@pytest.mark.parametrize("page_size,kv_pages,num_slots", [
    (4, 0, 4),  # a pool for every slot at full length: no preemption
    (4, 17, 4),  # the smallest pool this stream accepts: preempts again and again
    (16, 6, 8),  # other pages, more slots (another admission order), still preempting
])
def test_paged_engine_draws_the_dense_engines_tokens(split_model, dense, page_size, kv_pages,
                                                     num_slots):
  ref, _ = dense
  out, stats = _generate(*split_model, kv_cache="paged", page_size=page_size, kv_pages=kv_pages,
                         num_slots=num_slots)
  np.testing.assert_array_equal(out.response_ids, ref.response_ids)
  np.testing.assert_array_equal(out.lengths, ref.lengths)
  np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-6, rtol=0)
  assert stats.kv_pages > 0 and stats.busy_slot_steps == int(ref.lengths.sum()) + \
      stats.preempted_tokens
  if kv_pages:  # the small pools ran out: samples were preempted, decoded again, the same
    assert stats.preemptions > 0 and stats.stalled_slot_steps > 0
  else:
    assert stats.preemptions == 0 and stats.stalled_slot_steps == 0


# The mesh case: 4 data shards (2 x 2; tensor 2 splits the KV heads), 4 slots and a pool of 16
# pages of 4 tokens each: every prompt and sample is in flight at once, and a shard's 4 slots of
# up to 40 tokens outgrow its pool.
MESH_KW = dict(kv_cache="paged", page_size=4, kv_pages=16, num_slots=16)


@pytest.fixture(scope="module")
def mesh():
  return shd.make_mesh([("data", 2), ("fsdp", 2), ("tensor", 2)])


def test_paged_slots_sharded_over_a_mesh_match_one_device(split_model, dense, mesh):
  ref, _ = dense
  out, stats = _generate(*split_model, mesh=mesh, **MESH_KW)
  np.testing.assert_array_equal(out.response_ids, ref.response_ids)
  np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)
  assert stats.preemptions > 0  # each shard preempts on its own; re-queued, the same tokens
  stream = _mesh_stream(split_model, mesh)
  k = stream._engine.slots.decode.cache.k[0]  # pylint: disable=protected-access
  assert k.shape[:3] == (4, 2, 16)  # [S, K, P, T, E]
  assert k.sharding.shard_shape(k.shape)[:3] == (1, 1, 16)  # a shard's pool, heads split
  stream.close()


def _mesh_stream(split_model, mesh):
  """A stream of the mesh case's shapes (its programs compiled once, by the test above)."""
  sampler = continuous.ContinuousSampler(split_model[0], chunk_steps=6, max_prefill_length=16,
                                         mesh=mesh, attention_impl="xla", **MESH_KW)
  return sampler.open_stream(split_model[1], params=PARAMS, num_samples=G,
                             key=jax.random.key(7), prompt_length=9)


def test_a_queued_prompt_is_stored_in_one_shard_and_decoded_there(split_model, mesh):
  """Enqueue writes each prompt's pages into one shard's pool (not a copy per shard), spreads
  the prompts over the shards, and admits a prompt's samples only into its shard's slots."""
  ids, mask = _prompts()
  stream = _mesh_stream(split_model, mesh)
  for i in range(len(ids)):
    stream.admit(ids[i][mask[i]], prompt_index=i)
  stream._enqueue()  # pylint: disable=protected-access
  engine = jax.device_get(stream._engine)  # pylint: disable=protected-access
  refcount_SxP, q = engine.slots.decode.cache.refcount, engine.queue
  need = sum(-(-int(m.sum()) // 4) for m in mask)  # 2 pages each
  assert stream.last_stats.prompts_prefilled == len(ids)
  assert refcount_SxP.sum() == need  # one hold on one copy of each prompt's pages
  assert np.all((refcount_SxP > 0).sum(1) > 0)  # 5 prompts over 4 shards: none left empty
  for e in np.flatnonzero(q.waiting.any(1)):  # an entry's pages are in its shard's pool
    assert np.all(refcount_SxP[q.shard[e], q.pages[e][q.pages[e] >= 0]] == 1)
  stream._chunk()  # pylint: disable=protected-access
  s = jax.device_get(stream._engine.slots)  # pylint: disable=protected-access
  shard_of_seq = dict(zip(q.seq.tolist(), q.shard.tolist()))
  placed = [(n // 4, shard_of_seq[int(s.owner[n]) // G]) for n in np.flatnonzero(s.owner >= 0)]
  assert len(placed) >= len(ids) and all(a == b for a, b in placed), placed
  stream.close()


def test_a_prompt_is_stored_once_for_its_samples(split_model):
  """8 prompt tokens in pages of 4, G = 3 samples: after the first decode step the pool holds
  the prompt's 2 pages once plus one fresh page per sample (dense: 3 copies of the prompt)."""
  graphdef, state = split_model
  sampler = continuous.ContinuousSampler(graphdef, num_slots=4, chunk_steps=1,
                                         max_prefill_length=16, kv_cache="paged", page_size=4,
                                         kv_pages=30, attention_impl="xla")
  stream = sampler.open_stream(state, params=PARAMS, num_samples=G, key=jax.random.key(0),
                               prompt_length=8)
  stream.admit(list(range(10, 18)), prompt_index=0)
  stream._enqueue()  # pylint: disable=protected-access
  stream._chunk()  # pylint: disable=protected-access
  assert stream.last_stats.min_free_pages == 30 - 2 - G
  stream.close()


def test_a_pool_too_small_for_one_sample_is_refused(split_model):
  graphdef, state = split_model
  sampler = continuous.ContinuousSampler(graphdef, num_slots=4, max_prefill_length=16,
                                         kv_cache="paged", page_size=4, kv_pages=10)
  # Prompts up to 16 tokens (the prefill bucket of 9) and 24-token responses, pages of 4:
  # 4 pages for a prompt, 10 for a sample, 1 for its copy-on-write.
  with pytest.raises(ValueError, match=r"kv_pages=10 .* use at least 15"):
    sampler.open_stream(state, params=PARAMS, num_samples=G, key=jax.random.key(0),
                        prompt_length=9)
  with pytest.raises(ValueError, match="kv_cache='paged_v2'"):
    continuous.ContinuousSampler(graphdef, kv_cache="paged_v2")


@pytest.mark.parametrize("key,value,match", [
    ("kv_cache", "pagged", "choose one of"), ("page_size", 0, "tokens per page"),
    ("kv_pages", -1, ">= 0"), ("kv_hbm_fraction", 1.5, r"\(0, 1\]"),
    ("attention_impl", "flash", "choose one of")])
def test_bad_kv_config_values_are_one_line_errors(key, value, match):
  c = config_lib.default_config()
  c.rollout[key] = value
  with pytest.raises(ValueError, match=rf"config\.rollout\.{key}=.*{match}"):
    config_lib.validate(c)


def test_paged_chunk_never_copies_the_pool(split_model):
  """Admission, copy-on-write, preemption and attention touch the pool in place: no copy of a
  layer's pool in the compiled chunk (the pool is larger than the attention's per-step
  gather of every slot's pages, so that temporary is not counted)."""
  graphdef, state = split_model
  sampler = continuous.ContinuousSampler(graphdef, num_slots=8, chunk_steps=4,
                                         max_prefill_length=16, kv_cache="paged", page_size=4,
                                         kv_pages=256, attention_impl="xla")
  stream = sampler.open_stream(state, params=PARAMS, num_samples=2, key=jax.random.key(0),
                               prompt_length=16)
  spec = stream._paged  # pylint: disable=protected-access
  hlo = prog.chunk_program.lower(
      stream._state, stream._engine, stream._key, np.asarray(True),  # pylint: disable=protected-access
      graphdef=graphdef, params=PARAMS, mesh=None, chunk_steps=4, max_admit=sampler.max_admit,
      paged=spec).compile().as_text()
  k = stream._engine.slots.decode.cache.k[0]  # pylint: disable=protected-access
  assert not big_copies(hlo, int(np.prod(k.shape)))
  stream.close()
