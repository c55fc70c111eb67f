"""The pre-rollout skip filter (issue 39): adaptation, floor, exactness across processes, resume."""

import json
import threading

import numpy as np
import pytest

from dapo_jax.trainer import skip_filter as sf
from dapo_jax.trainer.dynamic_sampling import DynamicSampler, Group

G = 4
# 40 problems: 0-19 always right, 20-29 always wrong, 30-39 right about half the time.
RATES = [1.0] * 20 + [0.0] * 10 + [0.5] * 10


def _group(prompt: int, step: int) -> Group:
  """Prompt ``prompt``'s group at ``step``: a fixed function of both (the same on every process)."""
  rng = np.random.default_rng([prompt, step])
  acc = rng.random(G) < RATES[prompt]
  return Group(prompt, acc, np.where(acc, 1.0, -1.0))


class _Stream:
  """A `GroupStream` whose groups depend on (prompt, step) only; counts what it decodes."""

  def __init__(self, step):
    self.step, self.pending, self.admitted = step, [], []

  def admit(self, prompt, index):
    self.pending.append((index, prompt))
    self.admitted.append(prompt)

  def poll(self):
    out, self.pending = [(i, _group(p, self.step)) for i, p in self.pending[:3]], self.pending[3:]
    return out


def _epochs(seed):
  """Endless epochs over the 40 problems, 8 per generation batch, reshuffled per epoch."""
  epoch = 0
  while True:
    order = np.random.default_rng([seed, epoch]).permutation(len(RATES))
    for s in range(0, len(order), 8):
      yield [int(p) for p in order[s:s + 8]]
    epoch += 1


def _run(sampler, batches, steps, start=0, loop="stream"):
  """Per step: the kept prompts and the prompts rolled out."""
  out = []
  for step in range(start, start + steps):
    if sampler.prefilter is not None:
      sampler.prefilter.begin(step)
    stream = _Stream(step)
    if loop == "stream":
      groups, _ = sampler.sample_stream(batches, stream)
    else:
      groups, _ = sampler.sample(
          batches, generate_fn=lambda ps, st=step: [_group(p, st) for p in ps])
    out.append(([g.prompt for g in groups], stream.admitted))
  return out


def _sampler(**kw):
  return DynamicSampler(train_batch_size=4, prefilter=sf.SkipFilter(seed=0, group_size=G, **kw))


def test_skipped_prompts_neither_thin_the_rollout_batch_nor_count_against_the_cap():
  """Once the filter skips, a generation batch holds a full batch's worth of admitted prompts
  (drawn from several of the iterator's batches), and max_num_gen_batches counts those."""
  sampler = DynamicSampler(train_batch_size=4, max_num_gen_batches=3,
                           prefilter=sf.SkipFilter(seed=0, group_size=G, floor=0.05))
  f, batches, sizes = sampler.prefilter, _epochs(0), []
  f.explore = {"right": 0.05, "wrong": 0.05}  # skip nearly every prompt with a streak
  for step in range(12):
    f.begin(step)
    _, stats = sampler.sample(batches, generate_fn=lambda ps, st=step: (
        sizes.append(len(ps)), [_group(p, st) for p in ps])[1])
    assert stats.num_gen_batches <= 3
  assert f.counts.skipped_right + f.counts.skipped_wrong > 0
  assert min(sizes) >= 8  # never fewer than a generation batch of prompts decoded at once


def test_streak_and_retry_probability():
  assert sf.streak([(4, 0), (0, 1), (0, 2)], 4) == ("wrong", 2)
  assert sf.streak([(0, 0), (4, 1)], 4) == ("right", 1)
  assert sf.streak([(4, 0), (2, 1)], 4) == (None, 0)
  f = sf.SkipFilter(seed=0, group_size=4, floor=0.1)
  f.explore["right"] = 0.5
  assert f.retry_probability("right", 1) == 0.5
  assert f.retry_probability("right", 2) == 0.25
  assert f.retry_probability("right", 5) == 0.1  # the floor
  assert f.retry_probability("wrong", 3) == 1.0  # explore 1: never skipped
  assert sf.prompt_key("a") == sf.prompt_key("a") != sf.prompt_key("b")


def test_adaptive_probability_moves_toward_the_target_and_keeps_the_floor():
  """Half the problems are always right: the all-right retry base falls to the floor and the
  zero-variance share of what is decoded falls; skipped prompts are still retried."""
  sampler = _sampler(target=0.2, floor=0.1, adapt_rate=0.1)
  f = sampler.prefilter
  before, after, explore, retried = [], [], [], 0
  batches = _epochs(0)
  for step in range(40):
    f.begin(step)
    _, stats = sampler.sample_stream(batches, _Stream(step))
    m = f.metrics(stats.num_groups_generated, stats.num_all_correct + stats.num_all_wrong)
    before.append(m["skip/zero_var_share_before"])
    after.append(m["skip/zero_var_share_after"])
    explore.append(dict(f.explore))
    retried += f.counts.retried
    skipped = f.counts.skipped_right + f.counts.skipped_wrong
    assert stats.prompts_admitted <= f.counts.prompts_seen - skipped
    # A generation batch is 8 admitted prompts, drawn from as many batches of 8 as it takes.
    assert f.counts.prompts_seen % 8 == 0
    assert 8 * stats.num_gen_batches <= f.counts.prompts_seen - skipped
  assert all(e[k] >= 0.1 for e in explore for k in sf.KINDS)
  assert explore[-1]["right"] == pytest.approx(0.1)  # 50% all-right >> 10%: down to the floor
  assert explore[-1]["wrong"] < 1.0
  assert np.mean(after[20:]) < np.mean(before[20:]) - 0.2
  assert retried > 0  # the floor keeps retrying

  # No zero-variance groups at all: nothing is above its target, the bases stay at 1.
  g = sf.SkipFilter(seed=0, group_size=G, adapt_rate=0.1)
  g.explore = {"right": 0.5, "wrong": 0.5}
  for _ in range(10):
    g.end_call(num_generated=10, num_all_right=0, num_all_wrong=0)
  assert g.explore == {"right": 1.0, "wrong": 1.0}


