"""Continuous-batching driver: per-request greedy parity, budgets, slot refill, no retrace."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from flax import nnx  # pylint: disable=g-import-not-at-top,g-bad-import-order

import dapo_jax  # pylint: disable=g-import-not-at-top
from dapo_jax.rollout import continuous  # pylint: disable=g-import-not-at-top
from dapo_jax.rollout.sampler import Sampler  # pylint: disable=g-import-not-at-top
from dapo_jax.rollout.sampling import SamplingParams  # pylint: disable=g-import-not-at-top
from tests import rollout_fixtures  # pylint: disable=g-import-not-at-top

R = 12
BUDGETS = [3, 9, 1, 12, 5, 12, 2]
NUM_SLOTS = 3  # fewer than the 7 requests: slots must be refilled


def _prompts():
  rng = np.random.default_rng(0)
  return [rng.integers(4, 128, size=rng.integers(3, 12)).tolist() for _ in BUDGETS]


def _left_pad(prompts):
  p = max(map(len, prompts))
  ids = np.zeros((len(prompts), p), np.int32)
  mask = np.zeros((len(prompts), p), bool)
  for i, q in enumerate(prompts):
    ids[i, p - len(q):], mask[i, p - len(q):] = q, True
  return ids, mask


@pytest.fixture(scope="module")
def split_model():
  return nnx.split(dapo_jax.load_pretrained(rollout_fixtures.tiny_checkpoint()))


@pytest.fixture(scope="module")
def reference(split_model):
  """Static-sampler greedy rows (no stop token), one per prompt, and a stop id they contain."""
  graphdef, state = split_model
  ids, mask = _left_pad(_prompts())
  out = Sampler(graphdef).generate(state, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(0),
                                   SamplingParams(temperature=0.0, max_new_tokens=R))
  tokens, logprobs = np.asarray(out.response_ids), np.asarray(out.logprobs)
  return tokens, logprobs, int(tokens[1, 4])  # row 1 (budget 9) stops at its 5th token


def _expected(tokens_R, budget, eos):
  row = tokens_R[:budget].tolist()
  return row[:row.index(eos) + 1] if eos in row else row


def _by_request(batch, n):
  lengths = np.asarray(batch.lengths)
  return [(np.asarray(batch.response_ids[i, :lengths[i]]).tolist(),
           np.asarray(batch.logprobs[i, :lengths[i]])) for i in range(n)]


def test_matches_per_request_greedy_with_budgets_and_refill(split_model, reference):
  graphdef, state = split_model
  ref_tokens, ref_logprobs, eos = reference
  params = SamplingParams(temperature=0.0, max_new_tokens=R, eos_ids=(eos,), pad_id=0)
  requests = [continuous.Request(p, prompt_index=i, max_new_tokens=b)
              for i, (p, b) in enumerate(zip(_prompts(), BUDGETS))]
  sampler = continuous.ContinuousSampler(graphdef, num_slots=NUM_SLOTS, chunk_steps=8)
  batch = sampler.run(state, requests, jax.random.key(0), params)
  stats = sampler.last_stats

  for i, (tokens, logprobs) in enumerate(_by_request(batch, len(requests))):
    expected = _expected(ref_tokens[i], BUDGETS[i], eos)
    assert tokens == expected, i
    np.testing.assert_allclose(logprobs, ref_logprobs[i, :len(expected)], atol=1e-5)
    assert bool(batch.truncated[i]) == (expected[-1] != eos)
  assert not np.all(batch.truncated) and np.any(batch.truncated)  # both endings exercised
  lengths = np.asarray(batch.lengths)
  assert np.all(lengths >= 1) and np.all(lengths <= BUDGETS)
  np.testing.assert_array_equal(batch.response_mask, np.arange(R)[None] < lengths[:, None])
  assert np.all(np.asarray(batch.response_ids)[~np.asarray(batch.response_mask)] == 0)
  # Refill: more requests than slots, several prefill+insert rounds, slots reused.
  assert stats.refills > 1
  assert max(collections.Counter(stats.slot_of_request).values()) >= 2
  assert stats.busy_slot_steps == int(lengths.sum()) - len(requests)  # prefill made the first

  # Same shapes again: nothing retraces. Reversed order: same per-request results.
  traces = continuous.TRACES.snapshot()
  again = sampler.run(state, requests, jax.random.key(0), params)
  assert continuous.TRACES.snapshot() == traces
  np.testing.assert_array_equal(again.response_ids, batch.response_ids)
  reverse = sampler.run(state, requests[::-1], jax.random.key(0), params)
  np.testing.assert_array_equal(np.asarray(reverse.response_ids)[::-1], batch.response_ids)


def test_rollout_fn_returns_the_static_samplers_batch(split_model, reference):
  graphdef, state = split_model
  eos = reference[2]
  ids, mask = _left_pad(_prompts()[:3])
  params = SamplingParams(temperature=0.0, max_new_tokens=R, eos_ids=(eos,), pad_id=0)
  rollout = continuous.make_rollout_fn(graphdef, max_concurrent_decodes=NUM_SLOTS,
                                       max_prefill_length=16)
  ours = rollout(state, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(1), params, 2)
  ref = Sampler(graphdef).generate(state, jnp.asarray(ids), jnp.asarray(mask),
                                   jax.random.key(1), params, num_samples=2)
  for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "lengths",
               "truncated", "num_steps"):
    np.testing.assert_array_equal(getattr(ours, name), getattr(ref, name), err_msg=name)
  np.testing.assert_allclose(ours.logprobs, ref.logprobs, atol=1e-5)


def test_sampled_tokens_do_not_depend_on_the_schedule(split_model):
  graphdef, state = split_model
  params = SamplingParams(temperature=1.0, max_new_tokens=R, pad_id=0)
  requests = [continuous.Request(p, prompt_index=i // 2, sample_index=i % 2, max_new_tokens=b)
              for i, (p, b) in enumerate(zip(_prompts(), BUDGETS))]
  sampler = continuous.ContinuousSampler(graphdef, num_slots=NUM_SLOTS, chunk_steps=8)
  forward = _by_request(sampler.run(state, requests, jax.random.key(3), params), len(requests))
  backward = _by_request(sampler.run(state, requests[::-1], jax.random.key(3), params),
                         len(requests))[::-1]
  for (t1, lp1), (t2, lp2) in zip(forward, backward):
    assert t1 == t2
    np.testing.assert_allclose(lp1, lp2, atol=1e-5)
  assert len({tuple(t) for t, _ in forward}) == len(requests)  # distinct streams per request


def test_bad_budget_raises(split_model):
  graphdef, state = split_model
  sampler = continuous.ContinuousSampler(graphdef, num_slots=2)
  with pytest.raises(ValueError, match="max_new_tokens"):
    sampler.run(state, [continuous.Request([5, 6], max_new_tokens=R + 1)], jax.random.key(0),
                SamplingParams(temperature=0.0, max_new_tokens=R))


def test_scanned_model_decodes_the_same_rows(split_model, reference):
  """A scanned model (`scan_layers`: one stacked cache, vmapped insert / repeat / grow): the
  continuous sampler's requests and the static sampler's G samples are the unrolled ones."""
  ref_tokens, ref_logprobs, eos = reference
  graphdef, state = nnx.split(dapo_jax.load_pretrained(rollout_fixtures.tiny_checkpoint(),
                                                       scan_layers=True))
  params = SamplingParams(temperature=0.0, max_new_tokens=R, eos_ids=(eos,), pad_id=0)
  requests = [continuous.Request(p, prompt_index=i, max_new_tokens=b)
              for i, (p, b) in enumerate(zip(_prompts(), BUDGETS))]
  batch = continuous.ContinuousSampler(graphdef, num_slots=NUM_SLOTS, chunk_steps=8).run(
      state, requests, jax.random.key(0), params)
  for i, (tokens, logprobs) in enumerate(_by_request(batch, len(requests))):
    expected = _expected(ref_tokens[i], BUDGETS[i], eos)
    assert tokens == expected, i
    np.testing.assert_allclose(logprobs, ref_logprobs[i, :len(expected)], atol=1e-5)
  ids, mask = _left_pad(_prompts()[:3])
  sampled = SamplingParams(temperature=1.0, max_new_tokens=R, pad_id=0)
  scanned = Sampler(graphdef).generate(state, jnp.asarray(ids), jnp.asarray(mask),
                                       jax.random.key(2), sampled, num_samples=2)
  unrolled = Sampler(split_model[0]).generate(split_model[1], jnp.asarray(ids),
                                              jnp.asarray(mask), jax.random.key(2), sampled,
                                              num_samples=2)
  np.testing.assert_array_equal(scanned.response_ids, unrolled.response_ids)
  np.testing.assert_allclose(scanned.logprobs, unrolled.logprobs, atol=1e-5)
