"""Streaming dynamic sampling (`DynamicSampler.sample_stream`) against the batch-level loop.

Host level: a fake stream that returns groups out of order; the default mode must keep the
same groups, carry the same surplus, leave the prompt iterator at the same place and fail the
same way as `sample`. Model level: the static sampler's stream (`StaticStream`) decodes each
prompt exactly as the batch loop's chunked rollout does, so the trained groups and their
advantages are identical while fewer prompts are decoded.
"""



import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from dapo_jax.trainer import trajectories as traj_lib
from dapo_jax.data import arithmetic
from dapo_jax.trainer.dynamic_sampling import (DatasetExhaustedError, DynamicSampler, Group,
                                       MaxGenBatchesExceededError)
from dapo_jax.trainer.generation import Generator
from dapo_jax.models import create_model, get_preset
from dapo_jax.rewards.batch import RewardBatch
from dapo_jax.rollout.continuous import ContinuousSampler
from dapo_jax.rollout.sampler import Sampler
from dapo_jax.rollout.sampling import SamplingParams
from dapo_jax.rollout.static_stream import StaticStream
from dapo_jax.tokenizers import CharTokenizer


def _acc(prompt: int, g: int = 4) -> np.ndarray:
  """A fixed correctness vector per prompt: about a third valid, the rest all-right/all-wrong."""
  kind = (prompt * 7919) % 3
  if kind == 0:
    return np.zeros(g, bool)
  if kind == 1:
    return np.ones(g, bool)
  return np.arange(g) < 1 + prompt % (g - 1)


def _group(prompt: int) -> Group:
  acc = _acc(prompt)
  return Group(prompt=prompt, acc=acc, reward=np.where(acc, 1.0, -1.0))


class _ShuffledStream:
  """Groups come back a few at a time in a seeded random order (a continuous engine's)."""

  def __init__(self, seed: int, admission_block: int = 1):
    self.admission_block = admission_block
    self.rng = np.random.RandomState(seed)
    self.pending: dict[int, int] = {}
    self.admitted: list[int] = []

  def admit(self, prompt, index):
    assert index not in self.pending and index == len(self.admitted)
    self.pending[index] = prompt
    self.admitted.append(prompt)

  def poll(self):
    keys = list(self.pending)
    take = self.rng.choice(keys, size=min(len(keys), 1 + self.rng.randint(3)), replace=False)
    return [(int(i), _group(self.pending.pop(int(i)))) for i in take]


def _batches(gen_batch_size: int, num_batches: int = 50):
  return iter([list(range(b * gen_batch_size, (b + 1) * gen_batch_size))
               for b in range(num_batches)])


def _prompts(groups):
  return [g.prompt for g in groups]


@pytest.mark.parametrize("t,gen,keep_surplus,enable,block", [
    (1, 4, False, True, 1), (3, 4, False, True, 1), (5, 4, True, True, 1), (6, 8, False, True, 1),
    (6, 8, True, True, 1), (3, 4, False, False, 1), (7, 2, True, False, 1),
    (5, 8, False, True, 4), (6, 8, True, True, 2)])
def test_stream_keeps_what_the_batch_loop_keeps(t, gen, keep_surplus, enable, block):
  kw = dict(train_batch_size=t, keep_surplus=keep_surplus, enable=enable)
  batch_sampler, stream_sampler = DynamicSampler(**kw), DynamicSampler(**kw)
  batch_it, stream_it = _batches(gen), _batches(gen)
  admitted_batch = admitted_stream = 0
  for step in range(4):  # consecutive steps: the carried surplus and iterator position matter
    want, want_stats = batch_sampler.sample(batch_it, generate_fn=lambda ps: map(_group, ps))
    stream = _ShuffledStream(seed=step, admission_block=block)
    got, stats = stream_sampler.sample_stream(stream_it, stream)
    assert stats.prompts_admitted % block == 0
    assert _prompts(got) == _prompts(want)
    assert _prompts(stream_sampler.carried_groups) == _prompts(batch_sampler.carried_groups)
    assert stats.num_gen_batches == want_stats.num_gen_batches
    assert stats.prompts_admitted == len(stream.admitted) <= want_stats.prompts_admitted
    admitted_batch += want_stats.prompts_admitted
    admitted_stream += stats.prompts_admitted
  assert next(stream_it) == next(batch_it)  # the iterator ends where the batch loop's does
  assert admitted_stream <= admitted_batch  # never more than the batch loop decodes
  if (t, gen, keep_surplus, enable, block) == (6, 8, False, True, 1):
    assert admitted_stream < admitted_batch  # the point: the discarded tail is not decoded


@pytest.mark.parametrize("error,kw", [(MaxGenBatchesExceededError, dict(max_num_gen_batches=2)),
                                      (DatasetExhaustedError, dict())])
def test_stream_fails_like_the_batch_loop(error, kw):
  """Short of a full batch, both loops raise with the same groups gathered."""
  sampler = DynamicSampler(train_batch_size=40, **kw)
  with pytest.raises(error) as want:
    sampler.sample(_batches(4, 3), generate_fn=lambda ps: map(_group, ps))
  with pytest.raises(error) as got:
    sampler.sample_stream(_batches(4, 3), _ShuffledStream(seed=0))
  assert _prompts(got.value.groups) == _prompts(want.value.groups)
  assert got.value.stats.num_gen_batches == want.value.stats.num_gen_batches


def test_eager_stream_stops_at_the_first_kept_groups():
  """wait=False: the first train_batch_size valid groups in finishing order, not prompt order."""
  stream = _ShuffledStream(seed=3)
  got, stats = DynamicSampler(train_batch_size=5).sample_stream(_batches(8), stream, wait=False)
  assert len(got) == 5 and all(g.is_valid for g in got)
  assert _prompts(got) != sorted(_prompts(got))  # finishing order
  assert stats.prompts_admitted % 8 == 0  # whole generation batches admitted
  assert set(_prompts(got)) <= set(stream.admitted)