def test_off_keeps_every_prompt_and_the_state_format():
  """Without a prefilter the sampler rolls out every drawn prompt and saves what it did before."""
  plain = DynamicSampler(train_batch_size=4)
  steps = _run(plain, _epochs(0), 5)
  assert set(plain.state_dict()) == {"version", "carried"}
  # A filter that may never skip (floor 1) changes nothing: the same prompts rolled out and kept.
  assert _run(_sampler(floor=1.0), _epochs(0), 5) == steps
  assert _run(_sampler(), _epochs(0), 5) != steps


@pytest.mark.parametrize("loop", ["stream", "batch"])
def test_history_survives_a_checkpoint_and_the_resumed_run_is_the_same(loop):
  full = _run(_sampler(), _epochs(1), 12, loop=loop)
  first, batches = _sampler(), _epochs(1)
  part = _run(first, batches, 6, loop=loop)
  state = json.loads(json.dumps(first.state_dict()))  # what the checkpoint meta holds
  assert state["prefilter"]["history"] and state["prefilter"]["explore"]["right"] < 1.0
  resumed = _sampler()
  resumed.load_state_dict(state)
  part += _run(resumed, batches, 6, start=6, loop=loop)
  assert part == full
  # Resumed with the history dropped (same data position, same retry bases), it decides
  # otherwise: the history is what the checkpoint had to carry.
  other, other_batches = _sampler(), _epochs(1)
  _run(other, other_batches, 6, loop=loop)
  cold = _sampler()
  cold.load_state_dict({**state, "prefilter": {**state["prefilter"], "history": []}})
  assert _run(cold, other_batches, 6, start=6, loop=loop) != full[6:]


class _Gather:
  """`distributed.allgather_json` across threads standing in for processes."""

  def __init__(self, n):
    self.n, self.slots, self.barrier = n, [None] * n, threading.Barrier(n)

  def __call__(self, index):
    def gather(values):
      self.slots[index] = list(values)
      self.barrier.wait()
      out = [v for s in self.slots for v in s]
      self.barrier.wait()
      return out
    return gather


def test_two_processes_keep_the_same_set_as_one():
  """Each process owns half the history; the verdicts and the checkpoint are gathered. Both keep
  exactly the prompts a single process keeps, step after step, and after a resume."""
  one, one_batches = _sampler(), _epochs(2)
  want = _run(one, one_batches, 5)
  one_state = one.state_dict()
  want += _run(one, one_batches, 5, start=5)
  gather = _Gather(2)
  results, states = [None, None], [None, None]

  def process(i):
    s = DynamicSampler(train_batch_size=4, prefilter=sf.SkipFilter(
        seed=0, group_size=G, process_index=i, process_count=2, gather=gather(i)))
    batches = _epochs(2)
    out = _run(s, batches, 5)
    state = json.loads(json.dumps(s.state_dict()))  # gathered: every process writes the same
    states[i] = state
    resumed = DynamicSampler(train_batch_size=4, prefilter=sf.SkipFilter(
        seed=0, group_size=G, process_index=i, process_count=2, gather=gather(i)))
    resumed.load_state_dict(state)
    owned = len(resumed.prefilter._history)  # pylint: disable=protected-access
    assert 0 < owned < len(state["prefilter"]["history"])  # a shard, not the whole
    results[i] = out + _run(resumed, batches, 5, start=5)

  threads = [threading.Thread(target=process, args=(i,)) for i in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=60)
  assert results[0] == results[1] == want
  assert states[0] == states[1]
  assert dict(map(tuple, [(k, json.dumps(v)) for k, v in states[0]["prefilter"]["history"]])) == \
      {k: json.dumps(v) for k, v in one_state["prefilter"]["history"]}


def test_history_is_bounded():
  f = sf.SkipFilter(seed=0, group_size=G, max_prompts=5)
  for step in range(3):
    f.begin(step)
    for p in range(12):
      f.record(p, np.ones(G, bool))
  assert len(f._history) == 5  # pylint: disable=protected-access
  assert all(len(v) <= sf.HISTORY_PER_PROMPT for v in f._history.values())  # pylint: disable=protected-access
  with pytest.raises(ValueError, match="version"):
    f.load_state_dict({"version": 0})
