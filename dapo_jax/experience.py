"""From prompts to scored groups (the dynamic sampler's ``generate_fn``) and back to arrays.

Host side: prompt rendering, compiled rollout calls (the whole generation batch, or chunks of
``rollout.prompts_per_call``), one device->host copy of each call's results, decoding and
verification. Device side stays inside the sampler.

On several processes (multi-controller SPMD) each process loads its own share of the prompts;
the shares are gathered so every process holds the same generation batch, the rollout runs on
global arrays, each process verifies its share of the responses, and the rewards are gathered,
so the dynamic-sampling filter decides identically everywhere.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np

from dapo_jax import distributed
from dapo_jax import objective as obj
from dapo_jax import sharding as shd
from dapo_jax.data.pipeline import left_pad, render_prompt
from dapo_jax.data.records import MathRecord
from dapo_jax.dynamic_sampling import Group
from dapo_jax.rewards.batch import RewardBatch, RewardScorer

# A rollout callable: (prompt_ids [B,P], prompt_mask [B,P], key, num_samples) -> RolloutBatch-like
# with numpy-convertible fields response_ids, response_mask, logprobs, lengths, truncated.
RolloutFn = Callable[[np.ndarray, np.ndarray, jax.Array, int], Any]


@dataclasses.dataclass
class Trajectories:
  """N = groups x G rows, prompt-major, as host arrays (L = P + R)."""
  input_ids: np.ndarray  # [N, L] int32
  attention_mask: np.ndarray  # [N, L] bool
  response_mask: np.ndarray  # [N, R] bool
  sampler_logprobs: np.ndarray  # [N, R] float32
  lengths: np.ndarray  # [N] int32
  truncated: np.ndarray  # [N] bool
  reward: np.ndarray  # [N] float32 (shaped)
  score: np.ndarray  # [N] float32
  acc: np.ndarray  # [N] bool
  overlong_penalty: np.ndarray  # [N] float32
  group_ids: np.ndarray  # [N] int32
  texts: list[str]
  prompts: list[str]

  @property
  def num_rows(self) -> int:
    return int(self.input_ids.shape[0])

  @property
  def response_len(self) -> int:
    return int(self.response_mask.shape[1])


def render_batch(records: Sequence[MathRecord], tokenizer, max_prompt_length: int
                 ) -> tuple[np.ndarray, np.ndarray]:
  """Left-padded prompt ids at the fixed width ``max_prompt_length`` (no retrace per batch)."""
  ids = [render_prompt(r, tokenizer, max_prompt_length) for r in records]
  return left_pad(ids, tokenizer.pad_id, length=max_prompt_length)


def decode_responses(tokenizer, response_ids: np.ndarray, lengths: np.ndarray,
                     eos_ids: Sequence[int]) -> list[str]:
  """Response texts without the stop token (the verifier reads the answer, not <eos>)."""
  out = []
  stop = set(int(e) for e in eos_ids)
  for row, n in zip(response_ids, lengths):
    toks = [int(t) for t in row[:int(n)]]
    if toks and toks[-1] in stop:
      toks = toks[:-1]
    out.append(tokenizer.decode(toks))
  return out


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


def score_spread(scorer: RewardScorer, texts: Sequence[str], ground_truths: Sequence[str],
                 lengths: np.ndarray) -> RewardBatch:
  """Verifies this process's share of the responses and gathers everyone's rewards."""
  if not distributed.is_multiprocess():
    return scorer(texts, ground_truths, lengths)
  sl = distributed.share(len(texts))
  mine = scorer(list(texts[sl]), list(ground_truths[sl]), np.asarray(lengths)[sl])
  gather = distributed.allgather_rows
  counts = gather(np.asarray([[mine.num_errors, mine.num_timeouts]], np.int64)).sum(0)
  return RewardBatch(score=gather(mine.score), acc=gather(mine.acc),
                     pred=distributed.allgather_json(list(mine.pred)),
                     overlong_penalty=gather(mine.overlong_penalty), reward=gather(mine.reward),
                     num_errors=int(counts[0]), num_timeouts=int(counts[1]))


def global_rollout(rollout, mesh, rules: shd.Rules = shd.SAMPLE_RULES):
  """A rollout callable ``(state, ids, mask, key, params, n)`` fed with host prompts that are
  the same on every process: returns the same host ``RolloutBatch`` on every process.

  Single process: ``rollout`` itself (the sampler places host prompts, the caller fetches).
  """
  if not distributed.is_multiprocess():
    return rollout
  if mesh is None:
    raise ValueError("Several processes need a device mesh (config.mesh).")

  def run(state, prompt_ids, prompt_mask, key, params, num_samples):
    sharding = shd.prompt_sharding(mesh, rules, prompt_ids.shape[0], num_samples)
    out = rollout(state, distributed.host_to_global(prompt_ids, sharding),
                  distributed.host_to_global(prompt_mask, sharding), key, params, num_samples)
    return distributed.global_to_host(out)

  return run


def _rollout_chunks(rollout: RolloutFn, prompt_ids: np.ndarray, prompt_mask: np.ndarray,
                    key: jax.Array, num_samples: int, prompts_per_call: int):
  """One rollout call per chunk of prompts (bounds the KV cache); host arrays, rows in order."""
  b = prompt_ids.shape[0]
  fields = ("response_ids", "response_mask", "logprobs", "lengths", "truncated")
  if prompts_per_call <= 0 or prompts_per_call >= b:
    out = jax.device_get(rollout(prompt_ids, prompt_mask, key, num_samples))
    return {k: np.asarray(getattr(out, k)) for k in fields}
  if b % prompts_per_call:
    raise ValueError(f"rollout.prompts_per_call={prompts_per_call} must divide the generation "
                     f"batch of {b} prompts.")
  outs = []
  for i, s in enumerate(range(0, b, prompts_per_call)):
    sl = slice(s, s + prompts_per_call)
    outs.append(jax.device_get(rollout(prompt_ids[sl], prompt_mask[sl],
                                       jax.random.fold_in(key, i), num_samples)))
  return {k: np.concatenate([np.asarray(getattr(o, k)) for o in outs]) for k in fields}


def make_generate_fn(rollout: RolloutFn, tokenizer, scorer: RewardScorer, *, num_samples: int,
                     max_prompt_length: int, eos_ids: Sequence[int],
                     key_fn: Callable[[], jax.Array], prompts_per_call: int = 0
                     ) -> Callable[[list[MathRecord]], list[Group]]:
  """The ``generate_fn`` of ``DynamicSampler``: rollout, decode, score, group (spec 5).

  ``records`` is the whole generation batch (``global_batches``), the same on every process;
  so are the groups returned.
  """

  def generate(records: list[MathRecord]) -> list[Group]:
    prompt_ids, prompt_mask = render_batch(records, tokenizer, max_prompt_length)
    out = _rollout_chunks(rollout, prompt_ids, prompt_mask, key_fn(), num_samples,
                          prompts_per_call)
    resp, lengths = out["response_ids"], out["lengths"]
    texts = decode_responses(tokenizer, resp, lengths, eos_ids)
    gts = [r.ground_truth for r in records for _ in range(num_samples)]
    rewards = score_spread(scorer, texts, gts, lengths)
    response_mask, logprobs, truncated = out["response_mask"], out["logprobs"], out["truncated"]
    groups = []
    g = num_samples
    for i, rec in enumerate(records):
      sl = slice(i * g, (i + 1) * g)
      payload = dict(
          prompt_ids=np.repeat(prompt_ids[i:i + 1], g, axis=0),
          prompt_mask=np.repeat(prompt_mask[i:i + 1], g, axis=0).astype(bool),
          response_ids=resp[sl], response_mask=response_mask[sl].astype(bool),
          logprobs=logprobs[sl].astype(np.float32), lengths=lengths[sl],
          truncated=truncated[sl].astype(bool), texts=texts[sl],
          score=rewards.score[sl], penalty=rewards.overlong_penalty[sl],
          num_errors=rewards.num_errors if i == 0 else 0,
          num_timeouts=rewards.num_timeouts if i == 0 else 0)
      groups.append(Group(prompt=rec, acc=rewards.acc[sl], reward=rewards.reward[sl],
                          payload=payload))
    return groups

  return generate


def groups_to_trajectories(groups: Sequence[Group]) -> Trajectories:
  """Concatenates groups (prompt-major) into the arrays the train step reads."""
  if not groups:
    raise ValueError("No groups to train on.")
  p = [grp.payload for grp in groups]
  cat = lambda k: np.concatenate([x[k] for x in p], axis=0)
  prompt_ids, prompt_mask = cat("prompt_ids"), cat("prompt_mask")
  response_ids, response_mask = cat("response_ids"), cat("response_mask")
  group_ids = np.concatenate([np.full(grp.size, i, np.int32) for i, grp in enumerate(groups)])
  return Trajectories(
      input_ids=np.concatenate([prompt_ids, response_ids], axis=1).astype(np.int32),
      attention_mask=np.concatenate([prompt_mask, response_mask], axis=1),
      response_mask=response_mask, sampler_logprobs=cat("logprobs"), lengths=cat("lengths"),
      truncated=cat("truncated"), reward=np.concatenate([grp.reward for grp in groups]),
      score=cat("score"), acc=np.concatenate([grp.acc for grp in groups]),
      overlong_penalty=cat("penalty"), group_ids=group_ids,
      texts=[t for x in p for t in x["texts"]], prompts=[grp.prompt.prompt for grp in groups])


def compute_advantages(traj: Trajectories, norm_adv_by_std: bool = True) -> np.ndarray:
  """GRPO outcome advantages from the shaped rewards (spec 3), one per row."""
  num_groups = int(traj.group_ids.max()) + 1
  adv = obj.compute_grpo_outcome_advantage(traj.reward, traj.group_ids, num_groups=num_groups,
                                           norm_adv_by_std=norm_adv_by_std)
  return np.asarray(adv, np.float32)


def rollout_metrics(traj: Trajectories, *, max_response_length: int, buffer_len: int
                    ) -> dict[str, float]:
  """Response statistics a DAPO researcher reads every step (spec 2 and 5)."""
  lengths = traj.lengths.astype(np.float32)
  expected = max_response_length - buffer_len
  return {
      "train/reward_mean": float(traj.reward.mean()),
      "train/score_mean": float(traj.score.mean()),
      "train/acc_mean": float(traj.acc.mean()),
      "train/overlong_penalty_mean": float(traj.overlong_penalty.mean()),
      "response/response_length_mean": float(lengths.mean()),
      "response/response_length_max": float(lengths.max()),
      "response/response_length_min": float(lengths.min()),
      "response/in_overlong_buffer": float((lengths > expected).mean()),
      "response/truncated": float(traj.truncated.mean()),
  }


# Carried surplus groups (dynamic sampling's keep_surplus) go into the checkpoint's JSON meta.
_PAYLOAD_DTYPES = {"prompt_ids": np.int32, "prompt_mask": bool, "response_ids": np.int32,
                   "response_mask": bool, "logprobs": np.float32, "lengths": np.int32,
                   "truncated": bool, "score": np.float32, "penalty": np.float32}


def sampler_state_to_json(state: dict[str, Any]) -> dict[str, Any]:
  """``DynamicSampler.state_dict()`` with records and arrays as JSON values."""
  carried = []
  for g in state["carried"]:
    payload = {k: (v.tolist() if isinstance(v, np.ndarray) else v)
               for k, v in g["payload"].items()}
    carried.append({"prompt": dataclasses.asdict(g["prompt"]), "acc": g["acc"].tolist(),
                    "reward": g["reward"].tolist(), "payload": payload})
  return {**state, "carried": carried}


def sampler_state_from_json(state: dict[str, Any]) -> dict[str, Any]:
  """The inverse of `sampler_state_to_json`."""
  carried = []
  for g in state["carried"]:
    payload = {k: (np.asarray(v, _PAYLOAD_DTYPES[k]) if k in _PAYLOAD_DTYPES else v)
               for k, v in g["payload"].items()}
    carried.append({"prompt": MathRecord(**g["prompt"]), "acc": np.asarray(g["acc"], bool),
                    "reward": np.asarray(g["reward"], np.float32), "payload": payload})
  return {**state, "carried": carried}


def rows_on_device(x: np.ndarray, mesh, rules: shd.Rules = shd.TRAIN_RULES) -> jax.Array:
  """A batch-major host array (the same on every process) as the compiled step's input: rows
  over the data axes; on several processes a global array each process fills with its rows."""
  sharding = None if mesh is None else shd.batch_sharding(mesh, rules, x.ndim, x.shape[0])
  return distributed.host_to_global(x, sharding)