# --- the static sampler's stream on a tiny model ---------------------------------------------


class _TextScorer:
  """A deterministic stand-in verifier: a response is correct when its text length is even."""

  def __call__(self, texts, ground_truths, lengths):
    del ground_truths
    acc = np.array([len(t) % 2 == 0 for t in texts], bool)
    score = np.where(acc, 1.0, -1.0).astype(np.float32)
    pen = -np.asarray(lengths, np.float32) / 100.0
    return RewardBatch(score=score, acc=acc, pred=list(texts), overlong_penalty=pen,
                       reward=score + pen, num_errors=0, num_timeouts=0)


@pytest.fixture(scope="module")
def tiny_generator():
  tok = CharTokenizer()
  model = create_model(get_preset("test", vocab_size=tok.vocab_size), seed=0)
  graphdef, weights = nnx.split(model)
  sampler = Sampler(graphdef)
  params = SamplingParams(max_new_tokens=6, eos_ids=tuple(tok.eos_ids), pad_id=tok.pad_id)
  gen_batch, per_call = 8, 2

  def open_stream(state, *, params, num_samples, key):
    return StaticStream(sampler.generate, state, params=params, num_samples=num_samples, key=key,
                        prompts_per_call=per_call, calls_per_batch=gen_batch // per_call,
                        prompt_length=24)
  open_stream.graphdef = graphdef
  gen = Generator(sampler.generate, tok, _TextScorer(), params, num_samples=4,
                  max_prompt_length=24, prompts_per_call=per_call, open_stream=open_stream)
  records = arithmetic.make_records(64, split="train", seed=0)
  return gen, weights, records, gen_batch


def _record_batches(records, gen_batch):
  return iter([list(records[i:i + gen_batch]) for i in range(0, len(records), gen_batch)])


def test_static_stream_decodes_what_the_chunked_rollout_decodes(tiny_generator):
  """Prompt k*B + j of a stream = record j of generation batch k of `generate_and_score` with
  the batch keys the trainer used before streaming (fold_in(step_key, k + 1))."""
  gen, weights, records, b = tiny_generator
  key = jax.random.key(7)
  stream = gen.stream(weights, key)
  for i in (11, 3, 4, 9):  # out of order, partial calls
    stream.admit(records[i], i)
  got = {}
  while stream.num_pending:
    got.update(stream.poll())
  for i, g in got.items():
    k, j = divmod(i, b)
    want = gen(weights, records[k * b:(k + 1) * b], jax.random.fold_in(key, k + 1)).groups()[j]
    np.testing.assert_array_equal(g.response_ids, want.response_ids)
    np.testing.assert_array_equal(g.logprobs, want.logprobs)
    np.testing.assert_array_equal(g.prompt_ids, want.prompt_ids)


@pytest.mark.parametrize("engine", ["static", "continuous"])
def test_stream_trains_on_the_batch_loops_groups(tiny_generator, engine):
  """Same prompts, same samples: identical kept groups and advantages, fewer prompts decoded."""
  gen, weights, records, b = tiny_generator
  if engine == "continuous":  # slots refilled inside the compiled loop
    cont = ContinuousSampler(gen.open_stream.graphdef, num_slots=8, chunk_steps=4,
                             max_prefill_length=24)
    gen = dataclasses.replace(gen, open_stream=cont.open_stream)
  results = {}
  for loop in ("batch", "stream"):
    sampler = DynamicSampler(train_batch_size=5)
    it = _record_batches(records, b)
    stream = gen.stream(weights, jax.random.key(1))
    if loop == "batch":
      groups, stats = sampler.sample(it, generate_fn=stream.generate)
    else:
      groups, stats = sampler.sample_stream(it, stream)
    traj = traj_lib.Trajectories.from_groups(groups)
    results[loop] = (traj, traj_lib.compute_advantages(traj), stats, stream.stats(), next(it))
  (bt, badv, bst, bdec, bnext), (st, sadv, sst, sdec, snext) = results["batch"], results["stream"]
  assert bt.prompts == st.prompts
  for name in ("input_ids", "response_mask", "reward", "acc"):
    np.testing.assert_array_equal(getattr(st, name), getattr(bt, name), err_msg=name)
  # The continuous engine's log-probs move by an ulp with the schedule (which requests share a
  # prefill batch); the tokens do not.
  tol = dict(rtol=0, atol=0) if engine == "static" else dict(rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(st.sampler_logprobs, bt.sampler_logprobs, **tol)
  np.testing.assert_array_equal(sadv, badv)
  assert snext == bnext
  assert bst.num_gen_batches >= 2  # the batch needed more than one generation batch
  assert sst.prompts_admitted <= bst.prompts_admitted
  assert sdec["decoded_tokens"] <= bdec["decoded_tokens"]
  assert 0 < sdec["slot_utilization"] <= 1


def test_static_stream_rejects_bad_input():
  stream = StaticStream(lambda *a: None, None, params=SamplingParams(), num_samples=2,
                        key=jax.random.key(0), prompts_per_call=2, prompt_length=4)
  stream.admit([1, 2], 0)
  with pytest.raises(ValueError, match="already admitted"):
    stream.admit([1, 2], 0)
  with pytest.raises(ValueError, match="1..4 tokens"):
    stream.admit([1] * 5, 1)
  with pytest.raises(ValueError, match="must be >= 1"):
    StaticStream(lambda *a: None, None, params=SamplingParams(), num_samples=2,
                 key=jax.random.key(0), prompts_per_call=0, prompt_length=4)
