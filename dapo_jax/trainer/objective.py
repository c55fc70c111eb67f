"""The DAPO objective: group advantages, clipped policy loss, loss aggregation.

Pure `jax.numpy`; no model code. Spec sections 3 (advantage) and 4 (loss).
Shape suffixes (docs/shapes.md): B sequences, R response tokens, Q prompt groups.

One piece: the whole loss of spec sections 3-4 (advantages, clipping, every loss aggregation,
rollout correction, KL) in one place, so the variants can be compared line by line.
"""

from __future__ import annotations

import numbers
from typing import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

Array = jax.Array

TOKEN_MEAN = "token-mean"
SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"  # Dr.GRPO: / (sequences x T)
TOKEN_SUM_NORM = "token-sum-norm"  # verl's seq-mean-token-sum-norm: / T only
LOSS_AGG_MODES = (TOKEN_MEAN, SEQ_MEAN_TOKEN_MEAN, SEQ_MEAN_TOKEN_SUM,
                  SEQ_MEAN_TOKEN_SUM_NORM, TOKEN_SUM_NORM)
# verl's kl_penalty estimators (its "full", on whole distributions, is not offered).
KL_PENALTY_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
# Rollout corrections (`rollout_correction`): none (DAPO), verl's Token-TIS, a sequence mask.
ROLLOUT_IS_KINDS = ("none", "token_truncated", "sequence_mask")

# Log-ratios are clamped to +-20 before exp() (as verl does) so one outlier
# token cannot overflow float32. Nothing is lost: that far out the clipped
# loss of spec section 4 is flat in the ratio, or (A > 0, ratio ~ 0) ~ 0.
_MAX_LOG_RATIO = 20.0


# ----------------------------------------------------------------------------
# Validation.
# ----------------------------------------------------------------------------


def validate_loss_agg_mode(loss_agg_mode: str) -> None:
  """Raises ValueError naming the valid modes if `loss_agg_mode` is unknown."""
  if loss_agg_mode not in LOSS_AGG_MODES:
    raise ValueError(
        f"Unknown loss_agg_mode {loss_agg_mode!r}; valid modes are "
        f"{', '.join(repr(m) for m in LOSS_AGG_MODES)} (spec section 4).")


def validate_clip_ratios(clip_ratio_low: float, clip_ratio_high: float,
                         clip_ratio_c: float) -> None:
  """Raises ValueError unless 0 <= low < 1, high >= 0 and c > 1.

  Traced (non-Python) values are not checked: validation is a config check.
  """
  def concrete(x):
    return isinstance(x, numbers.Real)

  if concrete(clip_ratio_low) and not 0.0 <= clip_ratio_low < 1.0:
    raise ValueError(
        f"clip_ratio_low={clip_ratio_low} must be in [0, 1): the ratio is "
        f"clipped below at 1 - clip_ratio_low, which must stay positive.")
  if concrete(clip_ratio_high) and not clip_ratio_high >= 0.0:
    raise ValueError(
        f"clip_ratio_high={clip_ratio_high} must be >= 0 (DAPO uses 0.28).")
  if concrete(clip_ratio_c) and not clip_ratio_c > 1.0:
    raise ValueError(
        f"clip_ratio_c={clip_ratio_c} must be > 1 (dual-clip bound on the "
        f"ratio for negative advantages; DAPO scripts use 10.0).")


# ----------------------------------------------------------------------------
# Section 3: group advantage.
# ----------------------------------------------------------------------------


def _concrete_or_none(x: Array) -> np.ndarray | None:
  """Host copy of `x`, or None when `x` is traced (inside jit)."""
  try:
    return np.asarray(x)
  except jax.errors.TracerArrayConversionError:
    return None


def group_ids_from_uids(uids: Sequence[Hashable]) -> np.ndarray:
  """Maps arbitrary group keys (e.g. uuid strings) to dense int32 ids.

  Host-side helper: ids are assigned in order of first appearance, so the
  result can be fed to `compute_grpo_outcome_advantage` with
  `num_groups = ids.max() + 1`.
  """
  table: dict[Hashable, int] = {}
  return np.asarray([table.setdefault(u, len(table)) for u in uids],
                    dtype=np.int32)


