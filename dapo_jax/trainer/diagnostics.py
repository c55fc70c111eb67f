"""Per-step diagnostics the DAPO paper did not report (issue 17, section 4), as ``diag/*`` metrics
(decode time, a wall-clock figure, as ``time/decode_by_length/*`` with the other timings).

* **In-group answer repetition**: distinct final answers per group (the verifier's normalised
  ``Answer:`` line; no answer counts as one more value), mean over the step's generated groups
  and over its trained groups. Read next to ``sampling/kept_ratio``, ``actor/pg_clipfrac`` and
  ``sampling/num_gen_batches``: the hypothesis is that clip-higher keeps groups diverse, so fewer
  are all-correct/all-wrong and dynamic sampling needs fewer generation batches.
* **Gradient-weight share** by response-length bucket x correct/wrong: each row's weight is
  ``|advantage| x`` the total weight the active loss aggregation gives its tokens (token-mean:
  ``L_i / tokens of the mini-batch``; seq-mean-token-mean: ``1 / rows``; ...), read off
  `objective.agg_loss` itself, so it follows whatever mode (and overlong filter) trains.
* **Dynamic-sampling acceptance by pass rate**: the pass-rate histogram of the groups generated
  this step and of the groups trained, and per bucket the share of this step's generated groups
  that were trained (0 in the all-wrong/all-correct buckets under filtering; below 1 inside only
  where surplus groups were dropped).
* **Decode time by response-length bucket** (a proxy, stated): the static engine decodes a batch
  until its longest row stops, and rows cannot be timed one by one. Each generation call's
  measured wall time (decode, detokenise, verify) is split over its decode batches in proportion
  to their decode steps (the batch's longest row), and each decode step's share equally over the
  rows still decoding at that step. A row that finishes early pays only for the steps it was in;
  the steps past everyone else's end are paid by the long rows alone.

Length buckets are quarters of ``rollout.max_response_length`` (``q1``: ``L <= R/4`` ... ``q4``:
``3R/4 < L <= R``); pass-rate buckets are ``p0`` (all wrong), ``p0-25`` ... ``p75-100`` (open at 1)
and ``p100`` (all correct).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dapo_jax.trainer import objective as obj
from dapo_jax.rewards import math_dapo

NUM_LENGTH_BUCKETS = 4
LENGTH_BUCKETS = tuple(f"q{k + 1}" for k in range(NUM_LENGTH_BUCKETS))
PASS_RATE_BUCKETS = ("p0", "p0-25", "p25-50", "p50-75", "p75-100", "p100")
_NO_ANSWER = "\0none"  # cannot be a normalised answer


def final_answer(text: str) -> str:
  """The normalised final answer the strict verifier reads, or a sentinel when there is none."""
  line = math_dapo.extract_answer_line(text)
  return _NO_ANSWER if line is None else math_dapo.normalize_final_answer(line)


def distinct_answers(texts: Sequence[str], group_size: int) -> np.ndarray:
  """[groups] number of distinct final answers in each group of ``group_size`` consecutive rows."""
  if group_size < 1 or len(texts) % group_size:
    raise ValueError(f"{len(texts)} texts do not split into groups of {group_size}.")
  answers = [final_answer(t) for t in texts]
  return np.array([len(set(answers[s:s + group_size]))
                   for s in range(0, len(answers), group_size)], np.int32)


def length_bucket(lengths: np.ndarray, max_response_length: int) -> np.ndarray:
  """Bucket index in [0, 4) per length: ``k`` holds ``k R/4 < L <= (k+1) R/4``."""
  if max_response_length < 1:
    raise ValueError(f"max_response_length must be >= 1, got {max_response_length}.")
  lengths = np.asarray(lengths, np.int64)
  idx = np.ceil(lengths * NUM_LENGTH_BUCKETS / max_response_length).astype(np.int64) - 1
  return np.clip(idx, 0, NUM_LENGTH_BUCKETS - 1)


def pass_rate_bucket(pass_rate: np.ndarray) -> np.ndarray:
  """Bucket index into `PASS_RATE_BUCKETS` per group pass rate in [0, 1]."""
  p = np.asarray(pass_rate, np.float64)
  if np.any((p < 0) | (p > 1)):
    raise ValueError(f"pass rates must lie in [0, 1], got {p}.")
  inner = 1 + np.clip(np.ceil(p * 4).astype(np.int64) - 1, 0, 3)
  return np.where(p == 0, 0, np.where(p == 1, 5, inner))


def row_loss_weights(response_mask: np.ndarray, truncated: np.ndarray, loss_agg_mode: str,
                     rows_per_update: int, overlong_filter: bool = False) -> np.ndarray:
  """[N] the weight the loss gives each row's tokens in total (d loss / d per-token loss, summed
  over the row), mini-batch by mini-batch of ``rows_per_update`` rows as the update sees them."""
  mask = np.asarray(response_mask, np.float32)
  out = np.zeros(mask.shape[0], np.float32)
  for s in range(0, mask.shape[0], rows_per_update):
    m = jnp.asarray(mask[s:s + rows_per_update])
    if overlong_filter:
      m = obj.apply_overlong_filter(m, np.asarray(truncated)[s:s + rows_per_update])
    out[s:s + rows_per_update] = np.asarray(_row_weights(m, loss_agg_mode))
  return out


@jax.jit(static_argnums=1)
def _row_weights(mask_BxR: jax.Array, loss_agg_mode: str) -> jax.Array:
  den = obj.loss_denominator(mask_BxR, loss_agg_mode, mask_BxR.shape[1])
  loss = lambda x: obj.agg_loss(x, mask_BxR, loss_agg_mode, den)  # linear in x
  return jax.grad(loss)(jnp.zeros_like(mask_BxR)).sum(axis=1)


def grad_weight_share(advantages: np.ndarray, row_weights: np.ndarray, acc: np.ndarray,
                      lengths: np.ndarray, max_response_length: int) -> dict[str, float]:
  """Share of ``sum |A_i| w_i`` per length bucket x correct/wrong (the 8 shares sum to 1; all 0
  when every advantage is 0)."""
  w = np.abs(np.asarray(advantages, np.float64)) * np.asarray(row_weights, np.float64)
  total = w.sum()
  bucket = length_bucket(lengths, max_response_length)
  acc = np.asarray(acc, bool)
  out = {}
  for k, name in enumerate(LENGTH_BUCKETS):
    for label, sel in (("correct", acc), ("wrong", ~acc)):
      part = w[(bucket == k) & sel].sum()
      out[f"diag/grad_weight/{name}_{label}"] = float(part / total) if total > 0 else 0.0
  return out


def attributed_decode_seconds(seconds: float, lengths: np.ndarray, rows_per_decode: int
                              ) -> np.ndarray:
  """[rows] one generation call's wall time split over its rows (the proxy in the module doc).

  ``rows_per_decode``: rows decoded together (prompts per rollout call x G); 0 = all of them.
  """
  lengths = np.asarray(lengths, np.int64)
  n = lengths.shape[0]
  if n == 0:
    return np.zeros(0, np.float64)
  rows_per_decode = n if rows_per_decode <= 0 else rows_per_decode
  out = np.zeros(n, np.float64)
  batches = [slice(s, s + rows_per_decode) for s in range(0, n, rows_per_decode)]
  steps = np.array([lengths[b].max(initial=0) for b in batches], np.float64)
  if steps.sum() == 0:
    return out
  per_step = seconds / steps.sum()
  for b in batches:
    ls = lengths[b]
    t = np.arange(1, ls.max(initial=0) + 1)
    alive_T = (ls[None, :] >= t[:, None]).sum(axis=1)  # rows still decoding at step t
    share_T = per_step / alive_T
    cum = np.concatenate([[0.0], np.cumsum(share_T)])
    out[b] = cum[ls]  # row i pays its share of steps 1..L_i
  return out


def decode_time_by_length(calls: Sequence[tuple[float, np.ndarray]], max_response_length: int,
                          rows_per_decode: int) -> dict[str, float]:
  """Seconds per length bucket over the step's generation calls ``(seconds, lengths [rows])``."""
  secs = np.zeros(NUM_LENGTH_BUCKETS)
  for seconds, lengths in calls:
    per_row = attributed_decode_seconds(seconds, lengths, rows_per_decode)
    np.add.at(secs, length_bucket(lengths, max_response_length), per_row)
  return {f"time/decode_by_length/{name}": float(s)
          for name, s in zip(LENGTH_BUCKETS, secs)}


