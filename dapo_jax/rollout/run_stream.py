"""TEMPORARY `RolloutStream` over `ContinuousSampler.run` (to be replaced by the continuous
engine's own ``open_stream`` with in-loop admission; ``rollout.factory`` prefers that one).

A poll runs every waiting prompt to completion in one ``run`` call, so nothing streams inside a
call; it only gives the streaming loop the engine's key rule (sample g of prompt i draws from
``fold_in(fold_in(key, i), g)``) until the real stream lands.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from dapo_jax.rollout.continuous import ContinuousSampler, Request
from dapo_jax.rollout.sampling import SamplingParams
from dapo_jax.rollout.stream import FinishedGroup

_FIELDS = ("response_ids", "response_mask", "logprobs", "lengths", "truncated")


class RunStream:
  """Admitted prompts wait; a poll generates all of them with one `ContinuousSampler.run`."""

  def __init__(self, sampler: ContinuousSampler, state: Any, *, params: SamplingParams,
               num_samples: int, key: jax.Array):
    self._sampler, self._state, self._params = sampler, state, params
    self._g, self._key = num_samples, key
    self._waiting: dict[int, list[int]] = {}
    self._seen: set[int] = set()
    self._stats = dict(calls=0, decode_steps=0, slot_steps=0, decoded_tokens=0,
                       finished_groups=0)

  def admit(self, prompt_ids: Sequence[int], prompt_index: int) -> None:
    i = int(prompt_index)
    if i < 0 or i in self._seen:
      raise ValueError(f"prompt_index {i} was already admitted (or is negative).")
    self._seen.add(i)
    self._waiting[i] = [int(t) for t in prompt_ids]

  @property
  def num_pending(self) -> int:
    return len(self._waiting)

  def poll(self) -> list[FinishedGroup]:
    if not self._waiting:
      return []
    order = sorted(self._waiting)
    requests = [Request(self._waiting[i], prompt_index=i, sample_index=g)
                for i in order for g in range(self._g)]
    out = jax.device_get(self._sampler.run(self._state, requests, self._key, self._params))
    arrays = {k: np.asarray(getattr(out, k)) for k in _FIELDS}
    st = self._sampler.last_stats
    self._stats["calls"] += 1
    self._stats["decode_steps"] += st.decode_steps
    # Each response's first token comes from its prefill, the rest from decode steps.
    self._stats["slot_steps"] += st.decode_steps * st.num_slots + len(requests)
    self._stats["decoded_tokens"] += int(arrays["lengths"].sum())
    self._stats["finished_groups"] += len(order)
    g = self._g
    return [FinishedGroup(prompt_index=i, prompt_ids=np.asarray(self._waiting.pop(i)),
                          **{k: v[n * g:(n + 1) * g] for k, v in arrays.items()})
            for n, i in enumerate(order)]

  def stats(self) -> dict[str, float]:
    s = {k: float(v) for k, v in self._stats.items()}
    s["slot_utilization"] = s["decoded_tokens"] / max(s["slot_steps"], 1.0)
    return s

  def close(self) -> None:
    self._waiting.clear()
