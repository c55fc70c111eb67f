"""Prompts -> rollout -> decoded, verified responses, for training and evaluation.

Host side: prompt rendering, compiled rollout calls (the whole batch, or chunks of
``rollout.prompts_per_call``), one device->host copy of each call's results, decoding and
verification. Device side stays inside the sampler. Evaluation rolls out whole batches
(``generate_and_score``); training goes through a ``ScoringStream`` (one per step) that both
dynamic-sampling loops read: the batch-level loop admits whole generation batches
(``ScoringStream.generate``), the streaming loop admits prompt by prompt.

On several processes (multi-controller SPMD) the records are the same on every process (see
``pipeline.global_batches``), the rollout runs on global arrays
(``distributed.global_rollout``), each process verifies its share of the responses and the
rewards are gathered, so the dynamic-sampling filter decides identically everywhere.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from dapo_jax.trainer import diagnostics
from dapo_jax.infra import distributed
from dapo_jax.data.pipeline import fit_prompt, left_pad, render_full, render_prompt
from dapo_jax.data.records import MathRecord
from dapo_jax.rewards.batch import RewardBatch, RewardScorer, gather_rewards
from dapo_jax.rollout.sampling import SamplingParams
from dapo_jax.rollout.stream import RolloutStream
from dapo_jax.trainer.trajectories import ScoredGroup

# (weights, prompt_ids [B,P], prompt_mask [B,P], key, sampling params, num_samples) ->
# RolloutBatch-like with response_ids, response_mask, logprobs, lengths, truncated.
RolloutFn = Callable[[Any, np.ndarray, np.ndarray, jax.Array, SamplingParams, int], Any]
_ROLLOUT_FIELDS = ("response_ids", "response_mask", "logprobs", "lengths", "truncated")


def render_batch(records: Sequence[MathRecord], tokenizer, max_prompt_length: int,
                 truncate: str = "left"
                 ) -> tuple[np.ndarray, np.ndarray]:
  """Left-padded prompt ids at the fixed width ``max_prompt_length`` (no retrace per batch)."""
  ids = [render_prompt(r, tokenizer, max_prompt_length, truncate) for r in records]
  return left_pad(ids, tokenizer.pad_id, length=max_prompt_length)


def decode_responses(tokenizer, response_ids: np.ndarray, lengths: np.ndarray,
                     eos_ids: Sequence[int]) -> list[str]:
  """Response texts without the stop token and with special tokens skipped, as verl's DAPO
  reward manager decodes them: ``Answer: 5<|im_start|>`` is read as ``Answer: 5``."""
  out = []
  stop = set(int(e) for e in eos_ids)
  for row, n in zip(response_ids, lengths):
    toks = [int(t) for t in row[:int(n)]]
    if toks and toks[-1] in stop:
      toks = toks[:-1]
    out.append(tokenizer.decode(toks, skip_special_tokens=True))
  return out


def score_spread(scorer: RewardScorer, texts: Sequence[str], ground_truths: Sequence[str],
                 lengths: np.ndarray) -> RewardBatch:
  """Verifies this process's share of the responses and gathers everyone's rewards."""
  if not distributed.is_multiprocess():
    return scorer(texts, ground_truths, lengths)
  sl = distributed.share(len(texts))
  return gather_rewards(
      scorer(list(texts[sl]), list(ground_truths[sl]), np.asarray(lengths)[sl]))


def rollout_chunks(rollout: Callable[..., Any], prompt_ids: np.ndarray, prompt_mask: np.ndarray,
                   key: jax.Array, num_samples: int, prompts_per_call: int
                   ) -> dict[str, np.ndarray]:
  """One rollout call per chunk of prompts (bounds the KV cache); host arrays, rows in order.

  ``rollout(ids, mask, key, num_samples)``; chunk i draws with ``fold_in(key, i)``.
  """
  b = prompt_ids.shape[0]
  if prompts_per_call <= 0 or prompts_per_call >= b:
    out = jax.device_get(rollout(prompt_ids, prompt_mask, key, num_samples))
    return {k: np.asarray(getattr(out, k)) for k in _ROLLOUT_FIELDS}
  if b % prompts_per_call:
    raise ValueError(f"rollout.prompts_per_call={prompts_per_call} must divide the generation "
                     f"batch of {b} prompts.")
  outs = []
  for i, s in enumerate(range(0, b, prompts_per_call)):
    sl = slice(s, s + prompts_per_call)
    outs.append(jax.device_get(rollout(prompt_ids[sl], prompt_mask[sl],
                                       jax.random.fold_in(key, i), num_samples)))
  return {k: np.concatenate([np.asarray(getattr(o, k)) for o in outs]) for k in _ROLLOUT_FIELDS}


@dataclasses.dataclass
class ScoredRollout:
  """B prompts x G responses, decoded and verified (rows prompt-major, R response columns)."""
  records: list[MathRecord]  # [B]
  prompt_ids: np.ndarray  # [B, P] int32
  prompt_mask: np.ndarray  # [B, P] int32
  response_ids: np.ndarray  # [B*G, R]
  response_mask: np.ndarray  # [B*G, R]
  logprobs: np.ndarray  # [B*G, R]
  lengths: np.ndarray  # [B*G]
  truncated: np.ndarray  # [B*G]
  texts: list[str]  # [B*G]
  rewards: RewardBatch  # [B*G]
  num_samples: int  # G

  def groups(self) -> list[ScoredGroup]:
    """One ``ScoredGroup`` per prompt (the dynamic sampler's unit, spec 5)."""
    g, r, out = self.num_samples, self.rewards, []
    for i, rec in enumerate(self.records):
      sl = slice(i * g, (i + 1) * g)
      out.append(ScoredGroup(
          prompt=rec, acc=r.acc[sl], reward=r.reward[sl],
          prompt_ids=np.repeat(self.prompt_ids[i:i + 1], g, axis=0),
          prompt_mask=np.repeat(self.prompt_mask[i:i + 1], g, axis=0).astype(bool),
          response_ids=self.response_ids[sl], response_mask=self.response_mask[sl].astype(bool),
          logprobs=self.logprobs[sl].astype(np.float32), lengths=self.lengths[sl],
          truncated=self.truncated[sl].astype(bool), texts=self.texts[sl],
          score=r.score[sl], penalty=r.overlong_penalty[sl],
          num_errors=r.num_errors if i == 0 else 0,
          num_timeouts=r.num_timeouts if i == 0 else 0))
    return out


@dataclasses.dataclass(frozen=True)
class Generator:
  """``generate_and_score`` with all but the weights, the records and the key bound."""
  rollout: RolloutFn  # on several processes: ``distributed.global_rollout``
  tokenizer: Any
  scorer: RewardScorer
  sampling: SamplingParams
  num_samples: int
  max_prompt_length: int
  prompts_per_call: int = 0
  truncate: str = "left"  # data.truncate: prompts over max_prompt_length (pipeline.fit_prompt)
  # (weights, *, params, num_samples, key) -> RolloutStream (``rollout.factory``); training only.
  open_stream: Callable[..., RolloutStream] | None = None

  def __call__(self, weights, records: Sequence[MathRecord], key: jax.Array,
               pad_to: int = 0) -> ScoredRollout:
    return generate_and_score(self, weights, records, key, pad_to=pad_to)

  def stream(self, weights, key: jax.Array) -> ScoringStream:
    """One step's stream of scored groups at these weights; prompt i's samples depend on
    (key, i) only."""
    if self.open_stream is None:
      raise ValueError("This Generator was built without open_stream (rollout.factory).")
    return ScoringStream(self, self.open_stream(weights, params=self.sampling,
                                                num_samples=self.num_samples, key=key))


class ScoringStream:
  """Records in, scored groups out: renders a record when admitted, decodes and verifies the
  groups of each poll together (the dynamic sampler's ``GroupStream``).

  On several processes every process admits and polls the same prompts (the rollout stream is
  deterministic), so the gathered rewards match everywhere.
  """

  def __init__(self, gen: Generator, stream: RolloutStream):
    self._gen, self._stream = gen, stream
    self.log = diagnostics.GenerationLog()  # every poll's groups and wall time
    self._records: dict[int, MathRecord] = {}
    self._next = 0  # ``generate`` continues after the last index admitted
    self._newest = None  # `follow`
    self.check = None  # called before each poll; raises to abandon the batch (a stopping run)
    self.prompts_truncated = 0  # admitted prompts cut to max_prompt_length (data.truncate)

  def follow(self, newest, version: int) -> None:
    """Partial rollouts: the stream's weights are policy ``version``; before each poll,
    ``newest()`` gives (weights, version) of a newer policy (or None), with which the samples
    in flight continue (the rollout stream's ``set_weights``)."""
    self._stream.set_weights(None, version)
    self._newest = newest

  def admit(self, record: MathRecord, index: int) -> None:
    gen = self._gen
    ids = render_full(record, gen.tokenizer)
    self.prompts_truncated += len(ids) > gen.max_prompt_length
    self._stream.admit(fit_prompt(ids, gen.max_prompt_length, gen.truncate), index)
    self._records[index] = record
    self._next = max(self._next, index + 1)

  @property
  def num_pending(self) -> int:
    return self._stream.num_pending

  @property
  def admission_block(self) -> int:
    return int(getattr(self._stream, "admission_block", 1))

  def poll(self) -> list[tuple[int, ScoredGroup]]:
    if self.check is not None:
      self.check()
    start = time.perf_counter()
    newer = self._newest() if self._newest is not None else None
    if newer is not None:
      self._stream.set_weights(*newer)
    finished = self._stream.poll()
    if not finished:
      return []
    gen = self._gen
    records = [self._records.pop(f.prompt_index) for f in finished]
    prompt_ids, prompt_mask = left_pad([f.prompt_ids.tolist() for f in finished],
                                       gen.tokenizer.pad_id, length=gen.max_prompt_length)
    out = {k: np.concatenate([getattr(f, k) for f in finished]) for k in _ROLLOUT_FIELDS}
    groups = score_rollout(gen, records, prompt_ids, prompt_mask, out).groups()
    for f, g in zip(finished, groups):
      g.token_versions = getattr(f, "versions", None)
    self.log.record(time.perf_counter() - start, groups)
    return [(f.prompt_index, g) for f, g in zip(finished, groups)]

  def generate(self, records: Sequence[MathRecord]) -> list[ScoredGroup]:
    """The batch-level loop's ``generate_fn``: admits the records after those already admitted
    and returns their groups in order once all are done."""
    first = self._next
    for j, record in enumerate(records):
      self.admit(record, first + j)
    done: dict[int, ScoredGroup] = {}
    while len(done) < len(records):
      polled = self.poll()
      if not polled:
        raise RuntimeError("The rollout stream returned nothing with prompts pending.")
      done.update(polled)
    return [done[first + j] for j in range(len(records))]

  def stats(self) -> dict[str, float]:
    return self._stream.stats()

  def close(self) -> None:
    self._stream.close()


def generate_and_score(gen: Generator, weights, records: Sequence[MathRecord], key: jax.Array,
                       *, pad_to: int = 0) -> ScoredRollout:
  """Renders, rolls out ``gen.num_samples`` responses per record, decodes and verifies them.

  ``pad_to``: repeat the last record up to this many prompts (one compiled shape for a short
  final batch); the padding rows are dropped before decoding.
  """
  records = list(records)
  padded = records + [records[-1]] * (pad_to - len(records))
  prompt_ids, prompt_mask = render_batch(padded, gen.tokenizer, gen.max_prompt_length,
                                         gen.truncate)
  out = rollout_chunks(
      lambda ids, mask, k, n: gen.rollout(weights, ids, mask, k, gen.sampling, n),
      prompt_ids, prompt_mask, key, gen.num_samples, gen.prompts_per_call)
  if len(padded) > len(records):
    rows = len(records) * gen.num_samples
    out = {k: v[:rows] for k, v in out.items()}
    prompt_ids, prompt_mask = prompt_ids[:len(records)], prompt_mask[:len(records)]
  return score_rollout(gen, records, prompt_ids, prompt_mask, out)


def score_rollout(gen: Generator, records: list[MathRecord], prompt_ids: np.ndarray,
                  prompt_mask: np.ndarray, out: dict[str, np.ndarray]) -> ScoredRollout:
  """Decodes and verifies B prompts' rollout rows (host arrays, prompt-major)."""
  texts = decode_responses(gen.tokenizer, out["response_ids"], out["lengths"],
                           gen.sampling.eos_ids)
  gts = [r.ground_truth for r in records for _ in range(gen.num_samples)]
  rewards = score_spread(gen.scorer, texts, gts, out["lengths"])
  return ScoredRollout(records=records, prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                       texts=texts, rewards=rewards, num_samples=gen.num_samples, **out)
