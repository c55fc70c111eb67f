"""The overlap estimate's split, compiled (issue 37, measurement 5): each set's own programs.

`plan_overlap` prices every split of a slice in closed form. For the split a run would use (the
configured ``rollout_devices``, else the recommended one) this compiles what each set holds:

* **the training set** (the first T chips, as `distributed.split_devices` gives them): the train
  step on a mesh of ``fsdp = T / tensor`` with the training ``tensor``, at the micro-batch that
  keeps a chip's rows (``optim.micro_batch_size x T / N``: the estimate's "activations per chip
  kept");
* **the rollout set** (the last R chips): the paged engine's chunk on a rollout mesh of
  ``data = R / tensor``, with the slots and the page pool the estimate gave that set (its chips
  hold the rollout weights and the pool, no training state).

Each set's compiled peak then stands next to the estimate's figure, against the chip's memory.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from dapo_jax.infra import sharding as shd
from dapo_jax.models import Qwen2Config, attention
from dapo_jax.planner import plan_paged
from dapo_jax.planner.programs import (compile_continuous_rollout, compile_train_step, reported,
                                       sampling_params)
from dapo_jax.spec.run_spec import RunSpec

GiB = 1024**3


def chosen_split(oe: dict[str, Any]) -> dict[str, Any] | None:
  """The split row to compile: the configured ``rollout_devices``, else the recommended one."""
  want = oe["configured_rollout_devices"] or oe["recommended"]
  return next((s for s in oe["splits"] if s["rollout_chips"] == want and "slots" in s), None)


def compile_split(spec: RunSpec, mcfg: Qwen2Config, oe: dict[str, Any], target) -> dict[str, Any]:
  """The two sets of `chosen_split` compiled on ``target``'s devices (module docstring)."""
  row = chosen_split(oe)
  if row is None:
    return {"skipped": "no split to compile (none fits, or rollout_devices is not a split)"}
  n, r = target.num_devices, row["rollout_chips"]
  t = n - r
  mb = spec.optim.micro_batch_size
  if mb * t % n:
    return {"skipped": f"optim.micro_batch_size={mb} does not scale to {t} of {n} chips"}
  devices = list(target.devices)
  train_mesh = shd.make_mesh([("data", 1), ("fsdp", -1), ("tensor", oe["train_tensor"])],
                             devices=devices[:t])
  rollout_mesh = shd.make_mesh([("data", -1), ("tensor", oe["rollout_tensor"])],
                               devices=devices[t:])
  tspec = dataclasses.replace(spec, optim=dataclasses.replace(spec.optim,
                                                              micro_batch_size=mb * t // n))
  rspec = dataclasses.replace(
      spec, rollout_mesh=(("data", -1), ("tensor", oe["rollout_tensor"])),
      rollout=dataclasses.replace(spec.rollout, max_concurrent_decodes=row["slots"]))
  shards = math.prod(shd.batch_axes(rollout_mesh, shd.SAMPLE_RULES).values())
  paged = plan_paged.engine_spec(rspec, mcfg, target.kind, oe["rollout_tensor"], shards,
                                 target.hbm_bytes, int(row["rollout_weights_bytes"]))
  out: dict[str, Any] = {"rollout_chips": r, "train_chips": t,
                         "train_micro_batch_size": mb * t // n, "slots": row["slots"],
                         "estimate": {"train": row["train_bytes"],
                                      "rollout": row["rollout_bytes"]}}
  with attention.compile_for(target.kind):
    out["train"] = reported(compile_train_step, tspec, mcfg, train_mesh)
    if paged is None:
      out["rollout"] = {"error": "the configured rollout uses no paged cache"}
    else:
      out["rollout"] = reported(compile_continuous_rollout, rspec, mcfg, rollout_mesh,
                                 sampling_params(spec.rollout, mcfg),
                                 dataclasses.replace(paged, num_pages=row["pool_pages"]))
  for side in ("train", "rollout"):
    prog = out[side]
    out[f"{side}_fits"] = ("peak" in prog and "oom" not in prog and "refused" not in prog
                           and prog["peak"] <= target.hbm_bytes)
  return out


def format_lines(cs: dict[str, Any], hbm_bytes: int) -> list[str]:
  """The ``compiled split`` lines under dapo-plan's overlap block."""
  if "skipped" in cs:
    return [f"    compiled split: skipped ({cs['skipped']})"]
  g = lambda b: f"{b / GiB:.2f}"

  def side(name: str, prog: dict[str, Any], estimate: float, fits: bool, what: str) -> str:
    if "error" in prog:
      return f"{name}: not compiled ({prog['error'][:200]})"
    if "oom" in prog:
      return f"{name}: compiler OOM (the estimate {g(estimate)} GiB)"
    if "refused" in prog:
      return f"{name}: refused by the compiler ({prog['refused']['what'][:200]})"
    parts = ", ".join(f"{k} {g(v)}" for k, v in prog["parts"].items() if v >= GiB / 200)
    return (f"{name} {g(prog['peak'])} GiB/chip ({parts}; {what}; the estimate {g(estimate)}): "
            + ("fits" if fits else f"DOES NOT FIT in {g(hbm_bytes)}"))

  return [f"    compiled split R={cs['rollout_chips']} T={cs['train_chips']}: "
          + side("rollout set", cs["rollout"], cs["estimate"]["rollout"], cs["rollout_fits"],
                 f"{cs['slots']} slots")
          + "; "
          + side("training set", cs["train"], cs["estimate"]["train"], cs["train_fits"],
                 f"micro-batch {cs['train_micro_batch_size']}")]
