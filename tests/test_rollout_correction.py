"""Rollout corrections (objective.rollout_correction): closed forms, the loss, the train step,
the config and how they compose with use_sampler_logprobs and keep_surplus (issue 29)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax import config as config_lib
from dapo_jax.trainer import objective as obj
from dapo_jax.trainer import train_step as ts
from dapo_jax.trainer import trajectories as traj_lib
from dapo_jax.models import create_model, get_preset

LOG = math.log


def test_token_truncated_weights_are_min_rho_cap_and_zero_on_padding():
  old = np.array([[0.0, LOG(3.0), LOG(0.5), 7.0]], np.float32)
  sampler = np.zeros((1, 4), np.float32)
  mask = np.array([[1, 1, 1, 0]], np.float32)
  w, m = obj.rollout_correction(old, sampler, mask, "token_truncated", cap=2.0)
  np.testing.assert_allclose(w, [[1.0, 2.0, 0.5, 0.0]], rtol=1e-6)
  np.testing.assert_array_equal(m, mask)  # the mask is never changed by token weights
  w3, _ = obj.rollout_correction(old, sampler, mask, "token_truncated", cap=3.5)
  np.testing.assert_allclose(w3, [[1.0, 3.0, 0.5, 0.0]], rtol=1e-6)


def test_sequence_mask_drops_rows_whose_product_leaves_the_band():
  # Row sums of log rho: log 1.5 (kept), log 3 (above), log 0.4 (below), log 0.5 (the edge, kept);
  # the last row's big value sits under padding and must not count.
  d = np.zeros((4, 3), np.float32)
  d[0, :2] = (LOG(1.5) / 2, LOG(1.5) / 2)
  d[1, 0], d[2, 1], d[3, 0], d[3, 2] = LOG(3.0), LOG(0.4), LOG(0.5) + 1e-6, 9.0
  mask = np.array([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 0]], np.float32)
  w, m = obj.rollout_correction(d, np.zeros_like(d), mask, "sequence_mask", band=(0.5, 2.0))
  keep = np.array([1, 0, 0, 1], np.float32)[:, None]
  np.testing.assert_array_equal(m, mask * keep)
  np.testing.assert_array_equal(w, mask * keep)


def test_none_is_the_identity_and_bad_settings_raise():
  d = np.full((2, 2), 0.3, np.float32)
  mask = np.ones((2, 2), np.float32)
  w, m = obj.rollout_correction(d, np.zeros_like(d), mask, "none")
  np.testing.assert_array_equal(w, mask)
  np.testing.assert_array_equal(m, mask)
  with pytest.raises(ValueError, match="rollout_is"):
    obj.rollout_correction(d, d, mask, "token")
  with pytest.raises(ValueError, match="lo <= 1 <= hi"):
    obj.rollout_correction(d, d, mask, "sequence_mask", band=(1.2, 2.0))


def test_weighted_policy_loss_and_gradient_in_closed_form():
  """On-policy (ratio 1), token-mean: loss = -sum(w A) / n and d loss / d logp_t = -w_t A / n;
  no gradient reaches the weights."""
  logp = jnp.zeros((1, 3))
  adv = jnp.array([2.0])
  mask = jnp.ones((1, 3))
  w = jnp.array([[1.0, 2.0, 0.5]])

  def loss(logp, w):
    return obj.compute_policy_loss(logp, logp, adv, mask, is_weights=w)[0]

  np.testing.assert_allclose(loss(logp, w), -2.0 * 3.5 / 3, rtol=1e-6)
  g_logp, g_w = jax.grad(loss, (0, 1))(logp, w)
  np.testing.assert_allclose(g_logp, -2.0 * w / 3, rtol=1e-6)
  np.testing.assert_array_equal(g_w, 0.0)


@pytest.fixture(scope="module")
def tiny_step():
  """One-layer model, a batch, and one compiled step per correction kind (shared below)."""
  model = create_model(get_preset("test", num_hidden_layers=1), seed=0)
  cfg = ts.TrainConfig(lr=1e-3, warmup_steps=0)
  graphdef, state = ts.init_train_state(model, cfg)
  rng = np.random.RandomState(1)
  b, p, r = 4, 3, 5
  ids = rng.randint(1, 100, (b, p + r)).astype(np.int32)
  attn = np.ones((b, p + r), bool)
  logp, _ = ts.LogProbForward(graphdef, cfg)(state.params, jnp.asarray(ids), jnp.asarray(attn), r)
  old = np.asarray(logp) + rng.normal(0, 0.1, (b, r)).astype(np.float32)
  batch = ts.TrainBatch(input_ids=ids, attention_mask=attn, response_mask=np.ones((b, r), bool),
                        old_log_probs=old, advantages=np.array([1.0, -1.0, 0.5, -0.5], np.float32))
  steps = {k: ts.TrainStep(graphdef, cfg.replace(rollout_is=k)) for k in obj.ROLLOUT_IS_KINDS}
  return steps, jax.tree.map(np.asarray, state), batch


def _update(step, state, batch):
  state = jax.tree.map(lambda x: jnp.array(np.asarray(x)), state)
  new, metrics = step(state, jax.tree.map(jnp.asarray, batch), 0)
  return jax.tree.map(np.asarray, new.params), jax.tree.map(np.asarray, metrics)


def test_train_step_sequence_mask_equals_masking_the_dropped_row(tiny_step):
  """The sampler below the old policy on every token of row 1 only (prod of weights 2^1.5 > 2):
  "sequence_mask" drops row 1, the same update as no correction with row 1's mask cleared."""
  steps, state, batch = tiny_step
  sampler = batch.old_log_probs.copy()
  sampler[1] -= LOG(2.0) / 5 * 1.5
  got, m = _update(steps["sequence_mask"], state, batch.replace(sampler_log_probs=sampler))
  mask = batch.response_mask.copy()
  mask[1] = False
  want, _ = _update(steps["none"], state, batch.replace(response_mask=mask))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), got, want)
  np.testing.assert_allclose(m["rollout_is_weight"], 0.75)  # 15 of 20 tokens kept


