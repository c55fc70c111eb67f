"""The continuous engine over a paged KV cache: the same tokens as the dense engine whatever the
page size, pool size (preemptions included), slot count or mesh; prompt pages stored once;
a pool too small for one sample is refused; the chunk never copies the pool."""

import jax
import numpy as np
import pytest
from flax import nnx

from dapo_jax import config as config_lib
from dapo_jax import sharding as shd
from dapo_jax.models import create_model, get_preset
from dapo_jax.rollout import continuous
from dapo_jax.rollout import slot_programs as prog
from dapo_jax.rollout.sampling import SamplingParams
from tests.hlo_checks import big_copies

G, R = 3, 24
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=R, eos_ids=(5, 7), pad_id=0)


@pytest.fixture(scope="module")
def split_model():
  return nnx.split(create_model(get_preset("test"), seed=0))


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


def test_paged_slots_sharded_over_a_mesh_match_one_device(split_model, dense):
  ref, _ = dense
  mesh = shd.make_mesh([("data", 2), ("fsdp", 2), ("tensor", 2)])
  out, stats = _generate(*split_model, kv_cache="paged", page_size=4, kv_pages=16, num_slots=8,
                         mesh=mesh)
  np.testing.assert_array_equal(out.response_ids, ref.response_ids)
  np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)
  # A pool per data shard (4 here), 16 pages of 4 for its 2 slots of up to 40 tokens besides
  # its copy of the queued prompts: the shards preempt on their own.
  assert stats.preemptions > 0
  sampler = continuous.ContinuousSampler(split_model[0], num_slots=8, max_prefill_length=16,
                                         mesh=mesh, kv_cache="paged", page_size=4, kv_pages=16)
  stream = sampler.open_stream(split_model[1], params=PARAMS, num_samples=G,
                               key=jax.random.key(0), prompt_length=9)
  k = stream._engine.slots.decode.cache.k[0]  # pylint: disable=protected-access
  assert k.shape[:3] == (4, 2, 16)  # [S, K, P, T, E]
  assert k.sharding.shard_shape(k.shape)[:3] == (1, 1, 16)  # a shard's pool, heads split
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
