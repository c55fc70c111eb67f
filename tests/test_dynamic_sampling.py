"""Tests of dapo_jax.trainer.dynamic_sampling (spec section 5)."""

import dataclasses
import itertools
import json
import math

import numpy as np
import pytest

from dapo_jax.trainer import dynamic_sampling as ds
from dapo_jax.trainer.dynamic_sampling import DynamicSampler, Group


@dataclasses.dataclass
class _TokensGroup(Group):
  """A trainer's group: extra fields, serialised by its own to_json/from_json."""
  tokens: np.ndarray

  def to_json(self):
    return {**super().to_json(), "tokens": self.tokens.tolist()}

  @classmethod
  def from_json(cls, d):
    return cls(tuple(d["prompt"]), d["acc"], d["reward"], np.asarray(d["tokens"]))


def _pattern_fn(prompts):
  """Deterministic fake rollout: each prompt IS its correctness pattern."""
  return [_TokensGroup(prompt=p, acc=np.array(p, bool),
                       reward=np.where(np.array(p, bool), 1.0, -1.0),
                       tokens=np.arange(len(p))) for p in prompts]


def _batches(*batches):
  return iter([list(b) for b in batches])


MIX = (1, 0, 0, 1)  # valid
ALL1 = (1, 1, 1, 1)  # all correct: dropped
ALL0 = (0, 0, 0, 0)  # all wrong: dropped


def _bernoulli_fn(group_size, seed):
  """Fake policy: a prompt is its per-sample correctness p."""
  rng = np.random.default_rng(seed)

  def generate(prompts):
    out = []
    for p in prompts:
      acc = rng.random(group_size) < p
      out.append(Group(p, acc, np.where(acc, 1.0, -1.0)))
    return out
  return generate


# ---------------------------------------------------------------------------
# Acceptance probability.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("p,expected", [(0.01, 0.148542), (0.10, 0.814698),
                                        (0.5, 0.999969)])
def test_acceptance_probability_spec_table(p, expected):
  assert round(float(ds.acceptance_probability(p, 16)), 6) == expected


def test_acceptance_probability_edges():
  np.testing.assert_allclose(ds.acceptance_probability([0.0, 1.0], 16), 0.0)
  assert ds.acceptance_probability(0.3, 1) == 1.0  # singletons are kept.
  with pytest.raises(ValueError):
    ds.acceptance_probability(1.5, 16)


@pytest.mark.parametrize("p", [0.01, 0.1, 0.5, 0.9])
def test_empirical_kept_fraction_matches_acceptance(p):
  g, per_batch, num_batches = 16, 1000, 4
  sampler = DynamicSampler(_bernoulli_fn(g, seed=int(p * 1000)),
                           train_batch_size=10**9,
                           max_num_gen_batches=num_batches)
  with pytest.raises(ds.MaxGenBatchesExceededError) as e:
    sampler.sample(itertools.repeat([p] * per_batch))
  stats = e.value.stats
  n = per_batch * num_batches
  assert stats.num_groups_generated == n
  q = ds.acceptance_probability(p, g)
  # Binomial(n, q): 4 sigma, plus one count of slack for q near 0 or 1.
  bound = 4 * math.sqrt(n * q * (1 - q)) + 1
  assert abs(stats.num_groups_kept - n * q) <= bound
  assert len(e.value.groups) == stats.num_groups_kept
  # The dropped groups split into all-correct and all-wrong as p^G, (1-p)^G.
  assert abs(stats.num_all_correct - n * p**g) <= 4 * math.sqrt(
      n * p**g) + 1


# ---------------------------------------------------------------------------
# The loop.
# ---------------------------------------------------------------------------