def compute_grpo_outcome_advantage(scores: ArrayLike,
                                   group_ids: ArrayLike,
                                   num_groups: int | None = None,
                                   epsilon: float = 1e-6,
                                   norm_adv_by_std: bool = True) -> Array:
  """Per-sequence GRPO advantage `(R - mean_g) / (std_g + eps)` (spec 3).

  Args:
    scores: [B] scalar reward per response.
    group_ids: [B] integer group id per response, in [0, num_groups), in any
      order (use `group_ids_from_uids` for non-integer keys).
    num_groups: static number of segments. Required under `jax.jit`; if None
      it is read from the (then concrete) ids as `max + 1`.
    epsilon: added to the std, so a zero-variance group gets advantage 0.
    norm_adv_by_std: False gives Dr.GRPO's mean-centred advantage.

  Returns:
    [B] float32 advantages; see `broadcast_to_tokens` for [B, R].
  """
  scores_B = jnp.asarray(scores, jnp.float32)
  ids_B = jnp.asarray(group_ids)
  if scores_B.ndim != 1 or ids_B.shape != scores_B.shape:
    raise ValueError(f"scores and group_ids must both be [B]; got "
                     f"{scores_B.shape} and {ids_B.shape}.")
  if not jnp.issubdtype(ids_B.dtype, jnp.integer):
    raise ValueError(f"group_ids must be integers, got {ids_B.dtype}; map "
                     f"string uids with group_ids_from_uids().")
  concrete_ids = _concrete_or_none(ids_B)
  if num_groups is None:
    if concrete_ids is None:
      raise ValueError("num_groups must be given (static) when "
                       "compute_grpo_outcome_advantage runs under jit.")
    num_groups = int(concrete_ids.max()) + 1 if concrete_ids.size else 0
  if concrete_ids is not None and concrete_ids.size and (
      concrete_ids.min() < 0 or concrete_ids.max() >= num_groups):
    # segment_sum would silently drop these rows.
    raise ValueError(f"group_ids must lie in [0, {num_groups}); got "
                     f"[{concrete_ids.min()}, {concrete_ids.max()}].")

  seg_sum = lambda x: jax.ops.segment_sum(x, ids_B, num_segments=num_groups)
  count_Q = seg_sum(jnp.ones_like(scores_B))
  mean_Q = seg_sum(scores_B) / jnp.maximum(count_Q, 1.0)
  # Two-pass variance: stable for rewards with a large common offset.
  sq_dev_Q = seg_sum(jnp.square(scores_B - mean_Q[ids_B]))
  # Unbiased std (ddof=1), as torch.std in verl; jnp.std would use ddof=0.
  std_Q = jnp.sqrt(sq_dev_Q / jnp.maximum(count_Q - 1.0, 1.0))
  # A singleton group has no spread to normalise by: mean 0, std 1 (spec 3).
  singleton_Q = count_Q <= 1.0
  mean_Q = jnp.where(singleton_Q, 0.0, mean_Q)
  std_Q = jnp.where(singleton_Q, 1.0, std_Q)

  centred_B = scores_B - mean_Q[ids_B]
  if not norm_adv_by_std:
    return centred_B
  return centred_B / (std_Q[ids_B] + epsilon)


def broadcast_to_tokens(advantages_B: ArrayLike,
                        response_mask_BxR: ArrayLike) -> Array:
  """[B] advantages -> [B, R], zero outside the response mask (spec 3)."""
  adv_B = jnp.asarray(advantages_B, jnp.float32)
  return adv_B[:, None] * jnp.asarray(response_mask_BxR, jnp.float32)


# ----------------------------------------------------------------------------
# Section 4: aggregation.
# ----------------------------------------------------------------------------


