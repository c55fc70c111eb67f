"""The typed experience of one step: scored groups -> trajectories -> compiled-step mini-batches.

``ScoredGroup`` is what dynamic sampling keeps (one prompt's G responses with their tokens and
rewards); the trained groups concatenate into ``Trajectories`` (host rows, prompt-major), whose
slices go to the device as ``TrainBatch``es. Advantages (spec 3) and the response statistics
logged every step (spec 2 and 5) are computed on the trajectories.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from dapo_jax.infra import distributed
from dapo_jax.trainer import objective as obj
from dapo_jax.trainer import packing
from dapo_jax.data.records import MathRecord
from dapo_jax.trainer.dynamic_sampling import Group
from dapo_jax.trainer.train_step import TrainBatch

# The arrays of a ScoredGroup and their dtypes (a checkpoint's JSON meta stores them as lists).
_ARRAY_DTYPES = {"prompt_ids": np.int32, "prompt_mask": bool, "response_ids": np.int32,
                 "response_mask": bool, "logprobs": np.float32, "lengths": np.int32,
                 "truncated": bool, "score": np.float32, "penalty": np.float32,
                 "token_versions": np.int32}


@dataclasses.dataclass
class ScoredGroup(Group):
  """One prompt's G responses (P prompt and R response columns) as the rollout scored them.

  ``acc`` and ``reward`` ([G], from ``Group``) are what dynamic sampling reads; the rest is
  what the update reads. ``num_errors``/``num_timeouts`` are the verifier's counts of one
  scoring call (a poll of the step's rollout stream), held by its first group (0 in the others).
  """
  prompt: MathRecord
  prompt_ids: np.ndarray  # [G, P] int32, left-padded
  prompt_mask: np.ndarray  # [G, P] bool
  response_ids: np.ndarray  # [G, R] int32
  response_mask: np.ndarray  # [G, R] bool
  logprobs: np.ndarray  # [G, R] float32, the sampler's
  lengths: np.ndarray  # [G] int32
  truncated: np.ndarray  # [G] bool
  texts: list[str]
  score: np.ndarray  # [G] float32
  penalty: np.ndarray  # [G] float32, the overlong penalty (spec 2)
  num_errors: int = 0
  num_timeouts: int = 0
  # The rollout step whose policy sampled the group (-1: not stamped yet); a group carried over
  # by keep_surplus trains at a later step, off-policy (spec 6.2).
  sampled_at_step: int = -1
  # The policy version (the RL step whose starting weights sampled it; -1: not stamped, or a
  # checkpoint older than the field, read as ``sampled_at_step``). Equal to ``sampled_at_step``
  # in a synchronous run; up to algorithm.max_staleness lower in an overlapped one.
  policy_version: int = -1
  # [G, R] int32: each token's policy version when the weights changed while the group was
  # decoded (algorithm.partial_rollouts; -1 where masked); None: all ``policy_version``'s.
  token_versions: np.ndarray | None = None

  def to_json(self) -> dict[str, Any]:
    """JSON values, in the layout of the checkpoints' ``sampler.carried`` entries."""
    payload = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("prompt", "acc", "reward")}
    return {"prompt": dataclasses.asdict(self.prompt), "acc": self.acc.tolist(),
            "reward": self.reward.tolist(),
            "payload": {k: (v.tolist() if isinstance(v, np.ndarray) else v)
                        for k, v in payload.items()}}

  @classmethod
  def from_json(cls, d: dict[str, Any]) -> ScoredGroup:
    """The inverse of ``to_json``."""
    payload = {k: (np.asarray(v, _ARRAY_DTYPES[k]) if k in _ARRAY_DTYPES and v is not None
                   else v) for k, v in d["payload"].items()}
    return cls(prompt=MathRecord(**d["prompt"]), acc=np.asarray(d["acc"], bool),
               reward=np.asarray(d["reward"], np.float32), **payload)


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
  sampled_at_step: np.ndarray | None = None  # [N] int32, the group's `sampled_at_step`
  policy_version: np.ndarray | None = None  # [N] int32, the group's `policy_version`
  token_version: np.ndarray | None = None  # [N, R] int32, each token's (`token_versions`)
  verifier_errors: int = 0  # summed over the groups
  verifier_timeouts: int = 0

  @property
  def num_rows(self) -> int:
    return int(self.input_ids.shape[0])

  @property
  def response_len(self) -> int:
    return int(self.response_mask.shape[1])

  @classmethod
  def from_groups(cls, groups: Sequence[ScoredGroup]) -> Trajectories:
    """Concatenates groups (prompt-major) into the arrays the train step reads."""
    if not groups:
      raise ValueError("No groups to train on.")
    cat = lambda k: np.concatenate([getattr(g, k) for g in groups], axis=0)
    response_ids, response_mask = cat("response_ids"), cat("response_mask")
    group_ids = np.concatenate([np.full(g.size, i, np.int32) for i, g in enumerate(groups)])
    return cls(
        input_ids=np.concatenate([cat("prompt_ids"), response_ids], axis=1).astype(np.int32),
        attention_mask=np.concatenate([cat("prompt_mask"), response_mask], axis=1),
        response_mask=response_mask, sampler_logprobs=cat("logprobs"), lengths=cat("lengths"),
        truncated=cat("truncated"), reward=cat("reward"), score=cat("score"), acc=cat("acc"),
        overlong_penalty=cat("penalty"), group_ids=group_ids,
        sampled_at_step=np.concatenate(
            [np.full(g.size, g.sampled_at_step, np.int32) for g in groups]),
        policy_version=np.concatenate(
            [np.full(g.size, policy_version(g), np.int32) for g in groups]),
        token_version=np.concatenate(
            [np.full(g.response_ids.shape, policy_version(g), np.int32)
             if g.token_versions is None else g.token_versions for g in groups]),
        texts=[t for g in groups for t in g.texts], prompts=[g.prompt.prompt for g in groups],
        verifier_errors=sum(g.num_errors for g in groups),
        verifier_timeouts=sum(g.num_timeouts for g in groups))

  def carried_rows(self, step: int) -> np.ndarray:
    """[N] bool: rows sampled before rollout step ``step`` (keep_surplus's carried groups)."""
    if self.sampled_at_step is None:
      return np.zeros(self.num_rows, bool)
    return self.sampled_at_step < step