def test_filters_by_acc_in_order_and_cuts_to_batch_size():
  sampler = DynamicSampler(_pattern_fn, train_batch_size=3)
  a, b, c, d = (1, 0), (0, 1, 1), (1, 0, 0), (0, 0, 1)
  batch, stats = sampler.sample(_batches([ALL1, a, ALL0], [b, ALL1, c, d]))
  assert [g.prompt for g in batch] == [a, b, c]
  assert stats.num_gen_batches == 2
  assert stats.num_groups_generated == 7
  assert stats.num_groups_kept == 4
  assert stats.kept_ratio == pytest.approx(4 / 7)
  assert stats.all_correct_ratio == pytest.approx(2 / 7)
  assert stats.all_wrong_ratio == pytest.approx(1 / 7)
  assert stats.rollouts_generated == 4 + 2 + 4 + 3 + 4 + 3 + 3
  assert stats.rollouts_trained == 2 + 3 + 3
  assert stats.surplus_groups == 1 and not stats.surplus_carried
  # Surplus discarded by default: the next call starts afresh.
  batch2, _ = sampler.sample(_batches([MIX, MIX, MIX]))
  assert d not in [g.prompt for g in batch2]


def test_filter_uses_acc_not_shaped_reward():
  # All wrong but with different overlong penalties: reward varies, acc not.
  def fn(prompts):
    return [Group(p, np.zeros(4, bool), [-1.0, -1.2, -1.5, -2.0])
            for p in prompts]
  sampler = DynamicSampler(fn, train_batch_size=1, max_num_gen_batches=1)
  with pytest.raises(ds.MaxGenBatchesExceededError):
    sampler.sample(_batches(["x", "y"]))


def test_singleton_groups_are_kept():
  batch, _ = DynamicSampler(_pattern_fn, train_batch_size=2).sample(
      _batches([(1,), (0,)]))
  assert [g.prompt for g in batch] == [(1,), (0,)]


def test_max_num_gen_batches_error_carries_groups():
  sampler = DynamicSampler(_pattern_fn, train_batch_size=4,
                           max_num_gen_batches=2)
  with pytest.raises(ds.MaxGenBatchesExceededError) as e:
    sampler.sample(_batches([MIX, ALL0, ALL1], [ALL1, MIX, ALL0],
                            [MIX, MIX]))
  err = e.value
  assert "2/4" in str(err) and "max_num_gen_batches=2" in str(err)
  assert [g.prompt for g in err.groups] == [MIX, MIX]
  assert err.stats.num_gen_batches == 2
  assert err.stats.num_groups_generated == 6


def test_batch_filled_by_last_allowed_gen_batch_succeeds():
  sampler = DynamicSampler(_pattern_fn, train_batch_size=2,
                           max_num_gen_batches=2)
  batch, stats = sampler.sample(_batches([MIX, ALL0], [ALL1, MIX]))
  assert len(batch) == 2 and stats.num_gen_batches == 2


def test_keep_surplus_carries_to_next_call_and_round_trips():
  def make():
    return DynamicSampler(_pattern_fn, train_batch_size=2, keep_surplus=True,
                          group_type=_TokensGroup)
  s1, s2, s3 = (1, 0), (0, 1), (1, 0, 1)
  sampler = make()
  batch, stats = sampler.sample(_batches([MIX, MIX, s1, ALL1, s2, s3]))
  assert stats.surplus_groups == 3 and stats.surplus_carried
  assert [g.prompt for g in sampler.carried_groups] == [s1, s2, s3]

  # Checkpoint, restore into a fresh sampler, through JSON.
  restored = make()
  restored.load_state_dict(json.loads(json.dumps(sampler.state_dict())))

  for smp in (sampler, restored):
    untouched = iter([])  # the carry alone fills the batch: no generation.
    batch, stats = smp.sample(untouched)
    assert [g.prompt for g in batch] == [s1, s2]
    assert stats.num_gen_batches == 0 and stats.carried_in_groups == 3
    np.testing.assert_array_equal(batch[1].tokens, [0, 1])
    batch, stats = smp.sample(_batches([ALL0, MIX]))
    assert [g.prompt for g in batch] == [s3, MIX]
    assert smp.carried_groups == []


