"""Tests of dapo_jax.trainer.objective against the closed forms of spec sections 3-4."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax.models import logprobs
from dapo_jax.trainer import objective as obj

MODES = obj.LOSS_AGG_MODES


# ---------------------------------------------------------------------------
# Section 3: advantages.
# ---------------------------------------------------------------------------

# (G, k correct) groups, several sizes in one batch.
_GROUPS = [(2, 1), (4, 1), (4, 3), (5, 2), (16, 1), (16, 8), (16, 15)]


def _mixed_batch(seed=0):
  """±1 rewards for _GROUPS plus a singleton and an all-correct group."""
  scores, ids, expected = [], [], []
  for gid, (g, k) in enumerate(_GROUPS):
    scale = math.sqrt((g - 1) / g)  # ddof=1 correction (spec 3).
    a_pos = math.sqrt((g - k) / k) * scale
    a_neg = -math.sqrt(k / (g - k)) * scale
    scores += [1.0] * k + [-1.0] * (g - k)
    expected += [a_pos] * k + [a_neg] * (g - k)
    ids += [gid] * g
  # Singleton: mean 0, std 1, so A = R / (1 + eps).
  scores.append(0.7)
  expected.append(0.7 / (1 + 1e-6))
  ids.append(len(_GROUPS))
  # Zero variance: A = 0.
  scores += [1.0] * 4
  expected += [0.0] * 4
  ids += [len(_GROUPS) + 1] * 4
  perm = np.random.default_rng(seed).permutation(len(scores))
  return (np.asarray(scores, np.float32)[perm], np.asarray(ids, np.int32)[perm],
          np.asarray(expected)[perm], len(_GROUPS) + 2)


def test_advantage_closed_form_shuffled_groups():
  scores, ids, expected, _ = _mixed_batch()
  adv = obj.compute_grpo_outcome_advantage(scores, ids)
  np.testing.assert_allclose(adv, expected, rtol=1e-5, atol=1e-6)


def test_advantage_under_jit_matches_eager():
  scores, ids, expected, num_groups = _mixed_batch(seed=1)
  fn = jax.jit(obj.compute_grpo_outcome_advantage,
               static_argnames=("num_groups",))
  np.testing.assert_allclose(fn(scores, ids, num_groups=num_groups), expected,
                             rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="num_groups"):
    jax.jit(obj.compute_grpo_outcome_advantage)(scores, ids)


def test_advantage_dr_grpo_is_mean_centred():
  scores = np.array([1.0, -1.0, -1.0, -1.0, 3.0], np.float32)
  ids = np.array([0, 0, 0, 0, 1])
  adv = obj.compute_grpo_outcome_advantage(scores, ids, norm_adv_by_std=False)
  np.testing.assert_allclose(adv, [1.5, -0.5, -0.5, -0.5, 3.0], atol=1e-6)


def test_advantage_rejects_bad_ids():
  with pytest.raises(ValueError, match=r"\[0, 2\)"):
    obj.compute_grpo_outcome_advantage([1.0, 0.0, 1.0], [0, 1, 2],
                                       num_groups=2)
  with pytest.raises(ValueError, match="integers"):
    obj.compute_grpo_outcome_advantage([1.0, 0.0], [0.0, 1.0])


def test_group_ids_from_uids_and_broadcast():
  ids = obj.group_ids_from_uids(["b", "a", "b", "c", "a"])
  np.testing.assert_array_equal(ids, [0, 1, 0, 2, 1])
  mask = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
  np.testing.assert_allclose(
      obj.broadcast_to_tokens(np.array([2.0, -1.0]), mask),
      [[2, 2, 0], [-1, 0, 0]])


# ---------------------------------------------------------------------------
# Section 4: policy loss.
# ---------------------------------------------------------------------------


def _token_loss_and_grad(ratio, adv, **kw):
  """Loss and d loss / d logp of one token with the given ratio."""
  old = jnp.zeros((1, 1))
  mask = jnp.ones((1, 1))
  f = lambda lp: obj.compute_policy_loss(old, lp, jnp.array([adv]), mask,
                                         **kw)[0]
  logp = jnp.full((1, 1), math.log(ratio))
  loss, grad = jax.value_and_grad(f)(logp)
  return float(loss), float(grad[0, 0])


@pytest.mark.parametrize("ratio", [0.5, 0.9, 1.0, 1.2, 1.27, 1.29, 1.5, 3.0])
def test_positive_advantage_plateaus_at_one_plus_eps_high(ratio):
  a = 1.5
  loss, grad = _token_loss_and_grad(ratio, a)
  assert loss == pytest.approx(-a * min(ratio, 1.28), rel=1e-5)
  # d(-A r)/d logp = -A r below the clip, flat beyond it.
  assert grad == pytest.approx(-a * ratio if ratio < 1.28 else 0.0, abs=1e-5)


@pytest.mark.parametrize("ratio", [0.3, 0.79, 0.81, 1.0, 1.5, 9.0, 11.0, 1e3])
def test_negative_advantage_clip_low_and_dual_clip(ratio):
  a = -2.0
  loss, grad = _token_loss_and_grad(ratio, a)
  expected = -a * min(max(ratio, 0.8), 10.0)
  assert loss == pytest.approx(expected, rel=1e-5)
  live = 0.8 < ratio < 10.0
  assert grad == pytest.approx(-a * ratio if live else 0.0, rel=1e-5,
                               abs=1e-5)


def test_old_log_prob_carries_no_gradient():
  # Old log-probs may come from the same forward pass (on-policy update);
  # the ratio must still only differentiate through the current policy.
  _, logp, adv, mask = _random_batch()
  grad = jax.grad(lambda o: obj.compute_policy_loss(o, logp, adv, mask)[0])(
      jnp.asarray(logp))
  np.testing.assert_array_equal(grad, 0.0)


def test_dual_clip_caps_huge_ratio_at_minus_a_c():
  loss, _ = _token_loss_and_grad(math.exp(30.0), -2.0, clip_ratio_c=3.0)
  assert loss == pytest.approx(6.0)


def test_symmetric_and_decoupled_clip_differ():
  sym, _ = _token_loss_and_grad(1.25, 1.0, clip_ratio_high=0.2)
  dec, _ = _token_loss_and_grad(1.25, 1.0)
  assert sym == pytest.approx(-1.2, rel=1e-6)
  assert dec == pytest.approx(-1.25, rel=1e-6)


def test_clipfrac_metrics_on_hand_built_tokens():
  # (A, ratio): clipped-high, inside, clipped-low, dual-clipped, inside,
  # and a masked token that must not count.
  adv = jnp.array([[1.0, 1.0, -1.0, -1.0, -1.0, 1.0]])
  ratio = np.array([[1.5, 0.5, 0.5, 20.0, 1.1, 1.5]])
  mask = jnp.array([[1, 1, 1, 1, 1, 0]], jnp.float32)
  logp = jnp.log(jnp.asarray(ratio, jnp.float32))
  loss, m = obj.compute_policy_loss(jnp.zeros_like(logp), logp, adv, mask)
  assert float(m["pg_clipfrac"]) == pytest.approx(2 / 5)
  assert float(m["pg_clipfrac_lower"]) == pytest.approx(1 / 5)
  assert float(m["ppo_kl"]) == pytest.approx(
      -np.log(ratio[0, :5]).mean(), rel=1e-5)
  per_token = [-1.28, -0.5, 0.8, 10.0, 1.1]
  assert float(loss) == pytest.approx(np.mean(per_token), rel=1e-5)
  # [B] advantages broadcast like [B, R].
  loss_b, _ = obj.compute_policy_loss(jnp.zeros_like(logp), logp,
                                      jnp.array([1.0]), mask)
  loss_bt, _ = obj.compute_policy_loss(jnp.zeros_like(logp), logp,
                                       jnp.ones((1, 6)), mask)
  assert float(loss_b) == pytest.approx(float(loss_bt))


# ---------------------------------------------------------------------------
# Section 4: aggregation.
# ---------------------------------------------------------------------------

_LOSS = np.array([[1, 2, 3, 4], [5, 6, 0, 0], [9, 9, 9, 9]], np.float32)
_MASK = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], np.float32)
_HAND = {
    "token-mean": 11 / 4,
    "seq-mean-token-mean": (6 / 3 + 5 / 1) / 2,
    "seq-mean-token-sum": (6 + 5) / 2,
    "seq-mean-token-sum-norm": 11 / (2 * 4),
    "token-sum-norm": 11 / 4,
}


@pytest.mark.parametrize("mode", MODES)
def test_agg_modes_hand_computed(mode):
  # The third row is fully masked (padding / overlong-filtered): it counts as
  # no sequence in any mode.
  assert float(obj.agg_loss(_LOSS, _MASK, mode)) == pytest.approx(_HAND[mode])
  assert float(obj.agg_loss(_LOSS[:2], _MASK[:2], mode)) == pytest.approx(
      _HAND[mode])


def _random_batch(seed=0, b=8, t=16):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, t + 1, size=b)
  lengths[0], lengths[1] = 1, t  # make sure lengths are unequal.
  mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
  old = rng.normal(-2.0, 0.5, (b, t)).astype(np.float32)
  logp = (old + rng.normal(0.0, 0.3, (b, t))).astype(np.float32)
  adv = rng.normal(0.0, 1.0, b).astype(np.float32)
  return old, logp, adv, mask


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_micro", [1, 2, 4])
def test_micro_batch_sum_equals_full_batch(mode, num_micro):
  old, logp, adv, mask = _random_batch()
  den = obj.loss_denominator(mask, mode)

  def full(lp):
    return obj.compute_policy_loss(old, lp, adv, mask, loss_agg_mode=mode)[0]

  def split(lp):
    total = 0.0
    for s in np.split(np.arange(old.shape[0]), num_micro):
      total += obj.compute_policy_loss(old[s], lp[s], adv[s], mask[s],
                                       loss_agg_mode=mode,
                                       loss_denominator=den)[0]
    return total

  loss_full, grad_full = jax.value_and_grad(full)(jnp.asarray(logp))
  loss_split, grad_split = jax.value_and_grad(split)(jnp.asarray(logp))
  assert abs(float(loss_full)) > 1e-3  # a trivial zero would prove nothing.
  np.testing.assert_allclose(loss_split, loss_full, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grad_split, grad_full, rtol=1e-5, atol=1e-7)


def test_policy_loss_under_jit_with_traced_denominator():
  old, logp, adv, mask = _random_batch(seed=2)
  den = obj.loss_denominator(mask, "token-mean")
  fn = jax.jit(lambda o, lp, a, m, d: obj.compute_policy_loss(
      o, lp, a, m, loss_denominator=d))
  jit_loss, jit_metrics = fn(old, logp, adv, mask, den)
  loss, metrics = obj.compute_policy_loss(old, logp, adv, mask)
  np.testing.assert_allclose(jit_loss, loss, rtol=1e-6)
  for k in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
    np.testing.assert_allclose(jit_metrics[k], metrics[k], rtol=1e-6)


def test_verl_microbatch_approximation():
  old, logp, adv, mask = _random_batch(seed=3)
  loss_mat = jnp.asarray(np.random.default_rng(4).normal(size=old.shape))
  b = old.shape[0]

  def verl(m, mode):
    return sum(obj.agg_loss_verl_microbatch(loss_mat[s], m[s], mode, b)
               for s in np.split(np.arange(b), 2))

  # Unequal lengths: per-micro-batch token-mean is not the global token mean.
  exact = float(obj.agg_loss(loss_mat, mask, "token-mean"))
  assert abs(float(verl(mask, "token-mean")) - exact) > 1e-3
  # Equal lengths: every micro-batch has the same token count, so it is exact.
  full_mask = np.ones_like(mask)
  assert float(verl(full_mask, "token-mean")) == pytest.approx(
      float(obj.agg_loss(loss_mat, full_mask, "token-mean")), rel=1e-5)
  # Sequence-normalised modes are exact under sequence-count weighting.
  for mode in ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
    assert float(verl(mask, mode)) == pytest.approx(
        float(obj.agg_loss(loss_mat, mask, mode)), rel=1e-5)


def test_token_sum_norm_against_verls_actor_divisor():
  # verl's seq-mean-token-sum-norm: sum(loss*M)/R per micro-batch, divided by the number of
  # micro-batches before accumulating: an effective divisor R x K (docs/algorithm.md section 4).
  _, _, _, mask = _random_batch(seed=5)  # every row has a response token
  loss_mat = jnp.asarray(np.random.default_rng(6).normal(size=mask.shape))
  b, r = mask.shape
  for k in (1, 2, 4):
    micro = np.split(np.arange(b), k)
    verls = sum(float((loss_mat[s] * mask[s]).sum()) / r / k for s in micro)
    ours_verl_mode = sum(float(obj.agg_loss_verl_microbatch(
        loss_mat[s], mask[s], "token-sum-norm", b)) for s in micro)
    assert ours_verl_mode == pytest.approx(verls, rel=1e-5), k
    # The exact mode divides by R alone: K times verl's, whatever the micro-batches.
    exact = float(obj.agg_loss(loss_mat, mask, "token-sum-norm"))
    assert exact == pytest.approx(k * verls, rel=1e-5), k


def test_dr_grpo_denominator_uses_max_response_length():
  den = obj.loss_denominator(_MASK, "seq-mean-token-sum-norm",
                             max_response_length=10)
  assert float(den) == 2 * 10
  assert float(obj.loss_denominator(_MASK, "token-mean")) == 4


def _numpy_agg(loss, mask, mode):
  """Independent numpy statements of the two token-sum norms (verl core_algos / Dr.GRPO)."""
  seq_sums = (loss * mask).sum(-1)
  if mode == "token-sum-norm":  # verl: sum(seq_losses) / loss_mask.shape[-1]
    return seq_sums.sum() / mask.shape[-1]
  return seq_sums[mask.any(-1)].mean() / mask.shape[-1]  # Dr.GRPO: mean over responses


@pytest.mark.parametrize("mode", ["token-sum-norm", "seq-mean-token-sum-norm"])
def test_token_sum_norms_match_numpy(mode):
  """Issue 17 D4: verl's variant (/ T) and Dr.GRPO's (/ sequences x T) under their own names,
  each equal to its numpy statement for the whole batch and summed over micro-batches."""
  old, logp, adv, mask = _random_batch(seed=5)
  rng = np.random.default_rng(6)
  loss_mat = rng.normal(size=mask.shape).astype(np.float32)
  want = _numpy_agg(loss_mat.astype(np.float64), mask, mode)
  assert float(obj.agg_loss(loss_mat, mask, mode)) == pytest.approx(want, rel=1e-5)
  den = obj.loss_denominator(mask, mode)
  split = sum(float(obj.agg_loss(loss_mat[s], mask[s], mode, den))
              for s in np.split(np.arange(mask.shape[0]), 4))
  assert split == pytest.approx(want, rel=1e-5)
  # The policy loss aggregates its per-token loss the same way.
  ratio = np.exp(np.clip(logp - old, -20, 20))
  a = adv[:, None].astype(np.float64)
  per_tok = np.maximum(-a * ratio, -a * np.clip(ratio, 0.8, 1.28))
  per_tok = np.where(a < 0, np.minimum(per_tok, -a * 10.0), per_tok)
  got = obj.compute_policy_loss(old, logp, adv, mask, loss_agg_mode=mode)[0]
  assert float(got) == pytest.approx(_numpy_agg(per_tok, mask, mode), rel=1e-5)
  # The two differ by the number of sequences.
  assert float(obj.agg_loss(loss_mat, mask, "token-sum-norm")) == pytest.approx(
      mask.shape[0] * float(obj.agg_loss(loss_mat, mask, "seq-mean-token-sum-norm")), rel=1e-5)


def test_empty_mask_gives_zero_not_nan():
  for mode in MODES:
    assert float(obj.agg_loss(_LOSS, np.zeros_like(_MASK), mode)) == 0.0


# ---------------------------------------------------------------------------
# Options and validation.
# ---------------------------------------------------------------------------


def test_kl_penalty_kinds():
  logp = jnp.log(jnp.array([[0.5, 0.25]]))
  ref = jnp.log(jnp.array([[0.25, 0.25]]))
  np.testing.assert_allclose(obj.kl_penalty(logp, ref, "k1"),
                             [[math.log(2), 0.0]], rtol=1e-6)
  # k3: r - log r - 1 with r = p_ref / p = 0.5.
  np.testing.assert_allclose(obj.kl_penalty(logp, ref, "k3"),
                             [[0.5 + math.log(2) - 1, 0.0]], rtol=1e-5)
  np.testing.assert_allclose(obj.kl_penalty(logp, ref, "low_var_kl"),
                             obj.kl_penalty(logp, ref, "k3"))
  np.testing.assert_allclose(obj.kl_penalty(logp, ref, "mse"),
                             [[0.5 * math.log(2)**2, 0.0]], rtol=1e-6)
  # Clamped to 10 where the reference is far more likely.
  assert float(obj.kl_penalty(jnp.array([[-30.0]]), jnp.array([[0.0]]),
                              "k3")[0, 0]) == 10.0
  np.testing.assert_allclose(obj.kl_penalty(logp, ref, "abs"), [[math.log(2), 0.0]], rtol=1e-6)
  with pytest.raises(ValueError, match="'k1'"):
    obj.kl_penalty(logp, ref, "full")  # verl's whole-distribution KL is not offered


def test_abs_kl_gradient_is_sign_of_the_difference_and_zero_at_equality():
  # verl's |logp - ref| has gradient sign(d), 0 where the policy equals the reference (JAX's
  # abs'(0) is +1: a policy at the reference would still be pushed down).
  grad = jax.grad(lambda x: obj.kl_penalty(x, jnp.array([[0.0, 0.0, 0.0]]), "abs").sum())(
      jnp.array([[0.0, 0.3, -0.2]]))
  np.testing.assert_array_equal(grad, [[0.0, 1.0, -1.0]])


def test_entropy_from_logits_stable_and_correct():
  z = np.random.default_rng(0).normal(size=(3, 7)).astype(np.float32)
  p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
  np.testing.assert_allclose(logprobs.entropy_from_logits(z),
                             -(p * np.log(p)).sum(-1), rtol=1e-5)
  # A huge common offset changes nothing (naive exp would overflow).
  np.testing.assert_allclose(logprobs.entropy_from_logits(z + 1e4),
                             logprobs.entropy_from_logits(z), atol=1e-2)
  assert float(logprobs.entropy_from_logits(jnp.zeros(50))) == pytest.approx(
      math.log(50), rel=1e-6)
  assert np.isfinite(logprobs.entropy_from_logits(jnp.array([0.0, -1e30]))).all()


def test_overlong_filter_zeros_truncated_rows():
  mask = np.ones((3, 4), np.float32)
  out = obj.apply_overlong_filter(mask, np.array([False, True, False]))
  np.testing.assert_array_equal(out, [[1] * 4, [0] * 4, [1] * 4])
  assert out.dtype == mask.dtype


def test_validation_errors_are_actionable():
  with pytest.raises(ValueError) as e:
    obj.agg_loss(_LOSS, _MASK, "token_mean")
  for mode in MODES:
    assert mode in str(e.value)
  with pytest.raises(ValueError, match="clip_ratio_low"):
    obj.compute_policy_loss(_LOSS, _LOSS, _LOSS, _MASK, clip_ratio_low=1.0)
  with pytest.raises(ValueError, match="clip_ratio_high"):
    obj.compute_policy_loss(_LOSS, _LOSS, _LOSS, _MASK, clip_ratio_high=-0.1)
  with pytest.raises(ValueError, match="clip_ratio_c"):
    obj.compute_policy_loss(_LOSS, _LOSS, _LOSS, _MASK, clip_ratio_c=0.5)