def masked_mean(x: ArrayLike, mask: ArrayLike) -> Array:
  """Mean of `x` over `mask`; 0 when the mask is empty."""
  mask = jnp.asarray(mask, jnp.float32)
  total = jnp.sum(jnp.asarray(x, jnp.float32) * mask)
  return total / jnp.maximum(jnp.sum(mask), 1.0)


def _seq_valid_B(loss_mask_BxR: Array) -> Array:
  # A fully masked row (padding, or a response removed by overlong filtering)
  # is not a sequence: it counts in no denominator.
  return (jnp.sum(loss_mask_BxR, axis=-1) > 0).astype(jnp.float32)


def _agg_numerator(loss_BxR: Array, mask_BxR: Array, mode: str) -> Array:
  """The part of each mode that is additive over micro-batches."""
  if mode == SEQ_MEAN_TOKEN_MEAN:
    tokens_B = jnp.sum(mask_BxR, axis=-1)
    seq_mean_B = jnp.sum(loss_BxR * mask_BxR, axis=-1) / jnp.maximum(
        tokens_B, 1.0)
    return jnp.sum(seq_mean_B)  # empty rows contribute 0 / 1 = 0.
  # token-mean, seq-mean-token-sum and both token-sum norms sum every masked token.
  return jnp.sum(loss_BxR * mask_BxR)


def loss_denominator(response_mask: ArrayLike, loss_agg_mode: str,
                     max_response_length: int | None = None) -> Array:
  """Normaliser of `loss_agg_mode` for a whole mini-batch (spec 4).

  Pass the result to `agg_loss` / `compute_policy_loss` for every micro-batch
  of that mini-batch: the micro-batch losses then SUM to the full-batch loss.

  Args:
    response_mask: [B, R] mask of the whole mini-batch.
    loss_agg_mode: one of LOSS_AGG_MODES.
    max_response_length: T_max of Dr.GRPO; defaults to the mask's R.

  Returns:
    Scalar float32: response tokens (token-mean); sequences with at least one
    response token (seq-mean-*); that count times T_max (Dr.GRPO); T_max
    alone (token-sum-norm, verl's variant).
  """
  validate_loss_agg_mode(loss_agg_mode)
  return _denominator(jnp.asarray(response_mask, jnp.float32), loss_agg_mode,
                      max_response_length)


def _denominator(mask_BxR: Array, mode: str,
                 max_response_length: int | None = None) -> Array:
  if mode == TOKEN_MEAN:
    return jnp.sum(mask_BxR)
  t_max = float(mask_BxR.shape[-1] if max_response_length is None else
                max_response_length)
  if mode == TOKEN_SUM_NORM:
    return jnp.asarray(t_max, jnp.float32)
  num_seqs = jnp.sum(_seq_valid_B(mask_BxR))
  if mode == SEQ_MEAN_TOKEN_SUM_NORM:
    return num_seqs * t_max
  return num_seqs


def agg_loss(loss_mat: ArrayLike,
             loss_mask: ArrayLike,
             loss_agg_mode: str = TOKEN_MEAN,
             loss_denominator: ArrayLike | None = None) -> Array:
  """Reduces a [B, R] per-token loss to a scalar (spec 4 table).

  Args:
    loss_mat: [B, R] per-token loss.
    loss_mask: [B, R] response mask.
    loss_agg_mode: 'token-mean' (DAPO), 'seq-mean-token-mean' (GRPO),
      'seq-mean-token-sum', 'seq-mean-token-sum-norm' (Dr.GRPO: / (sequences
      x T)), 'token-sum-norm' (verl's seq-mean-token-sum-norm: / T).
    loss_denominator: the whole mini-batch's normaliser (see the function
      `loss_denominator`) when this is one micro-batch of it; None normalises
      by this batch alone.

  Returns:
    Scalar float32 loss.
  """
  validate_loss_agg_mode(loss_agg_mode)
  loss_BxR = jnp.asarray(loss_mat, jnp.float32)
  mask_BxR = jnp.asarray(loss_mask, jnp.float32)
  if loss_BxR.shape != mask_BxR.shape or loss_BxR.ndim != 2:
    raise ValueError(f"loss_mat and loss_mask must both be [B, R]; got "
                     f"{loss_BxR.shape} and {mask_BxR.shape}.")
  if loss_denominator is None:
    den = _denominator(mask_BxR, loss_agg_mode)
  else:
    den = jnp.asarray(loss_denominator, jnp.float32)
  # An empty batch yields 0, not NaN.
  den = jnp.where(den > 0, den, 1.0)
  return _agg_numerator(loss_BxR, mask_BxR, loss_agg_mode) / den