def test_load_state_dict_rejects_unknown_version():
  with pytest.raises(ValueError, match="version"):
    DynamicSampler(_pattern_fn, train_batch_size=1).load_state_dict(
        {"version": 99, "carried": []})


def test_disabled_keeps_all_correct_and_all_wrong_groups():
  sampler = DynamicSampler(_pattern_fn, train_batch_size=3, enable=False)
  batch, stats = sampler.sample(_batches([ALL1, ALL0, MIX, MIX]))
  assert [g.prompt for g in batch] == [ALL1, ALL0, MIX]
  assert stats.num_gen_batches == 1 and stats.surplus_groups == 1


def test_exhausted_iterator_error_carries_groups_and_resumes():
  sampler = DynamicSampler(_pattern_fn, train_batch_size=3, keep_surplus=True)
  first = (1, 0, 0)
  with pytest.raises(ds.DatasetExhaustedError) as e:
    sampler.sample(_batches([first, ALL1]))
  assert [g.prompt for g in e.value.groups] == [first]
  assert e.value.stats.num_gen_batches == 1
  assert "1/3" in str(e.value)
  # A new epoch continues from what was gathered.
  batch, _ = sampler.sample(_batches([MIX, MIX, MIX]),
                            initial_groups=e.value.groups)
  assert [g.prompt for g in batch] == [first, MIX, MIX]
  # The surplus of that call (one MIX) is carried; caller-given groups, being
  # older, go first.
  batch, _ = sampler.sample(iter([]), initial_groups=_pattern_fn([first] * 2))
  assert [g.prompt for g in batch] == [first, first, MIX]


def test_bad_generate_fn_and_config_errors():
  with pytest.raises(ValueError, match="one Group per prompt"):
    DynamicSampler(lambda ps: [], train_batch_size=1).sample(
        _batches([MIX]))
  with pytest.raises(TypeError, match="Group"):
    DynamicSampler(lambda ps: [object()], train_batch_size=1).sample(
        _batches([MIX]))
  with pytest.raises(ValueError, match="train_batch_size"):
    DynamicSampler(_pattern_fn, train_batch_size=0)
  with pytest.raises(ValueError, match="max_num_gen_batches"):
    DynamicSampler(_pattern_fn, train_batch_size=1, max_num_gen_batches=-1)
  with pytest.raises(ValueError, match="same non-zero length"):
    Group("x", [True, False], [1.0])
  with pytest.raises(ValueError, match="needs a generate_fn"):
    DynamicSampler(train_batch_size=1).sample(_batches([MIX]))


def test_generate_fn_per_call_overrides_the_default():
  """A trainer binds each step's weights into that step's generate_fn."""
  sampler = DynamicSampler(train_batch_size=1)
  batch, _ = sampler.sample(_batches([ALL1, MIX]), generate_fn=_pattern_fn)
  assert [g.prompt for g in batch] == [MIX]
  flipped = lambda ps: _pattern_fn([tuple(1 - x for x in p) for p in ps])
  sampler = DynamicSampler(_pattern_fn, train_batch_size=1)
  batch, _ = sampler.sample(_batches([(1, 0)]), generate_fn=flipped)
  assert batch[0].prompt == (0, 1)


def test_stats_dict_has_logged_keys():
  _, stats = DynamicSampler(_pattern_fn, train_batch_size=1).sample(
      _batches([ALL1, MIX]))
  keys = {"num_gen_batches", "num_groups_generated", "num_groups_kept",
          "kept_ratio", "all_correct_ratio", "all_wrong_ratio",
          "rollouts_generated", "rollouts_trained", "surplus_groups"}
  d = stats.to_dict()
  assert keys <= d.keys()
  assert d["kept_ratio"] == 0.5 and d["all_correct_ratio"] == 0.5