def pass_rate_metrics(generated_pass: np.ndarray, trained_pass: np.ndarray,
                      generated_trained: np.ndarray) -> dict[str, float]:
  """Pass-rate histograms (fractions) of generated and trained groups, and per bucket the share
  of generated groups trained (left out where none was generated: 0/0 is no figure, and a NaN
  would reach TensorBoard and metrics.jsonl as a warning and a null).

  Args:
    generated_pass: [groups generated this step] pass rates.
    trained_pass: [groups trained] pass rates (carried-over groups included).
    generated_trained: [groups generated this step] bool, whether the group was trained.
  """
  gen_b = pass_rate_bucket(generated_pass)
  kept_b = pass_rate_bucket(trained_pass)
  trained = np.asarray(generated_trained, bool)
  if trained.shape != gen_b.shape:
    raise ValueError(f"generated_trained {trained.shape} must match generated_pass "
                     f"{gen_b.shape}.")
  out = {}
  for k, name in enumerate(PASS_RATE_BUCKETS):
    n_gen = int((gen_b == k).sum())
    out[f"diag/pass_rate_generated/{name}"] = n_gen / max(gen_b.size, 1)
    out[f"diag/pass_rate_trained/{name}"] = float((kept_b == k).sum()) / max(kept_b.size, 1)
    if n_gen:
      out[f"diag/accepted/{name}"] = float((trained & (gen_b == k)).sum()) / n_gen
  return out


