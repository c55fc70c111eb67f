"""keep_surplus's carried groups train with their behaviour policy's log-probs (issue 17 D5)."""

import json
import types

import numpy as np

from dapo_jax import config as config_lib
from dapo_jax.trainer import train
from dapo_jax.trainer import trajectories as traj_lib
from dapo_jax.data import arithmetic
from dapo_jax.trainer.dynamic_sampling import DynamicSampler, SamplingStats
from dapo_jax.infra.metrics import Timer
from dapo_jax.spec.run_spec import RunSpec

G, P, R = 2, 3, 4
# The sampler's log-prob of every token, by rollout step.
SAMPLER_LOGP = {0: np.float32(-0.5), 1: np.float32(-0.7)}
RECOMPUTED = np.float32(-0.1)  # what the training forward gives with the current weights


def _generate(step):
  """Two valid groups per generation batch, sampled at ``step`` (lengths 2 and 4)."""
  def fn(records):
    return [traj_lib.ScoredGroup(
        prompt=rec, acc=np.array([True, False]), reward=np.array([1.0, -1.0]),
        prompt_ids=np.ones((G, P), np.int32), prompt_mask=np.ones((G, P), bool),
        response_ids=np.ones((G, R), np.int32),
        response_mask=np.array([[1, 1, 0, 0], [1, 1, 1, 1]], bool),
        logprobs=np.full((G, R), SAMPLER_LOGP[step], np.float32),
        lengths=np.array([2, 4], np.int32), truncated=np.zeros(G, bool),
        texts=["a", "b"], score=np.array([1, -1], np.float32), penalty=np.zeros(G, np.float32))
        for rec in records]
  return fn


def _sample(sampler, prompts, step):
  """What ``train._sample`` does around the sampler: sample, stamp, concatenate."""
  groups, stats = sampler.sample(prompts, generate_fn=_generate(step))
  traj_lib.stamp_sampled_at(list(groups) + sampler.carried_groups, step)
  return traj_lib.Trajectories.from_groups(groups), stats


def test_carried_groups_keep_the_sampler_log_probs_and_are_counted():
  records = arithmetic.make_records(8)
  prompts = iter([records[i:i + 3] for i in range(0, 8, 3)])
  sampler = DynamicSampler(train_batch_size=2, keep_surplus=True,
                           group_type=traj_lib.ScoredGroup)
  traj0, _ = _sample(sampler, prompts, 0)  # 3 valid groups: 2 train, 1 carried
  assert len(sampler.carried_groups) == 1
  # A checkpoint between the steps keeps the stamp.
  sampler.load_state_dict(json.loads(json.dumps(sampler.state_dict())))
  traj1, stats1 = _sample(sampler, prompts, 1)
  assert stats1.carried_in_groups == 1
  np.testing.assert_array_equal(traj1.carried_rows(1), [True, True, False, False])
  assert not traj0.carried_rows(0).any()

  spec = RunSpec.from_config(config_lib.default_config())
  no_params = types.SimpleNamespace(params=None)
  run = types.SimpleNamespace(mesh=None, logp_fn=lambda params, ids, mask, r: (
      np.full((ids.shape[0], r), RECOMPUTED, np.float32), np.zeros((ids.shape[0], r))))
  old1, _, ref1 = train._old_log_probs(spec.rollout, run, no_params, traj1, 1)  # pylint: disable=protected-access
  # The carried group's old log-probs are its sampler's (step 0); the fresh group's recomputed.
  np.testing.assert_array_equal(old1[:2], SAMPLER_LOGP[0])
  np.testing.assert_array_equal(old1[2:], RECOMPUTED)
  assert ref1 is None  # no KL loss: no reference pass
  old0, _, _ = train._old_log_probs(spec.rollout, run, no_params, traj0, 0)  # pylint: disable=protected-access
  np.testing.assert_array_equal(old0, RECOMPUTED)

  timer = Timer()
  with timer("rollout"):
    pass
  metrics = train.step_metrics(
      spec, types.SimpleNamespace(num_skipped=0), traj1, SamplingStats(),
      [{"skipped": 0.0}], old1, None, timer, 1)
  assert metrics["sampling/carried_tokens_trained"] == 2 + 4  # the carried group's tokens
  metrics0 = train.step_metrics(
      spec, types.SimpleNamespace(num_skipped=0), traj0, SamplingStats(),
      [{"skipped": 0.0}], old0, None, timer, 0)
  assert metrics0["sampling/carried_tokens_trained"] == 0
