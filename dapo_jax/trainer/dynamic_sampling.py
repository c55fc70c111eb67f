"""Dynamic sampling (spec section 5): keep generating until enough groups vary.

Host-side Python/NumPy, two loops over the same filter:

* `DynamicSampler.sample`, the batch-level loop: whole generation batches through ANY rollout
  callable `generate_fn(prompts) -> list[Group]` (static sampler, continuous engine, a test
  fake), surplus groups discarded after they were decoded.
* `DynamicSampler.sample_stream`, streaming: prompts are admitted one at a time into a
  `GroupStream` (rollout + scoring, groups returned as they finish) only while the groups
  pending and kept can still fall short of `train_batch_size`. By default (``wait=True``) groups
  are taken in admission order and every admitted prompt is waited for, so for the same prompt
  order and samples it keeps exactly the groups, and leaves the prompt iterator exactly where,
  the batch-level loop does (what it saves is decoding the tail of the last generation batch
  that the batch loop throws away). ``wait=False`` takes groups as they finish and stops at the
  first `train_batch_size` kept ones: faster with a continuous engine, but biased toward groups
  that finish first (short responses).

One piece: the group, the keep/drop rule, the sampling statistics and the two sampling loops (batch
and stream) that apply them.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Iterator, Protocol, Sequence

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
  trained_groups: int = 0
  carried_in_groups: int = 0  # surplus of the previous call used as input.
  surplus_groups: int = 0  # kept beyond train_batch_size.
  surplus_carried: bool = False  # True: surplus kept for the next call.
  # Prompts sent to the rollout (the batch loop: every prompt of every generation batch drawn;
  # streaming: those admitted) and the size of a generation batch, so that
  # gen_batches_admitted = prompts_admitted / gen_batch_size compares the two loops.
  prompts_admitted: int = 0
  gen_batch_size: int = 0
  # Filled from the rollout's counters by the trainer: response tokens decoded (kept or not)
  # and decode slot-steps (rows x decode steps the engine ran, idle rows included).
  decoded_tokens: int = 0
  decode_slot_steps: int = 0
  # Paged KV cache: samples sent back to the queue for want of pages (decoded again, the same
  # tokens; their first pass counts in decoded_tokens).
  preemptions: int = 0

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

  @property
  def gen_batches_admitted(self) -> float:
    """Generation batches' worth of prompts sent to the rollout (fractional when streaming)."""
    return self.prompts_admitted / self.gen_batch_size if self.gen_batch_size else 0.0

  @property
  def slot_utilization(self) -> float:
    """Response tokens per decode slot-step (1 = no slot ever idle)."""
    return self.decoded_tokens / self.decode_slot_steps if self.decode_slot_steps else 0.0

  @property
  def decoded_tokens_per_kept_group(self) -> float:
    """Response tokens decoded per group trained (discarded groups' tokens included)."""
    return self.decoded_tokens / self.trained_groups if self.trained_groups else 0.0

  @property
  def decoded_per_kept_vs_ideal(self) -> float:
    """`decoded_tokens_per_kept_group` over its ideal, every decoded group kept (1 = no waste).
    Not in `to_dict` (a run's logged keys stay as they were); the skip filter logs it."""
    if not (self.decoded_tokens and self.num_groups_generated):
      return 0.0
    return self.decoded_tokens_per_kept_group / (self.decoded_tokens / self.num_groups_generated)

  def to_dict(self) -> dict[str, float]:
    """Flat metrics for the logger."""
    d = {k: float(v) for k, v in dataclasses.asdict(self).items()}
    d.update(kept_ratio=self.kept_ratio,
             all_correct_ratio=self.all_correct_ratio,
             all_wrong_ratio=self.all_wrong_ratio,
             gen_batches_admitted=self.gen_batches_admitted,
             slot_utilization=self.slot_utilization,
             decoded_tokens_per_kept_group=self.decoded_tokens_per_kept_group)
    return d


class DynamicSamplingError(RuntimeError):
  """Sampling stopped early; `groups` and `stats` hold what was gathered."""

  def __init__(self, message: str, groups: list[Group],
               stats: SamplingStats):
    super().__init__(message)
    self.groups = groups
    self.stats = stats

  def __reduce__(self):  # pickled whole (a rollout process sends it to the trainer)
    return type(self), (str(self), self.groups, self.stats), self.__dict__


class MaxGenBatchesExceededError(DynamicSamplingError):
  """`max_num_gen_batches` generation batches did not fill the batch."""


class DatasetExhaustedError(DynamicSamplingError):
  """The prompt iterator ended before the batch was full."""


GenerateFn = Callable[[list], Sequence[Group]]