class GenerationLog:
  """Every group a step's rollout handed back, with each hand-back's wall time.

  `generation.ScoringStream` appends one call per poll (the poll returns host arrays, so its
  time includes the decode, detokenising and verifying), whichever sampling loop drives it.
  """

  def __init__(self):
    self.groups: list[Any] = []
    self.calls: list[tuple[float, np.ndarray]] = []  # (seconds, lengths of the call's rows)

  def record(self, seconds: float, groups: Sequence[Any]) -> None:
    self.groups += list(groups)
    self.calls.append((float(seconds), np.concatenate([np.asarray(g.lengths) for g in groups])
                       if groups else np.zeros(0, np.int64)))


def sampling_metrics(log: GenerationLog, trained_groups: Sequence[Any], *,
                     max_response_length: int, rows_per_decode: int) -> dict[str, float]:
  """Answer repetition, pass-rate histograms/acceptance and decode time of one step's sampling.

  Groups need ``acc`` [G] and ``texts``; generated groups also ``lengths`` [G].
  ``rows_per_decode``: as `attributed_decode_seconds` (0 for a continuous engine's polls).
  """
  trained_ids = {id(g) for g in trained_groups}
  out = {}
  for label, groups in (("generated", log.groups), ("trained", trained_groups)):
    # No groups (a step that trains only carried-over groups, or trains none): no figure, as in
    # `pass_rate_metrics`; a NaN would reach metrics.jsonl as a null.
    if groups:
      out[f"diag/distinct_answers_{label}"] = float(np.mean(
          [distinct_answers(g.texts, len(g.texts))[0] for g in groups]))
  out.update(pass_rate_metrics(
      np.array([np.mean(g.acc) for g in log.groups]),
      np.array([np.mean(g.acc) for g in trained_groups]),
      np.array([id(g) in trained_ids for g in log.groups], bool)))
  out.update(decode_time_by_length(log.calls, max_response_length, rows_per_decode))
  return out