def verl_microbatch_weight(response_mask: ArrayLike,
                           total_num_sequences: ArrayLike) -> Array:
  """Weight verl's reproduction gives a micro-batch: its share of sequences.

  Sequences are counted as in `loss_denominator` (rows with a response token);
  `total_num_sequences` is that count over the whole mini-batch.
  """
  mask_BxR = jnp.asarray(response_mask, jnp.float32)
  return jnp.sum(_seq_valid_B(mask_BxR)) / jnp.asarray(total_num_sequences,
                                                       jnp.float32)


def agg_loss_verl_microbatch(loss_mat: ArrayLike, loss_mask: ArrayLike,
                             loss_agg_mode: str,
                             total_num_sequences: ArrayLike) -> Array:
  """verl's approximation (spec 4): per-micro-batch loss x sequence share.

  Summed over micro-batches this equals `agg_loss` on the full batch only when
  the normaliser is proportional to the sequence count; for 'token-mean' with
  unequal response lengths it does not. Kept for parity experiments.
  """
  return agg_loss(loss_mat, loss_mask, loss_agg_mode) * verl_microbatch_weight(
      loss_mask, total_num_sequences)


# ----------------------------------------------------------------------------
# Section 4: policy loss.
# ----------------------------------------------------------------------------


def compute_policy_loss(
    old_log_prob: ArrayLike,
    log_prob: ArrayLike,
    advantages: ArrayLike,
    response_mask: ArrayLike,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: float = 10.0,
    loss_agg_mode: str = TOKEN_MEAN,
    loss_denominator: ArrayLike | None = None,
    is_weights: ArrayLike | None = None,
) -> tuple[Array, dict[str, Array]]:
  """Clip-Higher PPO loss with dual clip (spec 4).

  Args:
    old_log_prob: [B, R] log-probs of the rollout policy (no gradient).
    log_prob: [B, R] log-probs of the current policy.
    advantages: [B] or [B, R].
    response_mask: [B, R].
    clip_ratio_low: eps_low; ratio clipped below at 1 - eps_low.
    clip_ratio_high: eps_high; ratio clipped above at 1 + eps_high.
    clip_ratio_c: dual-clip bound; caps the loss at -A * c where A < 0.
    loss_agg_mode: see `agg_loss`.
    loss_denominator: whole mini-batch normaliser for micro-batching; see
      `agg_loss`.
    is_weights: [B, R] rollout-correction weights (`rollout_correction`, no
      gradient) multiplied into the per-token loss after the clips, as verl's
      `pg_losses * rollout_is_weights`; None: 1.

  Returns:
    (scalar loss, metrics) with metrics `pg_clipfrac`, `pg_clipfrac_lower`,
    `ppo_kl`: masked means over this batch.
  """
  validate_clip_ratios(clip_ratio_low, clip_ratio_high, clip_ratio_c)
  validate_loss_agg_mode(loss_agg_mode)
  old_logp_BxR = jax.lax.stop_gradient(jnp.asarray(old_log_prob, jnp.float32))
  logp_BxR = jnp.asarray(log_prob, jnp.float32)
  mask_BxR = jnp.asarray(response_mask, jnp.float32)
  adv = jnp.asarray(advantages, jnp.float32)
  adv_BxR = adv[:, None] if adv.ndim == 1 else adv
  adv_BxR = jnp.broadcast_to(adv_BxR, logp_BxR.shape)

  log_ratio_BxR = jnp.clip(logp_BxR - old_logp_BxR, -_MAX_LOG_RATIO,
                           _MAX_LOG_RATIO)
  ratio_BxR = jnp.exp(log_ratio_BxR)
  pg1_BxR = -adv_BxR * ratio_BxR
  # Decoupled clip range: Clip-Higher (spec 1, 4).
  pg2_BxR = -adv_BxR * jnp.clip(ratio_BxR, 1.0 - clip_ratio_low,
                                1.0 + clip_ratio_high)
  clipped_BxR = jnp.maximum(pg1_BxR, pg2_BxR)
  # Dual clip, only where A < 0: bounds the loss of a token whose ratio blew
  # up, at -A * c (spec 4).
  pg3_BxR = -adv_BxR * clip_ratio_c
  neg_adv_BxR = adv_BxR < 0
  loss_BxR = jnp.where(neg_adv_BxR, jnp.minimum(clipped_BxR, pg3_BxR),
                       clipped_BxR)
  if is_weights is not None:
    loss_BxR = loss_BxR * jax.lax.stop_gradient(jnp.asarray(is_weights, jnp.float32))

  loss = agg_loss(loss_BxR, mask_BxR, loss_agg_mode, loss_denominator)
  metrics = {
      "pg_clipfrac": masked_mean(pg2_BxR > pg1_BxR, mask_BxR),
      "pg_clipfrac_lower": masked_mean(
          (clipped_BxR > pg3_BxR) & neg_adv_BxR, mask_BxR),
      "ppo_kl": masked_mean(-log_ratio_BxR, mask_BxR),
  }
  return loss, metrics


