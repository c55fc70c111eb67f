"""A rollout that hands back each prompt's group of G responses as soon as all G have finished.

This is the interface streaming dynamic sampling reads (admit prompts, poll for finished groups),
so the sampling loop does not care which engine decodes:

    stream = engine.open_stream(state, params=sampling_params, num_samples=G)
    stream.admit(prompt_ids, prompt_index=i)   # as many as the loop wants in flight
    while stream.num_pending:
      for group in stream.poll():              # >= 1 group per call while any is pending
        ...                                    # score it, keep or drop it
    stream.close()

Implemented by `rollout.continuous.ContinuousSampler.open_stream` (prompts are prefilled once
into a device queue and their samples pulled into free decode slots inside the compiled loop; the
host reads results once per chunk of decode steps). Its `admit` also takes optional per-sample
budgets, `max_new_tokens=[G ints]`. Also by `rollout.static_stream.StaticStream` over the static
sampler (whole calls of ``prompts_per_call`` prompts).

Randomness: on the continuous engine sample g of prompt i draws from
``fold_in(fold_in(key, i), g)`` (``key`` given when the stream is opened), whatever slot or call it
lands in, so results do not depend on the schedule or on how many prompts are in flight. The
static stream keeps the batch-level loop's call layout instead: prompt i decodes in the row of the
call the batch loop would give it, with that call's key, so both loops sample the same tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class FinishedGroup:
  """The G responses of one admitted prompt, rows in sample order.

  Attributes:
    prompt_index: the id the prompt was admitted with.
    prompt_ids: [P] the prompt's real tokens (no padding).
    response_ids: [G, R] int32; pad after the first stop token (R = the stream's max_new_tokens).
    response_mask: [G, R] bool; includes the stop token.
    logprobs: [G, R] fp32 log-probs under softmax(logits / T) of the behaviour policy; 0 where
      masked.
    lengths: [G] int32 response lengths (counting the stop token).
    truncated: [G] bool, no stop token within the budget.
    versions: [G, R] int32, the policy version that sampled each token (-1 where masked), when
      the stream's weights were swapped while it ran (`set_weights`); else None.
  """
  prompt_index: int
  prompt_ids: np.ndarray
  response_ids: np.ndarray
  response_mask: np.ndarray
  logprobs: np.ndarray
  lengths: np.ndarray
  truncated: np.ndarray
  versions: np.ndarray | None = None


class RolloutStream(Protocol):
  """Admit prompts; poll returns the groups that finished since the last poll."""

  def admit(self, prompt_ids: Sequence[int], prompt_index: int) -> None:
    """Queues one prompt (its G samples); ids must be unique within the stream."""

  @property
  def num_pending(self) -> int:
    """Admitted groups not yet returned by `poll`."""

  def poll(self) -> list[FinishedGroup]:
    """Decodes until at least one group finishes (or none is pending); returns finished groups."""

  def stats(self) -> dict[str, float]:
    """Counters since the stream opened: decode steps, slot utilisation, decoded tokens, ..."""

  def close(self) -> None:
    """Frees device buffers; groups still in flight are dropped."""
