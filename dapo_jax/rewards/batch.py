"""Batch rewards for one generation batch: verify every response, then overlong shaping.

This is what the trainer calls once per generation batch (docs/algorithm.md sections 2 and 5):

  with RewardScorer(verifier="strict", max_response_length=20480) as scorer:
    out = scorer(responses, ground_truths, response_lengths)
  out.reward   # score + overlong penalty, float32 [B]
  out.acc      # what dynamic sampling filters on (spec 2: never the shaped reward)

A failing item (exception or timeout) is scored wrong and counted; it never fails the batch.
"""
import dataclasses
import pickle
from collections.abc import Callable, Sequence

import numpy as np

from dapo_jax.infra import distributed
from dapo_jax.rewards import math_dapo, symbolic
from dapo_jax.rewards.deadline_pool import DeadlinePool

VERIFIERS = ("strict", "symbolic")
ScoreFn = Callable[[str, str], math_dapo.ScoreDict]


@dataclasses.dataclass(frozen=True)
class RewardBatch:
  """Per-response rewards, all arrays of shape [B] in input order."""
  score: np.ndarray  # float32, +1 / -1 (spec 2)
  acc: np.ndarray  # bool; dynamic sampling keys on this (spec 5)
  pred: list[str]  # normalised answer, "[INVALID]", "[ERROR]" or "[TIMEOUT]"
  overlong_penalty: np.ndarray  # float32, <= 0
  reward: np.ndarray  # float32, score + overlong_penalty
  num_errors: int
  num_timeouts: int


def overlong_penalty(lengths, max_response_length: int, buffer_len: int,
                     factor: float) -> np.ndarray:
  """Soft overlong punishment (spec 2), for EVERY response, correct or not.

  penalty = min(-(L - (max_response_length - buffer_len)) / buffer_len * factor, 0), where L
  counts the EOS token when present. Zero up to the expected length, -factor at the maximum.
  Lengths above max_response_length are not clipped (the sampler never produces them).
  """
  _check_shaping(max_response_length, buffer_len, factor)
  lengths_B = np.asarray(lengths)
  if lengths_B.ndim != 1:
    raise ValueError(f"lengths must be 1-D, got shape {lengths_B.shape}.")
  if lengths_B.size and lengths_B.min() < 0:
    raise ValueError(f"lengths must be >= 0, got min {lengths_B.min()}.")
  expected = max_response_length - buffer_len
  penalty_B = -(lengths_B.astype(np.float64) - expected) / buffer_len * factor
  return np.minimum(penalty_B, 0.0).astype(np.float32)


def _check_shaping(max_response_length: int, buffer_len: int, factor: float) -> None:
  if max_response_length < 1:
    raise ValueError(f"max_response_length must be >= 1, got {max_response_length}.")
  if not 0 < buffer_len <= max_response_length:
    raise ValueError(
        f"overlong_buffer_len must be in [1, max_response_length={max_response_length}], got "
        f"{buffer_len}; the DAPO setting is 4096 of 20480 (spec 8). To turn shaping off set "
        f"overlong_buffer_enable=False instead.")
  if factor < 0:
    raise ValueError(f"overlong_penalty_factor must be >= 0, got {factor}.")


def _score_strict_inline(responses, ground_truths):
  """Strict verifier in this thread: ~20 us per item; threads (GIL) or processes measured slower."""
  scores, errors = [], []
  for response, gt in zip(responses, ground_truths):
    try:
      scores.append(math_dapo.compute_score(response, gt))
      errors.append(False)
    except Exception:  # pylint: disable=broad-except
      scores.append({"score": -1.0, "acc": False, "pred": symbolic.ERROR_PRED})
      errors.append(True)
  return scores, errors, [False] * len(scores)


