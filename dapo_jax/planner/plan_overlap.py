r"""The overlapped step's price (``dapo-plan``'s ``overlap ESTIMATE``; issue 37, measurement 5).

With ``algorithm.max_staleness >= 1`` and ``rollout_devices = R`` the last R chips of a slice
of N only roll out and the other T = N - R only train (docs/overlap.md). For every split R that
tiles, this prices one RL step of the overlapped run (k = 1) next to the serial step on the same
basis, in closed form:

* **Rollout on R chips**: `plan_paged.estimate` with ``num_devices = R`` on a rollout mesh of
  ``data = R / tensor`` and the config's rollout ``tensor`` (a split it cannot tile is refused);
  the chips hold only the rollout weights besides the KV (no training state): a bigger pool,
  more slots. The paged engine at the fastest of: the slots that fit its pool, the configured
  slots (where they fit), the fewest slots that reach the floor of ``max_response_length``
  steps. The serial step's rollout is the same closed form on all N
  chips with the training state resident (dapo-plan's ``paged_estimate``). Memory: rollout
  weights + page pool (the pool is the engine's ``kv_hbm_fraction`` of what is left;
  temporaries not counted).
* **Training on T chips**: old log-probs + updates at N chips, times N / T (compute bound: the
  same FLOPs on fewer chips). The training mesh at T is ``fsdp = T / tensor`` with the training
  ``tensor``: the training state and the gradient buffers (fp32 + a copy in the model's dtype)
  scale as (state shards at N) / T; a chip keeps its trajectories per micro-batch (more
  micro-batches), so its activations do not change. A split whose training set does not fit
  is not recommended.
* **Hand-off**: the rollout weights cross from the training set to the rollout set once per
  step: each rollout chip receives its shard, each training chip sends R / T of one, at the
  chip's one-way interconnect bandwidth (``INTERCONNECT``; bisection and hops not counted).
* **Bubble**: a periodic checkpoint (every ``checkpoint.save_every`` steps) is a sync point, its
  step runs serially; averaged, a step costs ``max(r, t) + min(r, t) / save_every + hand-off``.
* **Training seconds at N** are the plan's compiled roofline (``plan["estimate"]``) where there
  is one; else a closed form on the same basis: the FLOPs the chips run (`step_flops` with the
  attention at its causal half, as the splash kernel computes it, and the rematerialised
  forward) at peak. The update is priced also at a published MFU (``PUBLISHED_MFU``).

Phases that scale as 1 / chips cannot beat the serial step on any split (the balance point
R* = N r / (r + t) only ties it); a split gains where the rollout set's larger pool runs more
slots per chip, and loses to the split's granularity and the bubble.

The recommended split is the R (a multiple of the rollout mesh's tensor size and of the chips
per host) with the shortest overlapped step among those whose two sets fit.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from dapo_jax.models import Qwen2Config, lora
from dapo_jax.planner import plan_estimates as est
from dapo_jax.planner import plan_paged
from dapo_jax.planner import plan_split
from dapo_jax.planner import targets
from dapo_jax.spec.run_spec import RunSpec

GiB = 1024**3

# One-way interconnect bandwidth per chip the weight hand-off crosses (bytes/s): ICI within a
# TPU slice; between GPU nodes (a split takes whole nodes), one InfiniBand rail per GPU.
_ICI = "cloud.google.com/tpu/docs/{}: inter-chip interconnect {} Gbps per chip, one direction"
INTERCONNECT = {
    "v5p": (600e9, _ICI.format("v5p", "4,800") + " (1,200 GBps bidirectional)"),
    "v4": (300e9, _ICI.format("v4", "2,400")),
    "v5e": (200e9, _ICI.format("v5e", "1,600")),
    "v5litepod": (200e9, _ICI.format("v5e", "1,600")),
    "v6e": (448e9, _ICI.format("v6e", "3,584")),
    "a100": (25e9, "DGX A100: one 200 Gb/s HDR InfiniBand rail per GPU"),
    "a100-40g": (25e9, "DGX A100: one 200 Gb/s HDR InfiniBand rail per GPU"),
    "h100": (50e9, "DGX H100: one 400 Gb/s NDR InfiniBand rail (ConnectX-7) per GPU"),
    "h200": (50e9, "DGX H200: one 400 Gb/s NDR InfiniBand rail (ConnectX-7) per GPU"),
    "b200": (50e9, "DGX B200: one 400 Gb/s NDR InfiniBand rail (ConnectX-7) per GPU"),
}
# Published MFU of dense-model training on the chip (the update priced at it, besides the
# roofline). MaxText's tables: the smallest dense model they list on the chip.
_MAXTEXT = "MaxText README, Runtime Performance Results (github.com/AI-Hypercomputer/maxtext)"
PUBLISHED_MFU = {
    "v5p": (0.7147, f"{_MAXTEXT}, TPU v5p: 32B on v5p-128, 328 TFLOP/s/chip, 71.47% MFU"),
    "v5e": (0.6686, "MaxText/configs/v5e/README.md: 32B on 1x v5e-256, 132 TFLOP/s/chip, "
                    "66.86% MFU"),
}
PUBLISHED_MFU["v5litepod"] = PUBLISHED_MFU["v5e"]
TPU_CHIPS_PER_HOST = 4
STALENESS = 1  # the step is priced at k = 1: step t+1's rollout under step t's training


def avg_step(rollout_s: float, train_s: float, handoff_s: float, save_every: int) -> float:
  """Mean seconds of an overlapped step: the longer phase, the hand-off, and the serial step
  at each checkpoint sync point (one in ``save_every``: the shorter phase once more)."""
  bubble = min(rollout_s, train_s) / save_every if save_every > 0 else 0.0
  return max(rollout_s, train_s) + bubble + handoff_s


def handoff_seconds(weight_bytes: float, rollout_chips: int, train_chips: int,
                    bandwidth: float | None) -> float:
  """The rollout weights' move: each rollout chip receives ``weight_bytes`` (its shard), each
  training chip sends ``R / T`` of that, at ``bandwidth`` per chip one way (0: not priced)."""
  if not bandwidth:
    return 0.0
  return max(weight_bytes, weight_bytes * rollout_chips / train_chips) / bandwidth


def training_seconds(spec: RunSpec, mcfg: Qwen2Config, chip: est.Chip, num_devices: int,
                     plan: dict[str, Any] | None = None) -> dict[str, Any]:
  """Old log-probs and updates at ``num_devices`` chips: the plan's compiled roofline
  (``plan["estimate"]``) where it has both phases, else the closed form (the FLOPs the chips
  run at peak: attention at its causal half, the rematerialised forward counted)."""
  phases = (plan or {}).get("estimate", {}).get("phases", {})
  f = est.step_flops(spec, mcfg, (plan or {}).get("packing"))
  if "update" in phases and ("old_logprob" in phases or not f["logprob"]):
    return {"basis": "compiled roofline (plan estimate)",
            "old_logprob": phases.get("old_logprob", {}).get("seconds", 0.0),
            "update": phases["update"]["seconds"]}
  half = f["attention_full_square"] / 2  # packed: the executed attention, nothing to halve
  remat = 1 if spec.model.remat != "none" else 0
  logprob = max(f["logprob"] - half, 0.0) if f["logprob"] else 0.0
  update = f["train"] - half * (3 + remat) * spec.optim.ppo_epochs
  peak = num_devices * chip.flops_per_s
  return {"basis": "closed form: executed FLOPs at peak (causal attention, remat forward)",
          "old_logprob": logprob / peak, "update": update / peak}


def _train_bytes(spec: RunSpec, mcfg: Qwen2Config, plan: dict[str, Any]) -> dict[str, float]:
  """The training set's per-chip bytes at the plan's N: state, gradient buffers, the rest."""
  train = plan["train"]
  if "peak" not in train or "state_bytes" not in train:
    train = est.analytic_memory(spec, mcfg, plan["num_devices"],
                                spec.train_config().master_dtype, plan.get("packing"))["train"]
  sizes = est.mesh_sizes(spec.mesh, plan["num_devices"])
  shards = sizes.get("fsdp", 1) * sizes.get("tensor", 1)
  n_adapter, _ = est.adapter_sizes(mcfg, lora.LoRAConfig.from_config(spec.model.lora))
  trained = n_adapter or mcfg.num_params()
  grads = trained * (4 + np.dtype(mcfg.param_dtype).itemsize) / shards
  state = train["state_bytes"]
  return {"state": state, "grads": grads, "rest": max(train["peak"] - state - grads, 0.0),
          "shards": shards}


def _rollout_weight_bytes(mcfg: Qwen2Config, tensor: int) -> float:
  """The rollout weights on a chip (the model's dtype over ``tensor``)."""
  item = np.dtype(mcfg.dtype).itemsize
  return mcfg.num_params() * item / tensor


def _handoff_bytes(spec: RunSpec, mcfg: Qwen2Config, tensor: int) -> float:
  """What moves per rollout chip: its shard of the weights (LoRA: of the adapters only)."""
  n_adapter, _ = est.adapter_sizes(mcfg, lora.LoRAConfig.from_config(spec.model.lora))
  n = n_adapter or mcfg.num_params()
  return n * np.dtype(mcfg.dtype).itemsize / tensor


def _rollout(pe: dict[str, Any], mcfg: Qwen2Config, chip: est.Chip, budget: int
             ) -> dict[str, Any] | None:
  """The fastest of the paged engine at the slots that fit its pool, at the configured slots
  (where they fit), and at the fewest slots that reach the floor of ``max_response_length``
  steps (past it more slots only read more KV a step); None: the pool holds no full sample."""
  if "paged_fit" not in pe:
    return None
  shards, fit = pe["data_shards"], pe["slots_fit_per_shard"]
  options = [pe["paged_fit"]]
  if pe["paged_configured"]["slots"] // shards <= fit:
    options.append(pe["paged_configured"])
  u, mean = pe["utilization"], pe["mix"]["mean_response"]
  need = math.ceil(pe["requests"] * mean / (budget * u * shards))
  if need < fit:
    live = pe["prompt_tokens"] + pe["mix"]["live_response_per_busy_slot"]
    cost = plan_paged.decode_step(mcfg, pe["tensor"], need, u * need, live)
    options.append(plan_paged.rollout(cost, chip, pe["requests"], mean, need * shards, budget,
                                      u))
  return min(options, key=lambda x: x["seconds"])


def estimate(spec: RunSpec, mcfg: Qwen2Config, plan: dict[str, Any], chip: est.Chip,
             generation: str, num_devices: int, hbm_bytes: int, chips_per_host: int
             ) -> dict[str, Any]:
  """The overlap estimate (see the module's doc) for every split of ``num_devices`` chips, the
  serial step on the same basis, and the recommended split. ``plan``: dapo-plan's, with its
  training memory (``train``), rollout weights and ``paged_estimate`` (the serial rollout)."""
  n = num_devices
  train_tp = est.mesh_sizes(spec.mesh, n).get("tensor", 1)
  roll_tp = est.mesh_sizes(spec.rollout_mesh or spec.mesh, n).get("tensor", 1)
  bw, bw_source = INTERCONNECT.get(generation, (None, "no interconnect figure: not priced"))
  mfu_pub, mfu_source = PUBLISHED_MFU.get(generation, (None, None))
  save_every = spec.checkpoint.save_every
  tr = training_seconds(spec, mcfg, chip, n, plan)
  model_flops = est.step_flops(spec, mcfg, plan.get("packing"))["update_model"]
  update_pub = model_flops / (mfu_pub * n * chip.flops_per_s) if mfu_pub else None
  budget = spec.rollout.max_response_length
  best_n = _rollout(plan["paged_estimate"], mcfg, chip, budget)
  serial_r = (plan["paged_estimate"]["paged_configured"] if best_n is None else best_n)["seconds"]
  t_n = tr["old_logprob"] + tr["update"]
  t_n_pub = None if update_pub is None else tr["old_logprob"] + update_pub
  serial = {"rollout_slots": None if best_n is None else best_n["slots"],
            "rollout": serial_r, "training": t_n,
            "step": None if serial_r is None else serial_r + t_n,
            "step_published_mfu": (None if serial_r is None or t_n_pub is None
                                   else serial_r + t_n_pub)}
  mem = _train_bytes(spec, mcfg, plan)
  weights = _rollout_weight_bytes(mcfg, roll_tp)
  moved = _handoff_bytes(spec, mcfg, roll_tp)
  step = math.lcm(roll_tp, chips_per_host)
  candidates = sorted(set(range(step, n, step)) | ({spec.rollout_devices}
                                                    if 0 < spec.rollout_devices < n else set()))
  splits = []
  for r in candidates:
    t = n - r
    row: dict[str, Any] = {"rollout_chips": r, "train_chips": t,
                           "configured": r == spec.rollout_devices}
    refused = []
    if r % roll_tp:
      refused.append(f"{r} rollout chips do not tile rollout tensor={roll_tp}")
    if r % chips_per_host:
      refused.append(f"{r} rollout chips are not whole hosts of {chips_per_host}")
    if t % train_tp:
      refused.append(f"{t} training chips do not tile training tensor={train_tp}")
    if refused:
      splits.append(row | {"refused": "; ".join(refused)})
      continue
    rspec = dataclasses.replace(spec, rollout_mesh=(("data", -1), ("tensor", roll_tp)))
    pe = plan_paged.estimate(rspec, mcfg, chip, r, hbm_bytes, int(weights))
    best_r = _rollout(pe, mcfg, chip, budget)
    rs = None if best_r is None else best_r["seconds"]
    scale = mem["shards"] / t
    train_bytes = (mem["state"] + mem["grads"]) * scale + mem["rest"]
    row |= {"rollout_bytes": weights + pe["pool_bytes"], "rollout_weights_bytes": weights,
            "pool_bytes": pe["pool_bytes"], "pool_pages": pe["pool_pages"],
            "slots": best_r["slots"] if rs is not None else 0,
            "train_state_bytes": mem["state"] * scale, "train_bytes": train_bytes,
            "rollout_fits": rs is not None and weights + pe["pool_bytes"] <= hbm_bytes,
            "train_fits": train_bytes <= hbm_bytes}
    row["fits"] = row["rollout_fits"] and row["train_fits"]
    if rs is not None:
      train_s = t_n * n / t
      handoff = handoff_seconds(moved, r, t, bw)
      row |= {"rollout": rs, "training": train_s, "handoff": handoff,
              "bubble": min(rs, train_s) / save_every if save_every > 0 else 0.0,
              "step": avg_step(rs, train_s, handoff, save_every),
              "bound": "rollout" if rs >= train_s else "training"}
      if t_n_pub is not None:
        row["training_published_mfu"] = t_n_pub * n / t
        row["step_published_mfu"] = avg_step(rs, t_n_pub * n / t, handoff, save_every)
    splits.append(row)

  def best(key):
    ok = [s for s in splits if s.get("fits") and key in s]
    return min(ok, key=lambda s: s[key])["rollout_chips"] if ok else None

  # Phases that scale as 1/chips cannot beat the serial step on any split: the best fractional
  # split R* = N r / (r + t) gives max(r N / R*, t N / (N - R*)) = r + t.
  balance = None if serial_r is None else n * serial_r / (serial_r + t_n)
  roofline_mfu = est.mfu(model_flops, tr["update"], chip, n)
  return {"staleness": STALENESS, "save_every": save_every, "num_devices": n,
          "chips_per_host": chips_per_host, "split_step": step, "hbm_bytes": hbm_bytes,
          "rollout_tensor": roll_tp, "train_tensor": train_tp,
          "training_basis": tr["basis"], "old_logprob_n": tr["old_logprob"],
          "update_n": tr["update"], "update_mfu": roofline_mfu,
          "update_n_published_mfu": update_pub, "published_mfu": mfu_pub,
          "published_mfu_source": mfu_source, "interconnect_bytes_per_s": bw,
          "interconnect_source": bw_source, "handoff_bytes_per_chip": moved,
          "serial": serial, "balance_rollout_chips": balance, "splits": splits,
          "recommended": best("step"),
          "recommended_published_mfu": best("step_published_mfu"),
          "configured_staleness": spec.algorithm.max_staleness,
          "configured_rollout_devices": spec.rollout_devices}


def for_plan(spec: RunSpec, mcfg: Qwen2Config, plan: dict[str, Any], target) -> dict[str, Any]:
  """`estimate` for dapo-plan's ``target`` (one with datasheet peaks and an HBM size)."""
  generation = target.name.split(":")[0].lower()
  if target.kind == "gpu":
    per_host = int(target.name.rpartition("x")[2]) if "x" in target.name else target.num_devices
  else:
    per_host = min(TPU_CHIPS_PER_HOST, target.num_devices)
  return estimate(spec, mcfg, plan, target.chip, generation, target.num_devices,
                  target.hbm_bytes, per_host)


def _h(s: float | None) -> str:
  if s is None:
    return "-"
  return f"{s / 3600:.2f} h" if s >= 3600 else f"{s:.0f} s"


def format_lines(oe: dict[str, Any]) -> list[str]:
  """dapo-plan's ``overlap ESTIMATE`` block."""
  g = lambda b: f"{b / GiB:.1f}"
  s = oe["serial"]
  pub = oe["published_mfu"]
  lines = [
      f"  overlap ESTIMATE (k={oe['staleness']}: rollout on the last R chips, training on the "
      f"other T; configured max_staleness={oe['configured_staleness']}, "
      f"rollout_devices={oe['configured_rollout_devices']}):",
      f"    basis: rollout = the paged closed form on R chips (rollout weights only besides "
      f"the pool; the fastest of the slots that fit, the configured ones and the fewest that "
      f"reach the response budget's floor of steps); training = old "
      f"log-probs + updates at {oe['num_devices']} chips x N/T (compute bound; "
      f"{oe['training_basis']}); training state and gradients "
      f"x (state shards)/T, activations per chip kept; hand-off = rollout weights "
      f"({g(oe['handoff_bytes_per_chip'])} GiB/chip) at "
      + (f"{oe['interconnect_bytes_per_s'] / 1e9:.0f} GB/s ({oe['interconnect_source']})"
         if oe["interconnect_bytes_per_s"] else oe["interconnect_source"])
      + f"; bubble = min(r, t) / save_every ({oe['save_every']}); splits in steps of "
      f"{oe['split_step']} (rollout tensor {oe['rollout_tensor']}, {oe['chips_per_host']} "
      f"chips/host)",
      f"    at {oe['num_devices']} chips: old log-probs {_h(oe['old_logprob_n'])}, updates "
      f"{_h(oe['update_n'])} (MFU {100 * oe['update_mfu']:.0f}%)"
      + (f", updates at published MFU {100 * pub:.2f}% {_h(oe['update_n_published_mfu'])} "
         f"({oe['published_mfu_source']})" if pub else "")]
  lines.append(f"    serial step on all {oe['num_devices']} chips: rollout {_h(s['rollout'])} "
               f"({s['rollout_slots']} slots) + "
               f"training {_h(s['training'])} = {_h(s['step'])}"
               + (f"; at published MFU {_h(s['step_published_mfu'])}" if pub else ""))
  if oe["balance_rollout_chips"] is not None:
    lines.append(f"    balance point: R* = N r / (r + t) = {oe['balance_rollout_chips']:.1f} "
                 f"chips, where a split of phases that scale as 1/chips equals the serial step (no "
                 f"split beats it; a split gains only where the rollout set's larger pool "
                 f"runs more slots per chip)")
  for x in oe["splits"]:
    head = f"    R={x['rollout_chips']:>3} T={x['train_chips']:>3}"
    if "refused" in x:
      lines.append(f"{head}: refused ({x['refused']})")
      continue
    mem = (f"rollout set {g(x['rollout_weights_bytes'])} weights + {g(x['pool_bytes'])} pool "
           f"GiB/chip ({x['slots']} slots), training set {g(x['train_bytes'])} GiB/chip "
           f"(state {g(x['train_state_bytes'])})"
           + ("" if x["train_fits"] else " DOES NOT FIT")
           + ("" if x["rollout_fits"] else "; rollout pool holds no full sample"))
    if "step" not in x:
      lines.append(f"{head}: {mem}")
      continue
    mark = " <- recommended" if x["rollout_chips"] == oe["recommended"] else ""
    lines.append(f"{head}: rollout {_h(x['rollout'])}, training {_h(x['training'])}, hand-off "
                 f"{1e3 * x['handoff']:.0f} ms, bubble {_h(x['bubble'])}: step {_h(x['step'])} "
                 f"({x['bound']} bound)"
                 + (f"; at published MFU {_h(x['step_published_mfu'])}" if pub else "")
                 + f"{mark}; {mem}")
  rec = oe["recommended"]
  if rec is None:
    lines.append("    no split fits: overlap is not recommended on this slice")
  else:
    x = next(v for v in oe["splits"] if v["rollout_chips"] == rec)
    verdict = (f"    recommended: rollout_devices={rec} with max_staleness >= 1: "
               f"{_h(x['step'])} per step against {_h(s['step'])} serial")
    if s["step"]:
      verdict += (f" ({s['step'] / x['step']:.2f}x"
                  + ("; overlap does not pay here, keep max_staleness=0)" if x["step"] >= s["step"]
                     else ")"))
    if pub and oe["recommended_published_mfu"] is not None:
      y = next(v for v in oe["splits"] if v["rollout_chips"] == oe["recommended_published_mfu"])
      verdict += (f"; at published MFU rollout_devices={y['rollout_chips']}: "
                  f"{_h(y['step_published_mfu'])} against {_h(s['step_published_mfu'])}")
    lines.append(verdict)
  if "compiled_split" in oe:
    lines += plan_split.format_lines(oe["compiled_split"], oe["hbm_bytes"])
  return lines


def analytic_target(target: str, parse=targets.parse_target) -> targets.Target:
  """dapo-plan's target; a TPU slice on a host where libtpu cannot describe it (libtpu not
  installed) becomes the same slice as an analytic target, as a GPU target without the CUDA
  plugin does: memory from `analytic_memory`, no compiles, the closed-form estimates."""
  try:
    return parse(target)
  except RuntimeError as err:
    kind, _, rest = target.partition(":")
    if kind != "tpu":
      raise
    gen, _, topo = rest.partition(":")
    chips = math.prod(int(x) for x in topo.split("x"))
    cause = str(err.__cause__ or err).split(";")[0].split(". ")[0][:80]
    why = (f"libtpu cannot describe {rest} here: {cause}; "
           "pip install 'jax[tpu]' for the compiled plan")
    return targets.Target("tpu", rest, chips, int(est.TPU_HBM_GIB[gen.lower()] * GiB), None, why)
