"""Pre-rollout skipping of prompts whose groups will be all-right or all-wrong (issue 39).

Anchor: GRESO (arXiv 2506.02177): a prompt's zero-variance groups are temporally consistent, so
a prompt whose recent groups were all-right (or all-wrong) is skipped before its rollout with a
probability, and that probability adapts toward a target share of zero-variance groups.

Here, per prompt (keyed by its content, so the ~100 repeats of a DAPO-Math-17k problem share one
history) the last `HISTORY_PER_PROMPT` outcomes (right out of G, step) are kept. A prompt whose
last ``z`` groups were all of one kind ("right" or "wrong") is retried with probability
``max(floor, explore[kind] ** z)`` and skipped otherwise. After every sampling call
``explore[kind]`` moves by ``adapt_rate`` toward the kind's half of ``target`` (the share of
zero-variance groups among those decoded): down when the kind's share was above it, up when
below; never under ``floor``, never over 1.

Exactness (dynamic sampling's rules, docs/skip_filter.md): every decision is drawn from
``(seed, step, index of the prompt in the step's draws)`` alone and the adaptive state moves only
on gathered rewards, so every process skips the same prompts. On several processes each holds
the history of the prompts it owns (content hash mod process count); a generation batch's
verdicts are gathered before the draw, and a checkpoint gathers the shards into its meta.

Bounded: at most ``max_prompts`` prompts (the least recently updated leave first) with at most
`HISTORY_PER_PROMPT` outcomes each.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Any, Callable, Sequence

import numpy as np

from dapo_jax.infra import distributed

HISTORY_PER_PROMPT = 8
STATE_VERSION = 1
KINDS = ("right", "wrong")


def prompt_key(prompt: Any) -> str:
  """The prompt's content hash: a record's prompt text and answer, else its repr."""
  text = getattr(prompt, "prompt", None)
  content = (f"{text}\x00{getattr(prompt, 'ground_truth', '')}" if isinstance(text, str)
             else repr(prompt))
  return hashlib.sha1(content.encode()).hexdigest()[:16]


def streak(outcomes: Sequence[tuple[int, int]], group_size: int) -> tuple[str | None, int]:
  """(kind, z): the most recent outcomes' common zero-variance kind and how many in a row."""
  kind, z = None, 0
  for right, _ in reversed(outcomes):
    k = "right" if right == group_size else "wrong" if right == 0 else None
    if k is None or (kind is not None and k != kind):
      break
    kind, z = k, z + 1
  return kind, z


@dataclasses.dataclass
class SkipCounts:
  """One sampling call's filter bookkeeping (logged under ``skip/``)."""
  skipped_right: int = 0
  skipped_wrong: int = 0
  retried: int = 0  # prompts with a zero-variance streak that were rolled out anyway
  retried_informative: int = 0  # ... whose group then varied (would have been a lost group)
  prompts_seen: int = 0  # prompts drawn, skipped or not


