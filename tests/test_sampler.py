"""The compiled static sampler (dapo_jax/rollout) against the full forward pass ("test" preset)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from dapo_jax.infra import sharding as shd
from dapo_jax.models import create_model, get_preset
from dapo_jax.rollout import Sampler, SamplingParams, sample_logits

R = 10  # max_new_tokens for the model-level tests


@pytest.fixture(scope="module")
def model():
  m = create_model(get_preset("test"), seed=1)
  # The 0.02-std init gives near-uniform logits; a sharper head keeps greedy argmax margins far
  # above fp32 noise, so greedy parity is meaningful and not a coin flip on near-ties.
  m.lm_head.value = m.lm_head.value * 30.0
  return m


@pytest.fixture(scope="module")
def sampler(model):
  return Sampler(nnx.graphdef(model))


@pytest.fixture(scope="module")
def prompts():
  """Left-padded prompts of lengths 6, 3, 1 and 5 (P = 6)."""
  rng = np.random.RandomState(0)
  lens = [6, 3, 1, 5]
  ids = np.zeros((4, 6), np.int32)
  mask = np.zeros((4, 6), bool)
  for b, n in enumerate(lens):
    ids[b, 6 - n:] = rng.randint(1, 128, n)
    mask[b, 6 - n:] = True
  return ids, mask


@jax.jit
def _forward(graphdef, state, ids_BxT, mask_BxT):
  return nnx.merge(graphdef, state)(ids_BxT, attention_mask_BxT=mask_BxT)


_forward = jax.jit(_forward.__wrapped__, static_argnums=0)


def _full_logits(model, ids_BxT, mask_BxT):
  graphdef, state = nnx.split(model)
  return np.asarray(_forward(graphdef, state, ids_BxT, mask_BxT))


@pytest.fixture(scope="module")
def greedy_ref(model, prompts):
  """Step-by-step argmax of the FULL forward (no cache) on the growing sequence.

  The sequence lives in a fixed [B, P + R] buffer whose future slots are masked out (and
  causally invisible), so the reference compiles once instead of once per length.
  """
  ids, mask = prompts
  b, p = ids.shape
  ids = np.concatenate([ids, np.zeros((b, R), np.int32)], 1)
  mask = np.concatenate([mask, np.zeros((b, R), bool)], 1)
  for t in range(R):
    logits = _full_logits(model, ids, mask)[:, p + t - 1]
    top2 = np.sort(logits, -1)[:, -2:]
    assert np.all(top2[:, 1] - top2[:, 0] > 1e-3), "near-tie: greedy parity would be flaky"
    ids[:, p + t] = logits.argmax(-1)
    mask[:, p + t] = True
  return ids[:, p:]


def _training_logprobs(model, batch, temperature):
  """log_softmax(logits / T) of the full forward over prompt + response, at the response."""
  ids = np.concatenate([batch.prompt_ids, batch.response_ids], 1)
  mask = np.concatenate([batch.prompt_mask, batch.response_mask], 1)
  p = batch.prompt_ids.shape[1]
  logits = _full_logits(model, ids, mask)[:, p - 1:-1] / temperature
  logp = jax.nn.log_softmax(logits, -1)
  return np.take_along_axis(np.asarray(logp), np.asarray(batch.response_ids)[..., None], -1)[..., 0]


# --- model-level ------------------------------------------------------------------------------


def test_greedy_matches_full_forward_argmax(model, sampler, prompts, greedy_ref):
  ids, mask = prompts
  params = SamplingParams(temperature=0.0, max_new_tokens=R)
  batch = jax.device_get(sampler.generate(nnx.state(model), ids, mask, jax.random.key(0), params,
                                          num_samples=2))
  ref = greedy_ref
  np.testing.assert_array_equal(batch.response_ids, np.repeat(ref, 2, axis=0))
  # Rows are prompt-major: row b*G + g holds prompt b.
  np.testing.assert_array_equal(batch.prompt_ids, np.repeat(ids, 2, axis=0))
  np.testing.assert_array_equal(batch.prompt_mask, np.repeat(mask, 2, axis=0))
  assert batch.response_mask.all() and batch.truncated.all()
  np.testing.assert_array_equal(batch.lengths, R)
  assert int(batch.num_steps) == R
  # Right padding gives the same responses (positions and cache validity follow the mask).
  right_ids, right_mask = np.zeros_like(ids), np.zeros_like(mask)
  for b in range(len(ids)):
    n = mask[b].sum()
    right_ids[b, :n], right_mask[b, :n] = ids[b, mask[b]], True
  right = sampler.generate(nnx.state(model), right_ids, right_mask, jax.random.key(0), params,
                           num_samples=2)
  np.testing.assert_array_equal(np.asarray(right.response_ids), batch.response_ids)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_match_training_forward(model, sampler, prompts, temperature):
  ids, mask = prompts
  params = SamplingParams(temperature=temperature, max_new_tokens=R, eos_ids=(5, 17, 99),
                          pad_id=0)
  batch = jax.device_get(sampler.generate(nnx.state(model), ids, mask, jax.random.key(3), params,
                                          num_samples=3))
  ref = _training_logprobs(model, batch, temperature)
  m = batch.response_mask
  np.testing.assert_allclose(batch.logprobs[m], ref[m], atol=1e-4, rtol=0)
  assert np.all(batch.logprobs[~m] == 0)


def test_eos_mask_lengths_truncation_and_early_exit(model, sampler, prompts, greedy_ref):
  ids, mask = prompts
  state = nnx.state(model)
  ref = greedy_ref
  # Stop ids chosen so that every row stops by column 3 (early exit) and at least one row's
  # stop token also appears later (nothing after the first one may be kept).
  eos = tuple(sorted({int(t) for t in ref[:, 3]}))
  params = SamplingParams(temperature=0.0, max_new_tokens=R, eos_ids=eos, pad_id=127)
  batch = jax.device_get(sampler.generate(state, ids, mask, jax.random.key(0), params))
  is_eos = np.isin(ref, eos)
  first = is_eos.argmax(1)
  assert any(is_eos[b, first[b] + 1:].any() for b in range(len(ids))), "fixture lost its point"
  for b in range(len(ids)):
    n = first[b] + 1
    assert batch.lengths[b] == n
    np.testing.assert_array_equal(batch.response_mask[b], np.arange(R) < n)
    np.testing.assert_array_equal(batch.response_ids[b, :n], ref[b, :n])
    assert np.all(batch.response_ids[b, n:] == 127) and np.all(batch.logprobs[b, n:] == 0)
  assert not batch.truncated.any()
  assert int(batch.num_steps) == first.max() + 1 < R

  # One row without its stop token: that row alone is truncated and runs to R.
  eos_one = tuple(sorted(set(eos) - {int(ref[0, 3])} - set(map(int, ref[0]))))
  params = SamplingParams(temperature=0.0, max_new_tokens=R, eos_ids=eos_one, pad_id=127)
  batch = jax.device_get(sampler.generate(state, ids, mask, jax.random.key(0), params))
  np.testing.assert_array_equal(batch.truncated, ~np.isin(ref, eos_one).any(1))
  assert batch.truncated[0] and not batch.truncated[1:].all()
  assert batch.lengths[0] == R and batch.response_mask[0].all()
  assert int(batch.num_steps) == R


def test_reproducible_independent_and_compiled_once(model, prompts):
  ids, mask = prompts
  sampler = Sampler(nnx.graphdef(model))
  state = nnx.state(model)
  params = SamplingParams(temperature=1.0, max_new_tokens=R)
  a = jax.device_get(sampler.generate(state, ids, mask, jax.random.key(7), params, num_samples=4))
  b = jax.device_get(sampler.generate(state, ids, mask, jax.random.key(7), params, num_samples=4))
  c = jax.device_get(sampler.generate(state, ids[::-1].copy(), mask[::-1].copy(),
                                      jax.random.key(8), params, num_samples=4))
  assert sampler.traces.total == 1, "same shapes must not retrace"
  np.testing.assert_array_equal(a.response_ids, b.response_ids)
  np.testing.assert_array_equal(a.logprobs, b.logprobs)
  assert not np.array_equal(a.response_ids, c.response_ids)
  # The G rows of one prompt share the prefill but draw different samples.
  groups = a.response_ids.reshape(4, 4, R)
  for g in groups:
    assert len({tuple(r) for r in g}) == 4
  # A new shape compiles once more, then is cached too.
  sampler.generate(state, ids[:2], mask[:2], jax.random.key(7), params, num_samples=4)
  sampler.generate(state, ids[2:], mask[2:], jax.random.key(9), params, num_samples=4)
  assert sampler.traces.total == 2


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sharded_equals_single_device(model, sampler, prompts, temperature):
  """Greedy, and sampling with the same key (threefry bits do not depend on the layout)."""
  assert jax.device_count() == 8, "tests/conftest.py should force 8 CPU devices"
  ids, mask = prompts
  params = SamplingParams(temperature=temperature, max_new_tokens=R, eos_ids=(5,))
  single = jax.device_get(sampler.generate(nnx.state(model), ids, mask, jax.random.key(0),
                                           params, num_samples=2))
  mesh = shd.make_mesh([("data", 2), ("fsdp", 2), ("tensor", 2)])
  graphdef, state = nnx.split(model)
  state = jax.device_put(state, shd.state_shardings(state, mesh, shd.SAMPLE_RULES))
  sharded = Sampler(graphdef, mesh=mesh).generate(state, ids, mask, jax.random.key(0), params,
                                                  num_samples=2)
  assert len(sharded.response_ids.sharding.device_set) == 8
  assert not sharded.response_ids.sharding.is_fully_replicated
  sharded = jax.device_get(sharded)
  np.testing.assert_array_equal(sharded.response_ids, single.response_ids)
  np.testing.assert_array_equal(sharded.response_mask, single.response_mask)
  np.testing.assert_allclose(sharded.logprobs, single.logprobs, atol=1e-4)


# --- token-level ------------------------------------------------------------------------------


def _draw(logits_V, n, seed=0, **kw):
  logits_NxV = jnp.broadcast_to(jnp.asarray(logits_V, jnp.float32), (n, len(logits_V)))
  fn = jax.jit(lambda l, k: sample_logits(l, k, **kw))
  tok, lp = fn(logits_NxV, jax.random.key(seed))
  return np.asarray(tok), np.asarray(lp)


def _chi2_pvalue(tokens, probs):
  counts = np.bincount(tokens, minlength=len(probs))
  keep = probs > 0
  assert counts[~keep].sum() == 0
  expected = probs[keep].astype(np.float64)
  return stats.chisquare(counts[keep], expected / expected.sum() * len(tokens)).pvalue


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_frequencies_match_softmax(temperature):
  logits = np.log(np.array([0.3, 0.02, 0.2, 0.1, 0.25, 0.08, 0.05], np.float32))
  tok, lp = _draw(logits, 20000, temperature=temperature)
  probs = np.asarray(jax.nn.softmax(logits / temperature))
  assert _chi2_pvalue(tok, probs) > 1e-3
  np.testing.assert_allclose(lp, np.log(probs)[tok], atol=1e-5)


def test_top_p_stays_in_nucleus():
  # Shuffled order, so sorting matters. Sorted mass: .4, .65 (< .7), .8 -> nucleus {a, b, c}.
  probs = np.array([0.05, 0.15, 0.02, 0.4, 0.1, 0.25, 0.03], np.float32)
  nucleus = [3, 5, 1]
  tok, lp = _draw(np.log(probs), 20000, seed=1, top_p=0.7)
  assert set(np.unique(tok)) == set(nucleus)
  renorm = np.where(np.isin(np.arange(7), nucleus), probs, 0) / probs[nucleus].sum()
  assert _chi2_pvalue(tok, renorm) > 1e-3
  # Log-probs stay those of the FULL softmax (what the trainer recomputes), not the nucleus.
  np.testing.assert_allclose(lp, np.log(probs)[tok], atol=1e-5)
  # A top mass reaching top_p alone keeps exactly one token; tiny top_p still keeps one.
  assert set(_draw(np.log(probs), 2000, top_p=0.39)[0]) == {3}
  assert set(_draw(np.log(probs), 2000, top_p=1e-6)[0]) == {3}


def test_top_k_and_greedy():
  probs = np.array([0.05, 0.15, 0.02, 0.4, 0.1, 0.25, 0.03], np.float32)
  tok, _ = _draw(np.log(probs), 20000, seed=2, top_k=2)
  assert set(np.unique(tok)) == {3, 5}
  assert _chi2_pvalue(tok, np.where(np.isin(np.arange(7), [3, 5]), probs, 0) / 0.65) > 1e-3
  # top-k then top-p of the renormalised top-k: .4/.65 = .62 < .7 -> both stay.
  assert set(np.unique(_draw(np.log(probs), 4000, top_k=3, top_p=0.7)[0])) == {3, 5}
  tok, lp = _draw(np.log(probs), 8, temperature=0.0)
  assert np.all(tok == 3)
  np.testing.assert_allclose(lp, np.log(0.4), atol=1e-5)


def test_bad_switches_raise():
  with pytest.raises(ValueError, match="top_p"):
    SamplingParams(top_p=0.0)
  with pytest.raises(ValueError, match="temperature"):
    sample_logits(jnp.zeros((1, 4)), jax.random.key(0), temperature=-1.0)
  assert SamplingParams(eos_ids=[3, 4]).eos_ids == (3, 4)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_segmented_decode_equals_single_loop(model, prompts, scan):
  """Segments change nothing but the work per step: per-layer caches grow between the
  while_loops; a scanned model's stacked cache (which a growth would copy whole) is made full
  length once and each segment attends over its prefix."""
  ids, mask = prompts
  params = SamplingParams(temperature=1.0, max_new_tokens=40, eos_ids=(7,))
  one = Sampler(nnx.graphdef(model), cache_segments=1)
  a = jax.device_get(one.generate(nnx.state(model), ids, mask, jax.random.key(5), params,
                                  num_samples=2))
  seg_model = model
  if scan:  # the same weights (one seed gives both layouts), stacked
    seg_model = create_model(get_preset("test", scan_layers=True), seed=1)
    seg_model.lm_head.value = seg_model.lm_head.value * 30.0
  three = Sampler(nnx.graphdef(seg_model), cache_segments=3)  # segments end at 20, 40
  state = nnx.state(seg_model)
  b = jax.device_get(three.generate(state, ids, mask, jax.random.key(5), params, num_samples=2))
  np.testing.assert_array_equal(a.response_ids, b.response_ids)
  np.testing.assert_array_equal(a.response_mask, b.response_mask)
  np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
  assert int(a.num_steps) == int(b.num_steps)
  if scan:  # no growth (pad) of the decode rows' stacked [L, N, K, ., .] cache; the prompts'
    # [L, B, ...] prefill cache is padded to full length once, before its rows are repeated
    hlo = three._program.lower(  # pylint: disable=protected-access
        state, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(5), params=params,
        num_samples=2).compile().as_text()
    layers = seg_model.config.num_hidden_layers
    rows = ids.shape[0] * 2
    grown = re.findall(rf"= \w+\[{layers},{rows},\d+,\d+,\d+\]\{{[^}}]*\}} pad\(", hlo)
    assert not grown, grown