class RewardScorer:
  """Reusable batch scorer; owns the worker pool, so create it once and `close()` it.

  Args:
    verifier: "strict" (spec 2 default, inline), "symbolic" (math-verify in killable
      worker processes), or a picklable module-level `fn(response, ground_truth) -> dict`
      with the `compute_score` keys, run in the worker pool under the same deadline.
    max_response_length: the sampler's cap (spec 8: 20480).
    overlong_buffer_len, overlong_penalty_factor, overlong_buffer_enable: spec 2 shaping.
    timeout_s: per-item bound for worker-run verifiers (strict is bounded by construction).
    num_workers: worker processes (default: usable CPUs, at most 16); ignored by strict.
    memory_limit_mb: address-space cap per worker (RLIMIT_AS); None or 0: no cap.
  """

  def __init__(self, verifier: str | ScoreFn = "strict", *, max_response_length: int,
               overlong_buffer_len: int = 4096, overlong_penalty_factor: float = 1.0,
               overlong_buffer_enable: bool = True, timeout_s: float = 5.0,
               num_workers: int | None = None,
               memory_limit_mb: int | None = symbolic.DEFAULT_MEMORY_LIMIT_MB):
    if isinstance(verifier, str) and verifier not in VERIFIERS:
      raise ValueError(f"Unknown verifier {verifier!r}; expected one of {VERIFIERS} or a "
                       "picklable function (response, ground_truth) -> score dict.")
    if not isinstance(verifier, str):
      if not callable(verifier):
        raise TypeError(
            f"verifier must be a name or a function, got {type(verifier).__name__}.")
      try:  # it is sent to worker processes, so fail here rather than on every item
        pickle.dumps(verifier)
      except Exception as e:  # pylint: disable=broad-except
        raise TypeError(f"verifier {verifier!r} cannot be pickled for the worker processes "
                        "(use a module-level function, not a lambda or closure).") from e
    if overlong_buffer_enable:
      _check_shaping(max_response_length, overlong_buffer_len, overlong_penalty_factor)
    elif max_response_length < 1:
      raise ValueError(f"max_response_length must be >= 1, got {max_response_length}.")
    if timeout_s <= 0:
      raise ValueError(f"timeout_s must be > 0, got {timeout_s}.")
    if num_workers is not None and num_workers < 1:
      raise ValueError(f"num_workers must be >= 1 or None, got {num_workers}.")
    self.verifier = verifier
    self.max_response_length = max_response_length
    self.overlong_buffer_len = overlong_buffer_len
    self.overlong_penalty_factor = overlong_penalty_factor
    self.overlong_buffer_enable = overlong_buffer_enable
    self.timeout_s = timeout_s
    self._symbolic: symbolic.SymbolicVerifier | None = None
    self._pool: DeadlinePool | None = None
    workers = num_workers or symbolic.default_num_workers()
    if verifier == "symbolic":
      self._symbolic = symbolic.SymbolicVerifier(
          workers, timeout_s, memory_limit_mb=memory_limit_mb)
    elif callable(verifier):
      self._pool = DeadlinePool(workers, memory_limit_mb=memory_limit_mb)

  def close(self) -> None:
    if self._symbolic is not None:
      self._symbolic.close()
    if self._pool is not None:
      self._pool.close()

  def __enter__(self) -> "RewardScorer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __call__(self, responses: Sequence[str], ground_truths: Sequence[str],
               response_lengths, timeout_s: float | None = None) -> RewardBatch:
    """Scores one generation batch. `response_lengths` counts EOS when present (spec 2)."""
    lengths_B = np.asarray(response_lengths)
    if lengths_B.ndim != 1:
      raise ValueError(f"response_lengths must be 1-D, got shape {lengths_B.shape}.")
    if not len(responses) == len(ground_truths) == lengths_B.shape[0]:
      raise ValueError(
          f"Batch sizes differ: {len(responses)} responses, {len(ground_truths)} ground "
          f"truths, {lengths_B.shape[0]} lengths.")
    timeout_s = self.timeout_s if timeout_s is None else timeout_s
    if timeout_s <= 0:
      raise ValueError(f"timeout_s must be > 0, got {timeout_s}.")
    if self._symbolic is not None:
      pairs = self._symbolic.score_many(responses, ground_truths, timeout_s)
      scores = [s for s, _ in pairs]
      errors = [o.status == "error" for _, o in pairs]
      timeouts = [o.status == "timeout" for _, o in pairs]
    elif self._pool is not None:
      scores, errors, timeouts = self._score_custom(responses, ground_truths, timeout_s)
    else:
      scores, errors, timeouts = _score_strict_inline(responses, ground_truths)

    score_B = np.array([s["score"] for s in scores], dtype=np.float32)
    acc_B = np.array([bool(s["acc"]) for s in scores], dtype=bool)
    if self.overlong_buffer_enable:
      penalty_B = overlong_penalty(lengths_B, self.max_response_length,
                                   self.overlong_buffer_len, self.overlong_penalty_factor)
    else:
      penalty_B = np.zeros(len(scores), dtype=np.float32)
    return RewardBatch(
        score=score_B, acc=acc_B, pred=[str(s["pred"]) for s in scores],
        overlong_penalty=penalty_B, reward=score_B + penalty_B,
        num_errors=int(sum(errors)), num_timeouts=int(sum(timeouts)))

  def _score_custom(self, responses, ground_truths, timeout_s):
    outcomes = self._pool.map(self.verifier, list(zip(responses, ground_truths)), timeout_s)
    scores, errors, timeouts = [], [], []
    for outcome in outcomes:
      ok = outcome.status == "ok"
      if ok:
        try:  # a malformed return value is that item's error, not the batch's
          value = outcome.value
          scores.append({"score": float(value["score"]), "acc": bool(value["acc"]),
                         "pred": str(value["pred"])})
        except Exception:  # pylint: disable=broad-except
          ok = False
      if not ok:
        timed_out = outcome.status == "timeout"
        marker = symbolic.TIMEOUT_PRED if timed_out else symbolic.ERROR_PRED
        scores.append({"score": -1.0, "acc": False, "pred": marker})
      errors.append(not ok and outcome.status != "timeout")
      timeouts.append(outcome.status == "timeout")
    return scores, errors, timeouts