def stamp_sampled_at(groups: Sequence[ScoredGroup], step: int, version: int | None = None
                     ) -> None:
  """Marks the groups no step has claimed yet (those this step generated, trained or carried)
  as sampled for step ``step`` by policy ``version`` (default: ``step``'s own, the synchronous
  step). Groups of a checkpoint older than the field count as this step's, as they did before
  it existed."""
  for g in groups:
    if g.sampled_at_step < 0:
      g.sampled_at_step = step
      g.policy_version = step if version is None else version
      if g.token_versions is not None:  # partial rollouts: the oldest of its tokens
        live = g.token_versions[g.response_mask]
        g.policy_version = int(live.min()) if live.size else g.policy_version


def policy_version(g: ScoredGroup) -> int:
  """The version of the policy that sampled ``g`` (a group stamped before the field existed:
  its step's)."""
  return g.policy_version if g.policy_version >= 0 else g.sampled_at_step


def staleness_metrics(traj: Trajectories, step: int, max_staleness: int) -> dict[str, float]:
  """How many policy versions the trained tokens lag the update at ``step``: the mean, the
  maximum and the share of response tokens at each lag 0..``max_staleness``."""
  mask_NxR = traj.response_mask.astype(bool)
  versions = (traj.token_version if traj.token_version is not None
              else np.broadcast_to(traj.policy_version[:, None], mask_NxR.shape))
  lag = (step - versions)[mask_NxR]
  total = max(lag.size, 1)
  out = {"staleness/mean": float(lag.sum() / total),
         "staleness/max": float(lag.max(initial=0))}
  for k in range(max_staleness + 1):
    out[f"staleness/tokens_at_{k}"] = float((lag == k).sum() / total)
  return out