def test_train_step_token_weights_of_one_are_the_uncorrected_update(tiny_step):
  steps, state, batch = tiny_step
  got, m = _update(steps["token_truncated"], state,
                   batch.replace(sampler_log_probs=batch.old_log_probs))
  want, _ = _update(steps["none"], state, batch)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  assert float(m["rollout_is_weight"]) == 1.0
  with pytest.raises(ValueError, match="sampler_log_probs"):
    _update(steps["token_truncated"], state, batch)


def _traj(sampled_at):
  rng = np.random.RandomState(0)
  n, p, r = len(sampled_at), 2, 3
  return traj_lib.Trajectories(
      input_ids=np.ones((n, p + r), np.int32), attention_mask=np.ones((n, p + r), bool),
      response_mask=np.ones((n, r), bool),
      sampler_logprobs=rng.normal(-1, 0.3, (n, r)).astype(np.float32),
      lengths=np.full(n, r, np.int32), truncated=np.zeros(n, bool), reward=np.zeros(n, np.float32),
      score=np.zeros(n, np.float32), acc=np.zeros(n, bool),
      overlong_penalty=np.zeros(n, np.float32), group_ids=np.zeros(n, np.int32),
      texts=[""] * n, prompts=[""], sampled_at_step=np.asarray(sampled_at, np.int32))


def test_keep_surplus_carried_rows_get_weight_one_and_batches_carry_sampler_logp_only_when_on():
  traj = _traj([3, 5, 5, 3])  # rows 0 and 3 carried into step 5
  recomputed = traj.sampler_logprobs + 0.5  # the trainer 1.65x above the sampler everywhere
  old = traj_lib.behaviour_log_probs(traj, recomputed, step=5)
  w, _ = obj.rollout_correction(old, traj.sampler_logprobs, traj.response_mask,
                                "token_truncated", cap=10.0)
  np.testing.assert_array_equal(np.asarray(w)[[0, 3]], 1.0)  # their behaviour policy is exact
  np.testing.assert_allclose(np.asarray(w)[[1, 2]], math.exp(0.5), rtol=1e-6)
  adv = np.zeros(4, np.float32)
  off, = traj_lib.mini_batches(traj, adv, old, 4, None)
  on, = traj_lib.mini_batches(traj, adv, old, 4, None, with_sampler_logp=True)
  assert off.sampler_log_probs is None  # the default program takes no extra input
  np.testing.assert_array_equal(on.sampler_log_probs, traj.sampler_logprobs)


def test_config_validation_names_the_field():
  c = config_lib.default_config()
  c.algorithm.rollout_is = "token_truncated"
  config_lib.validate(c)
  c.rollout.use_sampler_logprobs = True
  with pytest.raises(ValueError, match=r"algorithm.rollout_is=.*use_sampler_logprobs"):
    config_lib.validate(c)
  c = config_lib.default_config()
  c.algorithm.rollout_is = "tis"
  with pytest.raises(ValueError, match="algorithm.rollout_is='tis'"):
    config_lib.validate(c)
  c = config_lib.default_config()
  c.algorithm.rollout_is_band = (0.5, 0.9)
  with pytest.raises(ValueError, match="algorithm.rollout_is_band"):
    config_lib.validate(c)
