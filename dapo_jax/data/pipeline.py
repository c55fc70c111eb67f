"""Prompt rendering, padding and a resumable, shardable batch iterator (spec section 7).

Host-side and NumPy only: the trainer turns the padded arrays into device
arrays itself.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from dapo_jax.data.records import MathRecord
from dapo_jax.infra import distributed

_log = logging.getLogger(__name__)


class ChatTokenizer(Protocol):
  """What the data pipeline needs from a tokenizer (see dapo_jax/tokenizers/)."""
  pad_id: int

  def apply_chat_template(self, messages: list[dict[str, str]],
                          add_generation_prompt: bool = True) -> str:
    ...

  def encode(self, text: str) -> list[int]:
    ...


TRUNCATE_MODES = ("left", "right", "error")  # data.truncate


class PromptTooLongError(ValueError):
  """A prompt renders to more than data.max_prompt_length tokens under data.truncate='error'."""


def render_full(record: MathRecord | str, tokenizer: ChatTokenizer) -> list[int]:
  """Token ids of one prompt, not truncated: the user turn through the model's chat template
  with `add_generation_prompt=True`."""
  content = record.prompt if isinstance(record, MathRecord) else record
  text = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                       add_generation_prompt=True)
  return list(tokenizer.encode(text))


def fit_prompt(ids: Sequence[int], max_prompt_length: int, truncate: str = "left"
               ) -> list[int]:
  """``ids`` cut to ``max_prompt_length`` as ``truncate`` (``data.truncate``) says: "left"
  cuts the START (spec section 7), so the generation prompt and the end of the question, where
  the answer-format instruction sits, survive; "right" cuts the end; "error" refuses."""
  if max_prompt_length <= 0:
    raise ValueError(f"max_prompt_length must be positive, got {max_prompt_length}")
  if truncate not in TRUNCATE_MODES:
    raise ValueError(f"truncate={truncate!r}; choose one of {TRUNCATE_MODES}.")
  ids = list(ids)
  if len(ids) <= max_prompt_length:
    return ids
  if truncate == "error":
    raise PromptTooLongError(
        f"A prompt renders to {len(ids)} tokens, more than data.max_prompt_length="
        f"{max_prompt_length}. Raise data.max_prompt_length to {len(ids)} or more, or set "
        "data.truncate='left' (cut its start) or 'right'.")
  return ids[-max_prompt_length:] if truncate == "left" else ids[:max_prompt_length]


def render_prompt(record: MathRecord | str, tokenizer: ChatTokenizer,
                  max_prompt_length: int, truncate: str = "left") -> list[int]:
  """Token ids of one prompt: chat template, generation prompt, truncation (`fit_prompt`)."""
  return fit_prompt(render_full(record, tokenizer), max_prompt_length, truncate)


def overlong_prompts(records: Sequence[MathRecord], tokenizer: ChatTokenizer,
                     max_prompt_length: int) -> tuple[int, int, int]:
  """(distinct prompts longer than ``max_prompt_length`` tokens, distinct prompts, the longest
  one's tokens): what a run would truncate, counted once per distinct prompt text."""
  lengths = [len(render_full(p, tokenizer)) for p in sorted({r.prompt for r in records})]
  return (sum(n > max_prompt_length for n in lengths), len(lengths), max(lengths, default=0))


def left_pad(id_lists: Sequence[Sequence[int]], pad_id: int,
             length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Left-pads token id lists into a batch, so every prompt ends at the last column.

  Args:
    id_lists: B lists of token ids.
    pad_id: id written into padding positions.
    length: P; by default the longest list. Pass a fixed value (e.g.
      max_prompt_length) to keep shapes static across steps and avoid recompiles.

  Returns:
    ids_BxP (int32) and mask_BxP (int32, 1 on real tokens, 0 on padding).
  """
  if not id_lists:
    raise ValueError("left_pad needs at least one sequence")
  longest = max(len(ids) for ids in id_lists)
  if length is None:
    length = longest
  elif longest > length:
    raise ValueError(f"a sequence has {longest} tokens, more than length={length}; "
                     "truncate first (render_prompt does)")
  ids_BxP = np.full((len(id_lists), length), pad_id, dtype=np.int32)
  mask_BxP = np.zeros((len(id_lists), length), dtype=np.int32)
  for b, ids in enumerate(id_lists):
    if len(ids):
      ids_BxP[b, length - len(ids):] = ids
      mask_BxP[b, length - len(ids):] = 1
  return ids_BxP, mask_BxP


def epoch_permutation(num_records: int, seed: int, epoch: int) -> np.ndarray:
  """The record order of one epoch: a function of (seed, epoch) only."""
  # SeedSequence mixes the pair, so nearby seeds / epochs give unrelated orders.
  rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
  return rng.permutation(num_records)


class PromptIterator:
  """Deterministic epochs of record batches, resumable and split across processes.

  Each global batch holds `batch_size` records; process `p` of `n` yields its
  contiguous `batch_size // n` slice, so the processes together see every record
  of the batch exactly once. Epoch `e` is ordered by `epoch_permutation(len,
  seed, e)`. The state is the pair (epoch, batches consumed in it), so restoring
  a checkpointed state yields exactly the batch an uninterrupted run would.

  With `drop_remainder` the last `len % batch_size` records of each epoch's
  order are left out (a different set every epoch when shuffling). Without it
  the short last batch is split as evenly as possible, so processes may get
  unequal shares; keep `drop_remainder=True` for SPMD training.
  """

  def __init__(self, records: Sequence[Any], batch_size: int, seed: int, *,
               shuffle: bool = True, drop_remainder: bool = True,
               num_epochs: int | None = None, process_index: int = 0,
               process_count: int = 1):
    if batch_size <= 0:
      raise ValueError(f"batch_size must be positive, got {batch_size}")
    if process_count <= 0 or not 0 <= process_index < process_count:
      raise ValueError(f"need 0 <= process_index < process_count, got {process_index} "
                       f"and {process_count}")
    if batch_size % process_count:
      raise ValueError(f"batch_size {batch_size} is not divisible by process_count "
                       f"{process_count}; every process needs an equal share of the batch")
    if num_epochs is not None and num_epochs < 0:
      raise ValueError(f"num_epochs must be None (endless) or >= 0, got {num_epochs}")
    n = len(records)
    if n == 0 or (drop_remainder and n < batch_size):
      raise ValueError(f"{n} records cannot fill one batch of {batch_size}"
                       + (" (drop_remainder=True)" if n else ""))
    self._records = records
    self.batch_size = batch_size
    self.seed = int(seed)
    self.shuffle = shuffle
    self.drop_remainder = drop_remainder
    self.num_epochs = num_epochs
    self.process_index = process_index
    self.process_count = process_count
    self.epoch = 0
    self.position = 0  # batches of the current epoch already yielded
    self._order: np.ndarray | None = None
    self._order_epoch = -1

  @property
  def num_records(self) -> int:
    return len(self._records)

  @property
  def batches_per_epoch(self) -> int:
    n = len(self._records)
    return n // self.batch_size if self.drop_remainder else -(-n // self.batch_size)

  @property
  def exhausted(self) -> bool:
    return self.num_epochs is not None and self.epoch >= self.num_epochs

  def _epoch_order(self) -> np.ndarray:
    if self._order_epoch != self.epoch:
      n = len(self._records)
      self._order = (epoch_permutation(n, self.seed, self.epoch) if self.shuffle
                     else np.arange(n))
      self._order_epoch = self.epoch
    return self._order

  def global_batch_indices(self) -> np.ndarray:
    """Record indices of the next global batch (all processes); does not advance."""
    start = self.position * self.batch_size
    return self._epoch_order()[start:start + self.batch_size]

  def _local_slice(self, global_indices: np.ndarray) -> np.ndarray:
    # array_split equals equal contiguous slices for full batches, and still splits
    # a short final batch (drop_remainder=False) disjointly and completely.
    return np.array_split(global_indices, self.process_count)[self.process_index]

  def __iter__(self) -> PromptIterator:
    return self

  def __next__(self) -> list[Any]:
    if self.exhausted:
      raise StopIteration(f"PromptIterator exhausted: all {self.num_epochs} epoch(s) of "
                          f"{self.batches_per_epoch} batches were yielded")
    indices = [int(i) for i in self._local_slice(self.global_batch_indices())]
    getitems = getattr(self._records, "__getitems__", None)
    if getitems is not None:  # batched random access (e.g. an ArrayRecord source)
      batch = list(getitems(indices))
    else:
      batch = [self._records[i] for i in indices]
    # Advance only once the read succeeded, so a failed read can be retried.
    self.position += 1
    if self.position >= self.batches_per_epoch:
      self.epoch += 1
      self.position = 0
    return batch

  def get_state(self) -> dict[str, Any]:
    """A small JSON-able dict; `set_state` on a like-configured iterator resumes here."""
    return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
            "batch_size": self.batch_size, "num_records": self.num_records,
            "shuffle": self.shuffle, "drop_remainder": self.drop_remainder}

  def set_state(self, state: dict[str, Any]) -> None:
    """Restores `get_state()` output; refuses a state from a different data setup."""
    # Resuming with another seed / batch size / dataset would silently replay or
    # skip prompts, so those must match what the state was saved with.
    for key in ("seed", "batch_size", "num_records", "shuffle", "drop_remainder"):
      if key in state and state[key] != getattr(self, key):
        raise ValueError(f"cannot resume: saved {key}={state[key]!r} but this iterator has "
                         f"{key}={getattr(self, key)!r}")
    epoch, position = int(state["epoch"]), int(state["position"])
    if epoch < 0 or not 0 <= position < self.batches_per_epoch:
      raise ValueError(f"invalid iterator state epoch={epoch} position={position} "
                       f"({self.batches_per_epoch} batches per epoch)")
    self.epoch, self.position = epoch, position


def gather_records(records: Sequence[MathRecord]) -> list[MathRecord]:
  """Every process's share of a generation batch, in process order (the global batch order)."""
  if not distributed.is_multiprocess():
    return list(records)
  rows = distributed.allgather_json([dataclasses.asdict(r) for r in records])
  return [MathRecord(**r) for r in rows]


def global_batches(local_batches: Iterator[Sequence[MathRecord]]) -> Iterator[list[MathRecord]]:
  """Each process's prompt iterator yields its own share; this yields the whole generation batch
  (the same list on every process), one gather per batch actually drawn."""
  for records in local_batches:
    yield gather_records(records)


def check_prompt_lengths(records: Sequence[MathRecord], tokenizer: ChatTokenizer,
                         max_prompt_length: int, truncate: str) -> None:
  """Warns once, at start-up, how many distinct training prompts ``max_prompt_length``
  (``data.max_prompt_length``) cuts, and how (``data.truncate``); under "error" refuses the
  run before any work."""
  over, distinct, longest = overlong_prompts(records, tokenizer, max_prompt_length)
  if not over:
    return
  what = f"{over} of the {distinct} distinct training prompts"
  if truncate == "error":
    raise PromptTooLongError(
        f"{what} render to more than data.max_prompt_length={max_prompt_length} tokens (the "
        f"longest to {longest}). Raise data.max_prompt_length to {longest}, or set "
        "data.truncate='left' (cut their start) or 'right'.")
  _log.warning("%s render to more than data.max_prompt_length=%d tokens (the longest to %d); "
               "data.truncate=%r cuts their %s. data.max_prompt_length=%d keeps them whole.",
               what, max_prompt_length, longest, truncate,
               "start" if truncate == "left" else "end", longest)