# ----------------------------------------------------------------------------
# Options, all off by default in DAPO.
# ----------------------------------------------------------------------------


def validate_rollout_correction(kind: str, cap: float,
                                band: tuple[float, float]) -> None:
  """Raises ValueError naming the bad setting of `rollout_correction`."""
  if kind not in ROLLOUT_IS_KINDS:
    raise ValueError(f"Unknown rollout_is {kind!r}; valid kinds are "
                     f"{', '.join(repr(k) for k in ROLLOUT_IS_KINDS)}.")
  if not cap > 0:
    raise ValueError(f"rollout_is_cap={cap} must be > 0 (verl's default 2.0).")
  lo, hi = band
  if not 0 < lo <= 1 <= hi:
    raise ValueError(f"rollout_is_band={tuple(band)} must satisfy 0 < lo <= 1 <= hi "
                     f"(verl's example (0.5, 2.0)): weight 1 (no gap) must be kept.")


def rollout_correction(old_log_prob: ArrayLike, sampler_log_prob: ArrayLike,
                       response_mask: ArrayLike, kind: str = "none", *,
                       cap: float = 2.0, band: tuple[float, float] = (0.5, 2.0)
                       ) -> tuple[Array, Array]:
  """Importance weights from the sampler (the behaviour policy mu) to the old policy pi_old.

  rho_t = pi_old(y_t) / mu(y_t) = exp(old - sampler), the log-ratio clamped to +-20 as verl
  (rollout_corr_helper.SAFETY_BOUND). The kinds (verl's names in docs/algorithm.md section 9):

  - "token_truncated": weight min(rho_t, cap) per token, verl's Token-TIS
    (`rollout_is="token"`, `rollout_is_threshold=cap`, default 2), mask unchanged;
  - "sequence_mask": weight 1, and sequences whose rho = prod_t rho_t lies outside `band` =
    [lo, hi] leave the loss mask (and so every denominator), as verl's sequence rejection
    `rollout_rs="seq_sum_k1"`, `rollout_rs_threshold="lo_hi"`; verl bounds 1 / rho there, the
    same set for a band symmetric in log space such as (0.5, 2);
  - "none": weight 1, mask unchanged.

  Args:
    old_log_prob: [B, R] the trainer's old log-probs (spec 6.2).
    sampler_log_prob: [B, R] the rollout's log-probs of the same tokens.
    response_mask: [B, R] loss mask.
    kind: one of ROLLOUT_IS_KINDS.
    cap: token weight cap C ("token_truncated").
    band: (lo, hi) kept range of the sequence weight ("sequence_mask").

  Returns:
    (weights_BxR without gradient, 0 outside the mask; mask_BxR like `response_mask`).
  """
  validate_rollout_correction(kind, cap, band)
  mask_BxR = jnp.asarray(response_mask)
  on_BxR = mask_BxR > 0
  log_rho_BxR = jnp.where(on_BxR, jnp.asarray(old_log_prob, jnp.float32)
                          - jnp.asarray(sampler_log_prob, jnp.float32), 0.0)
  log_rho_BxR = jax.lax.stop_gradient(log_rho_BxR)
  ones_BxR = on_BxR.astype(jnp.float32)
  if kind == "token_truncated":
    rho_BxR = jnp.exp(jnp.clip(log_rho_BxR, -_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    return jnp.minimum(rho_BxR, cap) * ones_BxR, mask_BxR
  if kind == "sequence_mask":
    log_rho_B = jnp.sum(log_rho_BxR, axis=-1)
    keep_B = (log_rho_B >= np.log(band[0])) & (log_rho_B <= np.log(band[1]))
    return ones_BxR * keep_B[:, None], mask_BxR * keep_B[:, None].astype(mask_BxR.dtype)
  return ones_BxR, mask_BxR


def kl_penalty(log_prob: ArrayLike, ref_log_prob: ArrayLike,
               kind: str = "low_var_kl") -> Array:
  """Per-token KL estimate of the policy from a reference (DAPO: unused), as verl's kl_penalty.

  Args:
    log_prob: [B, R] current policy log-probs.
    ref_log_prob: [B, R] reference policy log-probs.
    kind: 'k1'/'kl' (logp - ref), 'abs' (|logp - ref|), 'k2'/'mse' (0.5 diff^2) or
      'k3'/'low_var_kl' (Schulman's unbiased, non-negative estimator r - log r - 1 with
      r = p_ref / p, clamped to [-10, 10]; verl's default for the GRPO KL loss).

  Returns:
    [B, R] penalty.
  """
  logp = jnp.asarray(log_prob, jnp.float32)
  ref = jnp.asarray(ref_log_prob, jnp.float32)
  if kind in ("k1", "kl"):
    return logp - ref
  if kind == "abs":
    # d * sign(d), not jnp.abs: abs'(0) is +1 in JAX, while the penalty's gradient where the
    # policy equals the reference must be 0 (as verl's, which torch computes with sign(0) = 0).
    d = logp - ref
    return d * jax.lax.stop_gradient(jnp.sign(d))
  if kind in ("k3", "low_var_kl"):
    log_r = jnp.clip(ref - logp, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    # r - log r - 1 >= 0; the clamp keeps rare outlier tokens from dominating.
    return jnp.clip(jnp.exp(log_r) - log_r - 1.0, -10.0, 10.0)
  if kind in ("k2", "mse"):
    return 0.5 * jnp.square(logp - ref)
  raise ValueError(f"Unknown kl_penalty kind {kind!r}; valid kinds are "
                   f"{', '.join(repr(k) for k in KL_PENALTY_KINDS)}.")


def apply_overlong_filter(response_mask: ArrayLike,
                          truncated: ArrayLike) -> Array:
  """Zeros the loss mask of truncated responses (overlong filtering, spec 2).

  Args:
    response_mask: [B, R].
    truncated: [B] bool, True where the response hit max_response_length
      without EOS.

  Returns:
    [B, R] mask, same dtype as `response_mask`.
  """
  mask_BxR = jnp.asarray(response_mask)
  keep_B = jnp.logical_not(jnp.asarray(truncated, jnp.bool_))
  return mask_BxR * keep_B[:, None].astype(mask_BxR.dtype)
