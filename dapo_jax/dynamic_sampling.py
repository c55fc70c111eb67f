"""Dynamic sampling (spec section 5): keep generating until enough groups vary.

Host-side Python/NumPy. The loop wraps ANY rollout callable
`generate_fn(prompts) -> list[Group]` (static sampler, continuous-batching
engine, a test fake), which does rollout and scoring.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Sequence

import numpy as np

STATE_VERSION = 1


@dataclasses.dataclass
class Group:
  """One prompt's G scored responses.

  A trainer subclasses it with what it needs later (tokens, lengths, log-probs) and overrides
  `to_json`/`from_json` so the carried surplus checkpoints as JSON.

  Attributes:
    prompt: the prompt as the data pipeline gave it (e.g. a dataset row).
    acc: [G] bool correctness; filtering uses this, never the shaped reward.
    reward: [G] float32 shaped reward (score + overlong penalty, spec 2).
  """
  prompt: Any
  acc: np.ndarray
  reward: np.ndarray

  def __post_init__(self):
    self.acc = np.asarray(self.acc, dtype=np.bool_).reshape(-1)
    self.reward = np.asarray(self.reward, dtype=np.float32).reshape(-1)
    if self.acc.size == 0 or self.acc.shape != self.reward.shape:
      raise ValueError(f"Group needs acc and reward of the same non-zero "
                       f"length G; got {self.acc.shape} and "
                       f"{self.reward.shape}.")

  @property
  def size(self) -> int:
    return int(self.acc.size)

  @property
  def all_correct(self) -> bool:
    return bool(self.acc.all())

  @property
  def all_wrong(self) -> bool:
    return not self.acc.any()

  @property
  def is_valid(self) -> bool:
    """std(acc) > 0, or a single response (spec 5)."""
    return is_valid_acc(self.acc)

  def to_json(self) -> dict[str, Any]:
    """JSON values (the prompt as given: JSON-able prompts only)."""
    return {"prompt": self.prompt, "acc": self.acc.tolist(),
            "reward": self.reward.tolist()}

  @classmethod
  def from_json(cls, d: dict[str, Any]) -> Group:
    """The inverse of `to_json`."""
    return cls(prompt=d["prompt"], acc=d["acc"], reward=d["reward"])


def is_valid_acc(acc: np.ndarray) -> bool:
  """True iff a group with this correctness vector trains (spec 5)."""
  acc = np.asarray(acc, dtype=np.bool_)
  return acc.size == 1 or bool(acc.any() and not acc.all())


def acceptance_probability(p: float | np.ndarray, group_size: int) -> Any:
  """P(a group of `group_size` is kept) at per-sample correctness `p`.

  `1 - p^G - (1-p)^G` (spec 5); 1 for G = 1, as singleton groups are kept.
  """
  if group_size < 1:
    raise ValueError(f"group_size must be >= 1, got {group_size}.")
  p = np.asarray(p, dtype=np.float64)
  if np.any((p < 0) | (p > 1)):
    raise ValueError(f"p must lie in [0, 1], got {p}.")
  if group_size == 1:
    return np.ones_like(p)[()]
  return (1.0 - p**group_size - (1.0 - p)**group_size)[()]


@dataclasses.dataclass
class SamplingStats:
  """Bookkeeping of one `DynamicSampler.sample` call (spec 5 logging)."""
  num_gen_batches: int = 0
  num_groups_generated: int = 0
  # Groups with std(acc) > 0 among those generated this call (counted even
  # with enable=False: it is the share that carries a learning signal).
  num_groups_kept: int = 0
  # All-correct / all-wrong groups of size > 1 (the ones filtering drops).
  num_all_correct: int = 0
  num_all_wrong: int = 0
  rollouts_generated: int = 0
  rollouts_trained: int = 0
  carried_in_groups: int = 0  # surplus of the previous call used as input.
  surplus_groups: int = 0  # kept beyond train_batch_size.
  surplus_carried: bool = False  # True: surplus kept for the next call.

  def _ratio(self, n: int) -> float:
    return n / self.num_groups_generated if self.num_groups_generated else 0.0

  @property
  def kept_ratio(self) -> float:
    return self._ratio(self.num_groups_kept)

  @property
  def all_correct_ratio(self) -> float:
    return self._ratio(self.num_all_correct)

  @property
  def all_wrong_ratio(self) -> float:
    return self._ratio(self.num_all_wrong)

  def to_dict(self) -> dict[str, float]:
    """Flat metrics for the logger."""
    d = {k: float(v) for k, v in dataclasses.asdict(self).items()}
    d.update(kept_ratio=self.kept_ratio,
             all_correct_ratio=self.all_correct_ratio,
             all_wrong_ratio=self.all_wrong_ratio)
    return d


class DynamicSamplingError(RuntimeError):
  """Sampling stopped early; `groups` and `stats` hold what was gathered."""

  def __init__(self, message: str, groups: list[Group],
               stats: SamplingStats):
    super().__init__(message)
    self.groups = groups
    self.stats = stats


class MaxGenBatchesExceededError(DynamicSamplingError):
  """`max_num_gen_batches` generation batches did not fill the batch."""


class DatasetExhaustedError(DynamicSamplingError):
  """The prompt iterator ended before the batch was full."""


GenerateFn = Callable[[list], Sequence[Group]]


class DynamicSampler:
  """Spec section 5 around any rollout callable.

  Usage:
    sampler = DynamicSampler(generate_fn, train_batch_size=512,
                             max_num_gen_batches=10)
    groups, stats = sampler.sample(prompt_batches)  # iterator of lists
  """

  def __init__(self,
               generate_fn: GenerateFn | None = None,
               *,
               train_batch_size: int,
               max_num_gen_batches: int = 0,
               keep_surplus: bool = False,
               enable: bool = True,
               group_type: type[Group] = Group):
    """Configures the sampler.

    Args:
      generate_fn: prompts -> one scored Group per prompt, in order; None:
        each `sample` call passes its own (e.g. bound to that step's weights).
      train_batch_size: groups per training step (paper: 512).
      max_num_gen_batches: stop with MaxGenBatchesExceededError after this
        many generation batches in one call; 0 = unlimited (paper: 10).
      keep_surplus: carry valid groups beyond train_batch_size into the next
        call instead of discarding them (spec 5 option; off by default).
      enable: False disables filtering (naive GRPO): the first
        train_batch_size groups are taken whatever their accuracy.
      group_type: the Group class whose `from_json` restores `state_dict()`.
    """
    if int(train_batch_size) < 1:
      raise ValueError(f"train_batch_size must be >= 1, got "
                       f"{train_batch_size}.")
    if int(max_num_gen_batches) < 0:
      raise ValueError(f"max_num_gen_batches must be >= 0 (0 = unlimited), "
                       f"got {max_num_gen_batches}.")
    self.generate_fn = generate_fn
    self.train_batch_size = int(train_batch_size)
    self.max_num_gen_batches = int(max_num_gen_batches)
    self.keep_surplus = bool(keep_surplus)
    self.enable = bool(enable)
    self.group_type = group_type
    self._carried: list[Group] = []

  @property
  def carried_groups(self) -> list[Group]:
    """Surplus groups that the next `sample` call will use first."""
    return list(self._carried)

  def sample(self,
             gen_batch_iter: Iterator[list],
             initial_groups: Sequence[Group] = (),
             generate_fn: GenerateFn | None = None
             ) -> tuple[list[Group], SamplingStats]:
    """Generates until `train_batch_size` kept groups are gathered.

    Args:
      gen_batch_iter: iterator of prompt lists (one generation batch each).
      initial_groups: groups to start from, before the carried surplus, e.g.
        `err.groups` of a DatasetExhaustedError to continue on a new epoch.
        They are not re-filtered.
      generate_fn: this call's rollout (default: the one given at init).

    Returns:
      (exactly train_batch_size groups in generation order, stats).

    Raises:
      MaxGenBatchesExceededError, DatasetExhaustedError: both carry `.groups`
        (everything gathered, carried surplus included) and `.stats`.
    """
    generate_fn = generate_fn or self.generate_fn
    if generate_fn is None:
      raise ValueError("DynamicSampler.sample needs a generate_fn: pass one at "
                       "init or to sample().")
    stats = SamplingStats(carried_in_groups=len(self._carried))
    buffer = list(initial_groups) + self._carried
    self._carried = []
    while len(buffer) < self.train_batch_size:
      try:
        prompts = next(gen_batch_iter)
      except StopIteration:
        raise DatasetExhaustedError(
            f"The prompt iterator ran out after {stats.num_gen_batches} "
            f"generation batch(es) with {len(buffer)}/"
            f"{self.train_batch_size} groups gathered. Start a new epoch and "
            f"pass err.groups as initial_groups to continue.",
            buffer, stats) from None
      prompts = list(prompts)
      stats.num_gen_batches += 1
      groups = list(generate_fn(prompts))
      if len(groups) != len(prompts):
        raise ValueError(f"generate_fn returned {len(groups)} groups for "
                         f"{len(prompts)} prompts; it must return one Group "
                         f"per prompt.")
      for g in groups:
        if not isinstance(g, Group):
          raise TypeError(f"generate_fn must return Group objects, got "
                          f"{type(g).__name__}.")
        stats.num_groups_generated += 1
        stats.rollouts_generated += g.size
        stats.num_all_correct += g.all_correct and g.size > 1
        stats.num_all_wrong += g.all_wrong and g.size > 1
        if g.is_valid:
          stats.num_groups_kept += 1
        if g.is_valid or not self.enable:
          buffer.append(g)
      if len(buffer) >= self.train_batch_size:
        break
      # Checked after the fill test: a batch filled by the last allowed
      # generation batch succeeds (spec 5 order).
      if 0 < self.max_num_gen_batches <= stats.num_gen_batches:
        raise MaxGenBatchesExceededError(
            f"Dynamic sampling gathered only {len(buffer)}/"
            f"{self.train_batch_size} groups in {stats.num_gen_batches} "
            f"generation batches (max_num_gen_batches="
            f"{self.max_num_gen_batches}): kept ratio "
            f"{stats.kept_ratio:.3f}, all-correct "
            f"{stats.all_correct_ratio:.3f}, all-wrong "
            f"{stats.all_wrong_ratio:.3f}. Raise max_num_gen_batches (0 = "
            f"unlimited) or the generation batch size, or check the data "
            f"and reward. The gathered groups are in err.groups.",
            buffer, stats)

    batch = buffer[:self.train_batch_size]
    surplus = buffer[self.train_batch_size:]
    stats.rollouts_trained = sum(g.size for g in batch)
    stats.surplus_groups = len(surplus)
    stats.surplus_carried = self.keep_surplus and bool(surplus)
    if self.keep_surplus:
      self._carried = surplus
    return batch, stats

  def carry(self, groups: Sequence[Group]) -> None:
    """Makes `groups` the first the next `sample` call uses (replacing any carried surplus).

    For `err.groups` of a failed call, which already include the surplus it started from: a
    trainer that checkpoints after the failure keeps everything gathered for its next launch.
    """
    self._carried = list(groups)

  def state_dict(self) -> dict[str, Any]:
    """Checkpointable state as JSON values: the carried surplus (`Group.to_json`)."""
    return {"version": STATE_VERSION,
            "carried": [g.to_json() for g in self._carried]}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Restores `state_dict()` output (`group_type.from_json` per group)."""
    version = state.get("version")
    if version != STATE_VERSION:
      raise ValueError(f"DynamicSampler state version {version!r} is not "
                       f"supported (expected {STATE_VERSION}).")
    self._carried = [self.group_type.from_json(g) for g in state["carried"]]