def compute_batch_rewards(responses: Sequence[str], ground_truths: Sequence[str],
                          response_lengths, *, verifier: str | ScoreFn = "strict",
                          max_response_length: int, overlong_buffer_len: int = 4096,
                          overlong_penalty_factor: float = 1.0,
                          overlong_buffer_enable: bool = True, timeout_s: float = 5.0,
                          num_workers: int | None = None) -> RewardBatch:
  """One-shot `RewardScorer(...)(...)`; starts and stops a pool per call for non-strict."""
  with RewardScorer(verifier, max_response_length=max_response_length,
                    overlong_buffer_len=overlong_buffer_len,
                    overlong_penalty_factor=overlong_penalty_factor,
                    overlong_buffer_enable=overlong_buffer_enable, timeout_s=timeout_s,
                    num_workers=num_workers) as scorer:
    return scorer(responses, ground_truths, response_lengths)


def gather_rewards(mine: RewardBatch) -> RewardBatch:
  """Every process's ``RewardBatch`` of its ``share`` of the responses, as one batch in process
  order (verification is split between the processes, the filter reads all rewards)."""
  if not distributed.is_multiprocess():
    return mine
  gather = distributed.allgather_rows
  counts = gather(np.asarray([[mine.num_errors, mine.num_timeouts]], np.int64)).sum(0)
  return dataclasses.replace(
      mine, score=gather(mine.score), acc=gather(mine.acc),
      pred=distributed.allgather_json(list(mine.pred)),
      overlong_penalty=gather(mine.overlong_penalty), reward=gather(mine.reward),
      num_errors=int(counts[0]), num_timeouts=int(counts[1]))