class GroupStream(Protocol):
  """Rollout plus scoring, one prompt at a time (e.g. `generation.ScoringStream`)."""

  def admit(self, prompt: Any, index: int) -> None:
    """Starts generating the group of `prompt`; `index` identifies it in `poll`."""

  def poll(self) -> list[tuple[int, Group]]:
    """Waits until at least one admitted group is done; returns the finished (index, group)s."""

  # Optional ``admission_block`` (int): prompts the stream decodes together at the cost of one
  # (a static sampler's call); the loop then admits whole blocks (ids k*block ... ) at a time.


class PreFilter(Protocol):
  """Skips prompts before their rollout (e.g. `skip_filter.SkipFilter`); must decide the same on
  every process."""

  def admit(self, prompts: Sequence[Any]) -> list[Any]:
    """The drawn generation batch's prompts to roll out, in order."""

  def record(self, prompt: Any, acc: np.ndarray) -> None:
    """A scored group's outcome."""

  def end_call(self, num_generated: int, num_all_right: int, num_all_wrong: int) -> None:
    """A `sample`/`sample_stream` call gathered its batch."""

  def state_dict(self) -> dict[str, Any]:
    """JSON state, saved with the sampler's."""

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """The inverse of `state_dict`."""


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
               group_type: type[Group] = Group,
               prefilter: PreFilter | None = None):
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
      prefilter: skips drawn prompts before their rollout and learns from every group taken
        (None: every drawn prompt is rolled out, as without one).
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
    self.prefilter = prefilter
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
    stats, buffer = self._start(initial_groups)
    while len(buffer) < self.train_batch_size:
      # Checked before drawing, i.e. after the fill test of the previous batch: a batch filled
      # by the last allowed generation batch succeeds (spec 5 order).
      prompts = self._draw(gen_batch_iter, stats, buffer)
      groups = list(generate_fn(prompts))
      stats.prompts_admitted += len(prompts)
      if len(groups) != len(prompts):
        raise ValueError(f"generate_fn returned {len(groups)} groups for "
                         f"{len(prompts)} prompts; it must return one Group "
                         f"per prompt.")
      for g in groups:
        self._take(g, stats, buffer)
    return self._finish(buffer, stats)

  def sample_stream(self,
                    gen_batch_iter: Iterator[list],
                    stream: GroupStream,
                    initial_groups: Sequence[Group] = (),
                    *,
                    wait: bool = True) -> tuple[list[Group], SamplingStats]:
    """`sample`, admitting prompts into `stream` only while they can still be needed.

    Prompts are admitted with ids 0, 1, ... in the iterator's order while the groups kept plus
    those admitted and not yet taken fall short of `train_batch_size`, rounded up to the
    stream's ``admission_block`` (with `keep_surplus`, whole generation batches: their valid
    groups beyond the batch are carried, as in `sample`).
    Prompts of the last generation batch never admitted are dropped, as `sample` drops their
    groups. Nothing is in flight when it returns (``wait=True``): the sampler's state is the
    carried surplus and the iterator's position, as for `sample`.

    Args:
      gen_batch_iter: iterator of prompt lists (one generation batch each).
      stream: rollout and scoring of admitted prompts; this call does not close it.
      initial_groups: as for `sample`.
      wait: True takes groups in admission order and waits for every admitted prompt (the kept
        groups are exactly `sample`'s for the same prompts and samples). False takes them in
        the order they finish and stops at the first `train_batch_size` kept ones, leaving
        the rest in flight (the caller closes the stream): early finishers are favoured.

    Returns and raises: as `sample` (the errors are raised once nothing is in flight).
    """
    stats, buffer = self._start(initial_groups)
    t = self.train_batch_size
    queue: collections.deque = collections.deque()  # drawn, not yet admitted
    finished: dict[int, Group] = {}  # taken out of the stream, waiting for their turn
    admitted = taken = 0
    failure = None
    whole = self.keep_surplus or not wait  # admit whole generation batches
    # A block a stream decodes together costs the same however few of it are admitted.
    block = max(1, int(getattr(stream, "admission_block", 1)))
    start = len(buffer)
    while True:
      if len(buffer) >= t and (not wait or admitted == taken):
        return self._finish(buffer, stats)
      # Admission within a drawn generation batch expects the groups in flight to be kept at
      # the rate seen so far in this call (starting at 1), so the long tail of one round of
      # admissions is not waited for before the next. A new generation batch is drawn only if
      # the batch could not fill even were every group in flight kept: the iterator moves
      # exactly as the batch loop's does.
      rate = (len(buffer) - start) / taken if taken else 1.0
      while failure is None:
        in_flight = admitted - taken
        if queue and (whole or len(buffer) + in_flight * rate < t or admitted % block):
          stream.admit(queue.popleft(), admitted)
          admitted += 1
          stats.prompts_admitted += 1
        elif not queue and len(buffer) + in_flight < t:
          try:
            queue.extend(self._draw(gen_batch_iter, stats, buffer))
          except DynamicSamplingError as err:
            failure = err  # raised once the groups in flight are in the buffer
        else:
          break
      if admitted == taken:
        if failure is None:  # unreachable: a short buffer always admits or fails
          raise RuntimeError("Streaming dynamic sampling stalled with nothing in flight.")
        raise failure
      for index, g in stream.poll():
        if wait:
          finished[index] = g
        else:
          self._take(g, stats, buffer)
          taken += 1
      while wait and taken in finished:
        self._take(finished.pop(taken), stats, buffer)
        taken += 1

  def _start(self, initial_groups: Sequence[Group]) -> tuple[SamplingStats, list[Group]]:
    stats = SamplingStats(carried_in_groups=len(self._carried))
    buffer = list(initial_groups) + self._carried
    self._carried = []
    return stats, buffer

  def _draw(self, gen_batch_iter: Iterator[list], stats: SamplingStats,
            buffer: list[Group]) -> list:
    """The next generation batch, or the error that ends sampling short of a full batch. With a
    prefilter: the prompts it admits from as many of the iterator's batches as it takes to reach
    a batch's worth (or the iterator's end)."""
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
    prompts: list = []
    while True:  # with a prefilter: the iterator's batches until a batch's worth is admitted
      try:
        drawn = list(next(gen_batch_iter))
      except StopIteration:
        if prompts:
          break  # the last, short batch; the next draw raises
        raise DatasetExhaustedError(
            f"The prompt iterator ran out after {stats.num_gen_batches} "
            f"generation batch(es) with {len(buffer)}/"
            f"{self.train_batch_size} groups gathered. Start a new epoch and "
            f"pass err.groups as initial_groups to continue.",
            buffer, stats) from None
      stats.gen_batch_size = stats.gen_batch_size or len(drawn)
      if self.prefilter is None:
        prompts = drawn
        break
      # Skipped prompts cost no decoding, so they do not count against max_num_gen_batches
      # and do not thin the rollout's batch (prefilter.admit's floor keeps this finite).
      prompts += self.prefilter.admit(drawn)
      if len(prompts) >= stats.gen_batch_size:
        break
    stats.num_gen_batches += 1
    return prompts

  def _take(self, g: Group, stats: SamplingStats, buffer: list[Group]) -> None:
    """Counts one generated group and keeps it if it trains."""
    if not isinstance(g, Group):
      raise TypeError(f"The rollout must return Group objects, got {type(g).__name__}.")
    stats.num_groups_generated += 1
    stats.rollouts_generated += g.size
    stats.num_all_correct += g.all_correct and g.size > 1
    stats.num_all_wrong += g.all_wrong and g.size > 1
    if self.prefilter is not None:
      self.prefilter.record(g.prompt, g.acc)
    if g.is_valid:
      stats.num_groups_kept += 1
    if g.is_valid or not self.enable:
      buffer.append(g)

  def _finish(self, buffer: list[Group], stats: SamplingStats
              ) -> tuple[list[Group], SamplingStats]:
    batch = buffer[:self.train_batch_size]
    surplus = buffer[self.train_batch_size:]
    stats.rollouts_trained = sum(g.size for g in batch)
    stats.trained_groups = len(batch)
    stats.surplus_groups = len(surplus)
    stats.surplus_carried = self.keep_surplus and bool(surplus)
    if self.keep_surplus:
      self._carried = surplus
    if self.prefilter is not None:
      self.prefilter.end_call(stats.num_groups_generated, stats.num_all_correct,
                              stats.num_all_wrong)
    return batch, stats

  def carry(self, groups: Sequence[Group]) -> None:
    """Makes `groups` the first the next `sample` call uses (replacing any carried surplus).

    For `err.groups` of a failed call, which already include the surplus it started from: a
    trainer that checkpoints after the failure keeps everything gathered for its next launch.
    """
    self._carried = list(groups)

  def state_dict(self) -> dict[str, Any]:
    """Checkpointable state as JSON values: the carried surplus (`Group.to_json`) and the
    prefilter's state (only with one)."""
    state = {"version": STATE_VERSION, "carried": [g.to_json() for g in self._carried]}
    if self.prefilter is not None:
      state["prefilter"] = self.prefilter.state_dict()
    return state

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Restores `state_dict()` output (`group_type.from_json` per group)."""
    version = state.get("version")
    if version != STATE_VERSION:
      raise ValueError(f"DynamicSampler state version {version!r} is not "
                       f"supported (expected {STATE_VERSION}).")
    self._carried = [self.group_type.from_json(g) for g in state["carried"]]
    # A run that turns the prefilter on at a resume starts its history empty.
    if self.prefilter is not None and "prefilter" in state:
      self.prefilter.load_state_dict(state["prefilter"])