class SkipFilter:
  """The dynamic sampler's ``prefilter`` (``DynamicSampler(prefilter=...)``).

  ``begin(step)`` before a step's sampling; the sampler calls ``admit`` on each drawn
  generation batch, ``record`` on each scored group and ``end_call`` when the call ends.
  ``gather`` (default `distributed.allgather_json`) concatenates every process's list; tests
  pass their own to simulate several processes.
  """

  def __init__(self, *, seed: int, group_size: int, target: float = 0.25, floor: float = 0.05,
               adapt_rate: float = 0.05, max_prompts: int = 200_000, process_index: int = 0,
               process_count: int = 1,
               gather: Callable[[list[Any]], list[Any]] | None = None):
    if not 0 <= target <= 1:
      raise ValueError(f"skip target must lie in [0, 1], got {target}.")
    if not 0 < floor <= 1:
      raise ValueError(f"skip floor must lie in (0, 1], got {floor}.")
    self.seed, self.group_size = int(seed), int(group_size)
    self.target, self.floor, self.adapt_rate = float(target), float(floor), float(adapt_rate)
    self.max_prompts = int(max_prompts)
    self.process_index, self.process_count = int(process_index), int(process_count)
    self._gather = gather or distributed.allgather_json
    self.explore = {k: 1.0 for k in KINDS}  # P(retry) base per kind; 1 = never skip
    self._history: collections.OrderedDict[str, list[tuple[int, int]]] = (
        collections.OrderedDict())
    self._step = 0
    self._drawn = 0  # prompts drawn in this step so far: the draw index
    self._retried: set[str] = set()
    self.counts = SkipCounts()

  # --- the sampler's calls ---------------------------------------------------------------------

  def begin(self, step: int) -> None:
    """A new step's sampling: decisions draw from (seed, step, index)."""
    self._step, self._drawn = int(step), 0
    self._retried = set()
    self.counts = SkipCounts()

  def admit(self, prompts: Sequence[Any]) -> list[Any]:
    """The prompts of a drawn generation batch to roll out (in order); counts the skipped."""
    keys = [prompt_key(p) for p in prompts]
    verdicts = self._verdicts(keys)
    kept = []
    for p, key, (kind, z) in zip(prompts, keys, verdicts):
      index, self._drawn = self._drawn, self._drawn + 1
      self.counts.prompts_seen += 1
      if kind is not None:
        if self._draw(index) >= self.retry_probability(kind, z):
          setattr(self.counts, f"skipped_{kind}", getattr(self.counts, f"skipped_{kind}") + 1)
          continue
        self.counts.retried += 1
        self._retried.add(key)
      kept.append(p)
    return kept

  def record(self, prompt: Any, acc: np.ndarray) -> None:
    """A scored group's outcome (whatever policy version sampled it)."""
    key = prompt_key(prompt)
    right = int(np.asarray(acc).sum())
    if key in self._retried and 0 < right < np.asarray(acc).size:
      self.counts.retried_informative += 1
    self._retried.discard(key)
    if not self._owns(key):
      return
    outcomes = self._history.pop(key, [])
    outcomes.append((right, self._step))
    self._history[key] = outcomes[-HISTORY_PER_PROMPT:]
    while len(self._history) > self.max_prompts:
      self._history.popitem(last=False)  # the least recently updated prompt

  def end_call(self, num_generated: int, num_all_right: int, num_all_wrong: int) -> None:
    """Moves each kind's retry base toward its half of the target (gathered counts only)."""
    if not num_generated:
      return
    for kind, n in (("right", num_all_right), ("wrong", num_all_wrong)):
      delta = -self.adapt_rate if n / num_generated > self.target / 2 else self.adapt_rate
      self.explore[kind] = float(min(1.0, max(self.floor, self.explore[kind] + delta)))

  # --- decisions -------------------------------------------------------------------------------

  def retry_probability(self, kind: str, z: int) -> float:
    """P(roll out) of a prompt whose last ``z`` groups were all ``kind``."""
    return max(self.floor, self.explore[kind] ** z) if z else 1.0

  def _draw(self, index: int) -> float:
    """A uniform draw that depends on (seed, step, index) only: the same on every process."""
    return float(np.random.default_rng([self.seed, self._step, index, 39]).random())

  def _owns(self, key: str) -> bool:
    return int(key, 16) % self.process_count == self.process_index

  def _verdicts(self, keys: Sequence[str]) -> list[tuple[str | None, int]]:
    own = [[i, *streak(self._history[k], self.group_size)] for i, k in enumerate(keys)
           if self._owns(k) and k in self._history]
    if self.process_count > 1:
      own = self._gather(own)
    out: list[tuple[str | None, int]] = [(None, 0)] * len(keys)
    for i, kind, z in own:
      out[i] = (kind, z)
    return out

  # --- metrics and checkpoint ------------------------------------------------------------------

  def metrics(self, num_generated: int, num_zero_variance: int,
              decoded_per_kept_vs_ideal: float = 0.0) -> dict[str, float]:
    """This call's ``skip/`` scalars (``decoded_per_kept_vs_ideal``: the sampling stats' ratio of
    decoded tokens per kept group to its ideal, logged with them). ``zero_var_share_before``
    counts every skipped prompt as the zero-variance group it was predicted to be (an upper
    estimate: ``retried_informative_ratio`` says how often such a prediction was wrong)."""
    c = self.counts
    skipped = c.skipped_right + c.skipped_wrong
    return {
        "skip/decoded_per_kept_vs_ideal": float(decoded_per_kept_vs_ideal),
        "skip/prompts_drawn": float(c.prompts_seen),
        "skip/skipped_right": float(c.skipped_right),
        "skip/skipped_wrong": float(c.skipped_wrong),
        "skip/skipped_share": skipped / c.prompts_seen if c.prompts_seen else 0.0,
        "skip/retried": float(c.retried),
        "skip/retried_informative": float(c.retried_informative),
        "skip/retried_informative_ratio": (c.retried_informative / c.retried if c.retried
                                           else 0.0),
        "skip/zero_var_share_after": (num_zero_variance / num_generated if num_generated
                                      else 0.0),
        "skip/zero_var_share_before": ((num_zero_variance + skipped) / (num_generated + skipped)
                                       if num_generated + skipped else 0.0),
        "skip/explore_right": self.explore["right"],
        "skip/explore_wrong": self.explore["wrong"],
        "skip/history_prompts": float(len(self._history)),
    }

  def state_dict(self) -> dict[str, Any]:
    """JSON: the retry bases and every process's history shard (gathered: one meta file)."""
    rows = [[k, v] for k, v in self._history.items()]
    if self.process_count > 1:
      rows = self._gather(rows)
    return {"version": STATE_VERSION, "explore": dict(self.explore),
            "history": [[k, [list(o) for o in v]] for k, v in rows]}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Restores `state_dict()`; this process keeps the prompts it owns."""
    if state.get("version") != STATE_VERSION:
      raise ValueError(f"SkipFilter state version {state.get('version')!r} is not supported "
                       f"(expected {STATE_VERSION}).")
    self.explore = {k: float(state["explore"][k]) for k in KINDS}
    self._history = collections.OrderedDict(
        (k, [(int(r), int(s)) for r, s in v]) for k, v in state["history"] if self._owns(k))