def behaviour_log_probs(traj: Trajectories, recomputed: np.ndarray, step: int) -> np.ndarray:
  """Old log-probs (spec 6.2): the training forward's on this step's own samples, the sampler's
  on carried groups, whose behaviour policy was an earlier step's (recomputing them with the
  current weights would start their ratio at 1 and hide the off-policy gap)."""
  carried = traj.carried_rows(step)
  if not carried.any():
    return recomputed
  return np.where(carried[:, None], traj.sampler_logprobs, recomputed).astype(np.float32)


def compute_advantages(traj: Trajectories, norm_adv_by_std: bool = True) -> np.ndarray:
  """GRPO outcome advantages from the shaped rewards (spec 3), one per row."""
  num_groups = int(traj.group_ids.max()) + 1
  adv = obj.compute_grpo_outcome_advantage(traj.reward, traj.group_ids, num_groups=num_groups,
                                           norm_adv_by_std=norm_adv_by_std)
  return np.asarray(adv, np.float32)


def mini_batches(traj: Trajectories, adv: np.ndarray, old_logp: np.ndarray,
                 rows_per_update: int, mesh: Mesh | None, ref_logp: np.ndarray | None = None,
                 with_sampler_logp: bool = False,
                 layouts: Sequence[packing.PackLayout] | None = None) -> Iterator[TrainBatch]:
  """Host rows -> device mini-batches (global arrays on several processes); ``ref_logp``: the
  KL reference's log-probs (use_kl_loss); ``with_sampler_logp``: the batches carry the
  sampler's log-probs (a rollout correction is on; otherwise the program does not take them).
  On carried rows (keep_surplus) ``old_logp`` already is the sampler's, so their weight is 1.
  ``layouts`` (optim.packing, `packing.layouts`): each mini-batch packed as its layout says."""
  dev = lambda x: distributed.rows_on_device(x, mesh)
  for i, s in enumerate(range(0, traj.num_rows, rows_per_update)):
    sl = slice(s, s + rows_per_update)
    if layouts is not None:
      yield packed_batch(layouts[i], traj, sl, adv, old_logp, mesh, ref_logp, with_sampler_logp)
      continue
    yield TrainBatch(
        input_ids=dev(traj.input_ids[sl]), attention_mask=dev(traj.attention_mask[sl]),
        response_mask=dev(traj.response_mask[sl]), old_log_probs=dev(old_logp[sl]),
        advantages=dev(adv[sl]), truncated=dev(traj.truncated[sl]),
        ref_log_probs=None if ref_logp is None else dev(ref_logp[sl]),
        sampler_log_probs=dev(traj.sampler_logprobs[sl]) if with_sampler_logp else None)


def packed_batch(layout: packing.PackLayout, traj: Trajectories, sl: slice, adv: np.ndarray,
                 old_logp: np.ndarray, mesh: Mesh | None, ref_logp: np.ndarray | None = None,
                 with_sampler_logp: bool = False) -> TrainBatch:
  """The mini-batch ``sl`` of ``traj`` as a packed TrainBatch (`packing`): its tokens in the
  layout's packed rows, its per-token inputs in the layout's sequence slots."""
  dev = lambda x: distributed.rows_on_device(x, mesh)
  slots = lambda x, fill=0: dev(layout.to_slots(x[sl], fill))
  rows = packing.packed_rows(layout, traj.input_ids[sl], traj.attention_mask[sl],
                             traj.response_len)
  return TrainBatch(
      input_ids=None, attention_mask=None, response_mask=slots(traj.response_mask, False),
      old_log_probs=slots(old_logp), advantages=slots(adv), truncated=slots(traj.truncated, False),
      ref_log_probs=None if ref_logp is None else slots(ref_logp),
      sampler_log_probs=slots(traj.sampler_logprobs) if with_sampler_logp else None,
      packed=jax.tree.map(dev, rows))


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
