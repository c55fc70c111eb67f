"""`RolloutStream` over the static sampler: admitted prompts are decoded in fixed-shape calls.

Prompt i of the stream sits at row ``i % C`` of call ``i // C`` (C = ``prompts_per_call``); a poll
decodes the lowest call that holds waiting prompts, with the rows not waiting filled by a copy of
one that is (the call keeps its compiled shape and its rows do not interact, so a row's tokens do
not depend on what shares the call). Call c draws with ``call_key(c)``: a prompt's samples depend
on its index only, never on when it was admitted or what was admitted with it.

The default ``call_key`` is the batch-level loop's layout (``generation.rollout_chunks`` per
generation batch): with ``calls_per_batch = gen_batch_size / C``, generation batch
``k = c // calls_per_batch`` draws with ``fold_in(key, k + 1)`` and its chunk
``j = c % calls_per_batch`` with ``fold_in(that, j)`` (the batch key itself when one call holds the
whole batch). So a stream fed prompt ``k * gen_batch_size + j`` for record j of batch k decodes
exactly what the batch loop decodes for it.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np

from dapo_jax.data.pipeline import left_pad
from dapo_jax.rollout.sampling import SamplingParams
from dapo_jax.rollout.stream import FinishedGroup

_FIELDS = ("response_ids", "response_mask", "logprobs", "lengths", "truncated")


def batch_call_key(key: jax.Array, call: int, calls_per_batch: int) -> jax.Array:
  """The key of call ``call`` in the batch-level loop's layout (see the module docstring)."""
  batch_key = jax.random.fold_in(key, call // calls_per_batch + 1)
  if calls_per_batch == 1:
    return batch_key
  return jax.random.fold_in(batch_key, call % calls_per_batch)


class StaticStream:
  """`RolloutStream` over a static rollout callable ``(state, ids, mask, key, params, n)``.

  Args:
    rollout: e.g. ``Sampler.generate`` (on several processes ``distributed.global_rollout`` of
      it: every process polls the same calls).
    state: the rollout weights.
    params: sampling settings (``max_new_tokens`` = R of the groups).
    num_samples: G.
    key: the stream's key.
    prompts_per_call: C, prompts per compiled call.
    prompt_length: P, the fixed prompt width (prompts are left-padded with ``params.pad_id``).
    calls_per_batch: calls per generation batch of the default ``call_key`` layout.
    call_key: overrides the key of call c (default `batch_call_key`).
  """

  def __init__(self, rollout: Callable[..., Any], state: Any, *, params: SamplingParams,
               num_samples: int, key: jax.Array, prompts_per_call: int, prompt_length: int,
               calls_per_batch: int = 1,
               call_key: Callable[[int], jax.Array] | None = None):
    if prompts_per_call < 1 or calls_per_batch < 1 or num_samples < 1:
      raise ValueError(f"prompts_per_call ({prompts_per_call}), calls_per_batch "
                       f"({calls_per_batch}) and num_samples ({num_samples}) must be >= 1.")
    self._rollout, self._state = rollout, state
    self._params, self._g = params, num_samples
    self._c, self._p = prompts_per_call, prompt_length
    self._call_key = call_key or (lambda c: batch_call_key(key, c, calls_per_batch))
    self._waiting: dict[int, list[int]] = {}  # prompt index -> real prompt ids
    self._seen: set[int] = set()
    self._stats = dict(calls=0, decode_steps=0, slot_steps=0, decoded_tokens=0,
                       finished_groups=0)

  def admit(self, prompt_ids: Sequence[int], prompt_index: int) -> None:
    i = int(prompt_index)
    if i < 0 or i in self._seen:
      raise ValueError(f"prompt_index {i} was already admitted (or is negative); ids must be "
                       "unique, >= 0.")
    ids = [int(t) for t in prompt_ids]
    if not 0 < len(ids) <= self._p:
      raise ValueError(f"A prompt needs 1..{self._p} tokens (prompt_length); got {len(ids)}.")
    self._seen.add(i)
    self._waiting[i] = ids

  @property
  def num_pending(self) -> int:
    return len(self._waiting)

  @property
  def admission_block(self) -> int:
    """A call decodes C rows whoever fills them: admit prompts C at a time."""
    return self._c

  def poll(self) -> list[FinishedGroup]:
    """Decodes the lowest call that holds waiting prompts; returns their groups, index order."""
    if not self._waiting:
      return []
    call = min(self._waiting) // self._c
    first = call * self._c
    mine = sorted(i for i in self._waiting if i // self._c == call)
    filler = self._waiting[mine[0]]
    rows = [self._waiting.get(first + r, filler) for r in range(self._c)]
    ids, mask = left_pad(rows, self._params.pad_id, length=self._p)
    out = jax.device_get(self._rollout(self._state, ids, mask, self._call_key(call),
                                       self._params, self._g))
    arrays = {k: np.asarray(getattr(out, k)) for k in _FIELDS}
    steps = int(np.asarray(out.num_steps)) if hasattr(out, "num_steps") else int(
        arrays["lengths"].max(initial=0))
    g, groups = self._g, []
    for i in mine:
      sl = slice((i - first) * g, (i - first + 1) * g)
      groups.append(FinishedGroup(prompt_index=i, prompt_ids=np.asarray(self._waiting.pop(i)),
                                  **{k: v[sl] for k, v in arrays.items()}))
      self._stats["decoded_tokens"] += int(arrays["lengths"][sl].sum())
    self._stats["calls"] += 1
    self._stats["decode_steps"] += steps
    self._stats["slot_steps"] += steps * self._c * g
    self._stats["finished_groups"] += len(groups)
    return groups

  def stats(self) -> dict[str, float]:
    """Counters since the stream opened. ``slot_steps``: rows x decode columns of every call
    (what the device ran); ``decoded_tokens``: response tokens of the admitted prompts."""
    s = {k: float(v) for k, v in self._stats.items()}
    s["slot_utilization"] = s["decoded_tokens"] / max(s["slot_steps"], 1.0)
    return s

  def close(self) -> None:
    self._waiting.clear()
