"""The rollout/trainer log-prob gap: how far the sampler's token log-probs are from the training
forward's on the same weights and tokens (issue 29).

    metrics = logprob_gap_metrics(sampler_logp_BxR, trainer_logp_BxR, response_mask_BxR)

Pure numpy (host arrays, float64 arithmetic), no model code: the trainer calls it every step on
the sampler's log-probs and the recomputed old log-probs, `logprob_measure.measure` and the
probes (`bench/logprob_gap_probes.py`) on any two log-prob arrays.

Notation: mu = the sampler (behaviour policy), pi = the training forward, d_t = log pi(y_t) -
log mu(y_t) on response token t, sampled from mu. The token importance weight is w_t = exp(d_t);
a sequence's weight is prod_t w_t = exp(sum_t d_t) (what verl's rollout correction truncates or
masks, objective.rollout_correction).
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike

# A sequence whose product of token weights leaves this band counts in `seq_outside_band`
# (verl's Seq-MIS example band, docs/algo/rollout_corr.md: rollout_rs_threshold "0.5_2.0").
DEFAULT_BAND = (0.5, 2.0)

KEYS = ("bit_equal", "logprob_diff_mean", "logprob_diff_max", "kl_k3", "is_weight_min",
        "is_weight_mean", "is_weight_max", "seq_outside_band")


def logprob_gap_metrics(sampler_logp: ArrayLike, trainer_logp: ArrayLike, mask: ArrayLike,
                        band: tuple[float, float] = DEFAULT_BAND) -> dict[str, float]:
  """The gap over the response tokens (``mask``), as scalars:

  - ``bit_equal``: share of tokens whose two float32 log-probs have the same bits;
  - ``logprob_diff_mean`` / ``logprob_diff_max``: mean and max |d_t|;
  - ``kl_k3``: k3 estimate of KL(mu || pi) per token, the mean of r - 1 - log r with
    r = pi / mu = exp(d_t) over tokens sampled from mu. Unbiased and >= 0 (Schulman, "Approximating
    KL Divergence", 2020, http://joschu.net/blog/kl-approx.html); computed as expm1(d) - d in
    float64, so gaps of 1e-7 do not cancel to 0;
  - ``is_weight_min`` / ``_mean`` / ``_max``: of the token weights w_t = exp(d_t);
  - ``seq_outside_band``: share of sequences (rows with a response token) whose prod_t w_t lies
    outside ``band`` (compared in log space: no overflow for long responses).

  No response token at all: an empty dict (a value of 0/0 is left out, not logged as NaN).
  """
  s32 = np.asarray(sampler_logp, np.float32)
  t32 = np.asarray(trainer_logp, np.float32)
  on = np.asarray(mask).astype(bool)
  if not (s32.shape == t32.shape == on.shape) or s32.ndim != 2:
    raise ValueError(f"sampler_logp, trainer_logp and mask must all be [B, R]; got {s32.shape}, "
                     f"{t32.shape} and {on.shape}.")
  n_tok = int(on.sum())
  if n_tok == 0:
    return {}
  # Bits, not ==: -0.0 == 0.0 and NaN != NaN would both misreport.
  same = s32.view(np.uint32) == t32.view(np.uint32)
  d = np.where(on, t32.astype(np.float64) - s32.astype(np.float64), 0.0)
  d_tok = d[on]
  w_tok = np.exp(d_tok)
  rows = on.any(axis=-1)
  log_w_seq = d.sum(axis=-1)[rows]
  lo, hi = band
  outside = (log_w_seq < math.log(lo)) | (log_w_seq > math.log(hi))
  return {
      "bit_equal": float(same[on].mean()),
      "logprob_diff_mean": float(np.abs(d_tok).mean()),
      "logprob_diff_max": float(np.abs(d_tok).max()),
      "kl_k3": float(np.mean(np.expm1(d_tok) - d_tok)),
      "is_weight_min": float(w_tok.min()),
      "is_weight_mean": float(w_tok.mean()),
      "is_weight_max": float(w_tok.max()),
      "seq_outside_band": float(outside.mean()),
  }


def bit_equal_gate(metrics: dict[str, float]) -> bool:
  """Green only when every response token's log-prob is bit-equal on both sides."""
  return metrics.get("bit_equal") == 1.0 and metrics.get("logprob_diff_max") == 0.0


def markdown_table(rows: list[tuple[str, dict[str, float]]]) -> str:
  """One line per compared pair: the gate and the figures of `logprob_gap_metrics`."""
  head = ("| probe | gate | bit-equal | mean abs d | max abs d | k3 KL | w min | w max | "
          "seq outside band |")
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  for name, m in rows:
    lines.append(
        f"| {name} | {'green' if bit_equal_gate(m) else 'red'} | {m['bit_equal']:.4f} | "
        f"{m['logprob_diff_mean']:.3g} | {m['logprob_diff_max']:.3g} | {m['kl_k3']:.3g} | "
        f"{m['is_weight_min']:.6f} | {m['is_weight_max']:.6f} | {m['seq_outside_band']:.3f} |")
  return "\n".join(lines)
