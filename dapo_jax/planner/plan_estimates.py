"""Closed-form sizes behind ``dapo-plan``: device capacities, KV cache, FLOPs, the analytic
memory estimate used where no compiler for the target is at hand (GPU clusters), and the
roofline estimate of an RL step's time from per-program costs.

FLOPs count a multiply-add as 2. Attention is counted over the full padded length, as the XLA
attention path computes it (masked scores cost the same as real ones).

One piece: the chip tables and every closed form the plan prints (KV, FLOPs, analytic memory, the
roofline step) share the same per-device sizes, and are checked against the compiled figures
together.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from dapo_jax.models import Qwen2Config, lora
from dapo_jax.rollout.sampler import segment_ends
from dapo_jax.spec.run_spec import RunSpec

# v5p: the 95.74 GiB libtpu reports when it refuses a program; others are the nominal sizes.
TPU_HBM_GIB = {"v4": 32, "v5e": 16, "v5litepod": 16, "v5p": 95.74, "v6e": 32}
# The notebook GPUs too: Colab's T4 (16 GB), L4 (24 GB) and A100 40GB ("a100-40g").
GPU_HBM_GB = {"a100": 80, "h100": 80, "h200": 141, "b200": 180, "t4": 16, "l4": 24,
              "a100-40g": 40}


@dataclasses.dataclass(frozen=True)
class Chip:
  """Datasheet peaks of one chip: dense bf16 matmul FLOP/s and HBM bytes/s."""
  flops_per_s: float
  hbm_bytes_per_s: float
  source: str


_TPU_DOC = "cloud.google.com/tpu/docs/{} (peak bf16 compute, HBM bandwidth per chip)"
CHIPS = {
    "v4": Chip(275e12, 1200e9, _TPU_DOC.format("v4")),
    "v5e": Chip(197e12, 819e9, _TPU_DOC.format("v5e")),
    "v5litepod": Chip(197e12, 819e9, _TPU_DOC.format("v5e")),
    "v5p": Chip(459e12, 2765e9, _TPU_DOC.format("v5p")),
    "v6e": Chip(918e12, 1638e9, _TPU_DOC.format("v6e")),
    # NVIDIA datasheets, SXM parts; dense bf16 (half the "with sparsity" figure).
    "a100": Chip(312e12, 2039e9, "NVIDIA A100 datasheet (80GB SXM)"),
    "h100": Chip(989e12, 3350e9, "NVIDIA H100 datasheet (SXM)"),
    "h200": Chip(989e12, 4800e9, "NVIDIA H200 datasheet (SXM)"),
    "b200": Chip(2250e12, 8000e9, "NVIDIA HGX B200 datasheet (per GPU)"),
    "a100-40g": Chip(312e12, 1555e9, "NVIDIA A100 datasheet (40GB SXM)"),
    "l4": Chip(121e12, 300e9, "NVIDIA L4 datasheet"),
    # Turing has no bf16 tensor cores: a bf16 model's matmuls run at about the FP32 peak.
    "t4": Chip(8.1e12, 320e9, "NVIDIA T4 datasheet (FP32 peak: no bf16 tensor cores)"),
}
# The response-length mix the rollout estimate assumes (issue 16's paper-shaped mix: mean a
# quarter of the budget, ~5% at the limit) and the continuous engine's share of busy slot-steps
# (the goal). The static sampler decodes every call to the budget: with ~5% of the
# responses at the limit, a call of many rows almost surely holds one.
MEAN_RESPONSE_FRACTION = 0.25
SLOT_UTILIZATION = 0.85


@dataclasses.dataclass(frozen=True)
class Cost:
  """Per-device work of a program run: FLOPs and HBM bytes accessed (XLA's cost analysis)."""
  flops: float
  bytes: float

  def __add__(self, other: Cost) -> Cost:
    return Cost(self.flops + other.flops, self.bytes + other.bytes)

  def __mul__(self, times: float) -> Cost:
    return Cost(self.flops * times, self.bytes * times)

  __rmul__ = __mul__

  def seconds(self, chip: Chip) -> float:
    """Roofline time: the larger of compute time at peak and HBM time at full bandwidth."""
    return max(self.flops / chip.flops_per_s, self.bytes / chip.hbm_bytes_per_s)


def interpolate(a: Cost, b: Cost, at_a: float, at_b: float, at: float) -> Cost:
  """The cost at ``at`` of a program linear in one size (a decode step in its cache length),
  from its costs ``a`` at ``at_a`` and ``b`` at ``at_b``."""
  if at_a == at_b:
    return a
  w = (at - at_a) / (at_b - at_a)
  return Cost(a.flops + w * (b.flops - a.flops), a.bytes + w * (b.bytes - a.bytes))


def costs_at_depth(a: Any, b: Any, depths: tuple[int, int], layers: int) -> Any:
  """Merges one compile function's results at two depths (``depths``, e.g. 1 and 2 layers):
  every ``"cost"`` becomes the cost at ``layers`` (linear in the depth), ``compile_seconds`` the
  sum of both compiles, anything else the first result's. Where only the first compiled, the
  second's failure (``"oom"`` / ``"error"``) is kept: no cost at the wrong depth."""
  if not (isinstance(a, dict) and isinstance(b, dict)):
    return a
  if "cost" in a and "cost" not in b:
    return b
  out = {}
  for key, value in a.items():
    if key == "cost":
      out[key] = dataclasses.asdict(interpolate(Cost(**value), Cost(**b[key]), depths[0],
                                                depths[1], layers))
    elif key == "compile_seconds" and key in b:
      out[key] = round(value + b[key], 1)
    else:
      out[key] = costs_at_depth(value, b.get(key), depths, layers)
  return out


def static_decode_steps(max_new_tokens: int, cache_segments: int, prompt_length: int
                        ) -> list[tuple[int, int]]:
  """(decode steps, cache slots) per decode loop of one static-sampler call run to the budget:
  response columns 1 .. R-1, in segments ending at ..., R/4, R/2, R (``Sampler``)."""
  ends = segment_ends(max_new_tokens, cache_segments)
  out, start = [], 1
  for end in ends:
    if end > start:
      out.append((end - start, prompt_length + end - 1))
    start = end
  return out


def _cost(part: dict[str, Any]) -> Cost:
  return Cost(**part["cost"])


def uncounted_flops(spec: RunSpec, mcfg: Qwen2Config, num_devices: int, splash: bool,
                    logit_chunk_size: int, packed: dict[str, Any] | None = None
                    ) -> dict[str, float]:
  """Per-device FLOPs of one run of a program's loop body that XLA's cost analysis misses,
  added by the estimate:

  * the log-prob head's chunks past the first: it is a loop inside the micro-batch loop
    (``logprobs.chunked_token_stats``, ``logit_chunk_size`` positions a chunk), and the cost
    analysis counts a loop body once: (chunks - 1) x chunk x 2 x vocab x hidden per row,
    x4 in the update (forward, the chunk's checkpointed recomputation, backward: the
    activation and the weight gradient), x3 with LoRA (the head is frozen: no weight gradient);
  * with ``splash`` (the Pallas kernel on TPU, opaque to the cost analysis) the attention:
    causal blocks, half the [T, T] scores, forward 2 x heads x head_dim x T^2 per row and
    layer; the update counts it 3x (x4/3 with rematerialisation), as ``step_flops``.

  ``packed`` (`plan_packing.packed_shape`, optim.packing): a micro-batch body is one packed
  micro-batch: the head's chunks run over each packed row's positions, and the packed kernel's
  attention is the query-key pairs of the blocks it computes.
  """
  p, r = spec.data.max_prompt_length, spec.rollout.max_response_length
  per_row_layer = 2.0 * mcfg.num_attention_heads * mcfg.dim_per_head / num_devices
  attention = lambda rows, length: (rows * mcfg.num_hidden_layers * per_row_layer * length
                                    * length if splash else 0.0)
  chunk = logit_chunk_size
  chunks = -(-r // chunk) if 0 < chunk < r else 1
  head = lambda rows: rows * (chunks - 1) * chunk * 2.0 * mcfg.vocab_size * mcfg.hidden_size \
      / num_devices
  micro = min(spec.optim.micro_batch_size, spec.sizes.rows_per_update)
  remat = 4 / 3 if spec.model.remat != "none" else 1.0
  log_rows = spec.sizes.rows_per_step
  log_micro = micro if 0 < micro < log_rows else log_rows
  head_passes = 3 if spec.model.lora.rank > 0 else 4
  if packed is not None:
    rows_micro = packed["packed_rows"] / packed["num_micro"]
    length = packed["budget"]
    chunks = -(-length // chunk) if 0 < chunk < length else 1
    head_p = rows_micro * (chunks - 1) * chunk * 2.0 * mcfg.vocab_size * mcfg.hidden_size \
        / num_devices
    attn_p = (2.0 * per_row_layer * mcfg.num_hidden_layers * packed["attention_pairs"]
              / packed["num_micro"]) if splash else 0.0
    return {"train": 3 * remat * attn_p + head_passes * head_p, "logprob": attn_p + head_p,
            "prefill": attention(spec.sizes.prompts_per_call, p)}
  return {"train": 3 * remat * attention(micro, p + r) + head_passes * head(micro),
          "logprob": attention(log_micro, p + r) + head(log_micro),
          "prefill": attention(spec.sizes.prompts_per_call, p)}


def rl_step_programs(spec: RunSpec, plan: dict[str, Any]
                     ) -> dict[str, list[tuple[str, Cost, float]]]:
  """The compiled programs of one RL step with one generation batch, and how often each runs.

  Rollout (static sampler): per call of ``prompts_per_call`` prompts, one prefill and R - 1
  decode steps of its B*G rows, each step over its loop's cache length (the decode cost is
  linear in it: interpolated between the two compiled lengths). Old log-probs: the forward's
  micro-batch loop body, once per micro-batch. Updates: the train step's micro-batch body
  (with the optimizer, a small overcount) per micro-batch of every update. FLOPs the cost
  analysis misses (``plan["uncounted_flops"]``: nested loops, Pallas kernels) are added.
  A phase whose programs did not compile is left out. Every cost is at the model's depth
  (``plan.COST_DEPTHS``: a scanned decoder's layer loop counts once in the cost analysis, so
  the costs come from shallow unrolled compiles, extrapolated). The continuous engine: one enqueue
  (prefill) per prompt, a chunk-body decode step (admission included) per
  (requests x mean response length) / (slots x utilisation) (``MEAN_RESPONSE_FRACTION``,
  ``SLOT_UTILIZATION``).
  """
  r, p, g = spec.rollout.max_response_length, spec.data.max_prompt_length, spec.rollout.n
  prompts = spec.algorithm.gen_batch_size
  extra = plan.get("uncounted_flops", {})
  plus = lambda cost, name: cost + Cost(extra.get(name, 0.0), 0.0)

  def rollout():
    dec = plan["decode"]
    calls = math.ceil(prompts / dec["prompts_per_call"])
    compiled = sorted((v["cache_length"], _cost(v)) for k, v in dec.items()
                      if k.startswith("decode_step@"))
    (la, ca), (lb, cb) = compiled[0], compiled[-1]
    out = [("prefill", plus(_cost(dec["prefill"]), "prefill"), calls)]
    for steps, length in static_decode_steps(r, dec["cache_segments"], p):
      out.append((f"decode step, cache {length}", interpolate(ca, cb, la, lb, length),
                  calls * steps))
    return out

  def old_logprob():
    return [("forward micro-batch", plus(_cost(plan["logprob"]), "logprob"),
             plan["logprob"]["loop_runs"])]

  def update():
    t = plan["train_cost"]
    return [("train step micro-batch", plus(_cost(t), "train"),
             t["num_micro_batches"] * spec.sizes.updates_per_step)]

  def rollout_continuous():
    cont = plan["continuous"]
    requests = prompts * g
    steps = requests * MEAN_RESPONSE_FRACTION * r / (cont["slots"] * SLOT_UTILIZATION)
    return [("enqueue (prefill)", _cost(cont["enqueue"]), prompts / cont["enqueue_rows"]),
            ("decode step (chunk body)", _cost(cont["decode_chunk"]), steps)]

  builders = {"rollout": rollout, "old_logprob": old_logprob, "update": update,
              "rollout_continuous": rollout_continuous}
  if spec.rollout.use_sampler_logprobs:
    del builders["old_logprob"]
  phases = {}
  for name, build in builders.items():
    try:
      phases[name] = build()
    except (KeyError, IndexError):  # a program it needs did not compile (OOM or an error)
      continue
  return phases


def step_time(phases: dict[str, list[tuple[str, Cost, float]]], chip: Chip
              ) -> dict[str, dict[str, Any]]:
  """Roofline seconds per phase: each phase is a list of (program, cost of one run, runs);
  a program's runs are bound by compute or by HBM bandwidth, whichever is slower."""
  out = {}
  for phase, programs in phases.items():
    parts = {name: {"runs": runs, "flops": cost.flops, "bytes": cost.bytes,
                    "seconds": runs * cost.seconds(chip),
                    "bound": ("compute" if cost.flops / chip.flops_per_s
                              >= cost.bytes / chip.hbm_bytes_per_s else "memory")}
             for name, cost, runs in programs}
    out[phase] = {"seconds": sum(p["seconds"] for p in parts.values()), "programs": parts}
  return out


def step_estimate(spec: RunSpec, plan: dict[str, Any], chip: Chip) -> dict[str, Any]:
  """The roofline estimate of one RL step on ``chip`` from the plan's compiled costs: seconds
  per phase (both rollout engines, old log-probs, updates), the step total with the configured
  engine's rollout (``rollout.engine``), and the implied MFU of the updates."""
  phases = step_time(rl_step_programs(spec, plan), chip)
  engine = "rollout_continuous" if spec.rollout.engine == "continuous" else "rollout"
  other = ({"rollout", "rollout_continuous"} - {engine}).pop()
  needed = [engine, "update"] + ([] if spec.rollout.use_sampler_logprobs else ["old_logprob"])
  missing = [k for k in needed + [other] if k not in phases]
  step = sum(v["seconds"] for k, v in phases.items() if k != other)
  update = phases.get("update", {}).get("seconds", 0.0)
  return {"chip": dataclasses.asdict(chip), "phases": phases, "missing": missing,
          "rollout_engine": spec.rollout.engine,
          "step_seconds": None if set(missing) & set(needed) else step,
          "update_mfu": mfu(plan["flops_analytic"]["update_model"], update, chip,
                            plan["num_devices"]),
          "assumptions": {"generation_batches": 1,
                          "mean_response_fraction": MEAN_RESPONSE_FRACTION,
                          "slot_utilization": SLOT_UTILIZATION}}


def mfu(model_flops: float, seconds: float, chip: Chip, num_devices: int) -> float:
  """Model FLOPs utilisation: the work the model needs (no recomputation) over what the chips
  could do at peak in ``seconds``."""
  return model_flops / (seconds * chip.flops_per_s * num_devices) if seconds > 0 else 0.0

# Share of GPU memory XLA's allocator may take (launch/slurm_gpu.sbatch sets 0.92).
GPU_MEM_FRACTION = 0.92
# Train-step temporaries per token, per layer and per hidden unit of one trajectory with
# rematerialisation on (gradient buffers excluded), by fsdp degree: fitted to libtpu's compiles
# of the Qwen2.5-32B step (scanned layers, libtpu's windowed einsum off as `dapo-train` runs it,
# Pallas splash attention, fp32 master weights, tensor 8, one trajectory per chip, 22528
# tokens). fsdp 4: 4.51 on v5p:2x4x4 and 4.39 on v5p:4x4x4 with data 2; fsdp 8: 3.69 on
# v5p:4x4x4; fsdp 16: 3.33 on v5p:4x4x8. (With the windowed einsum on, fsdp 8 and 16 kept about
# 1.27 GB per layer where fsdp 4 kept 0.17: rates 11.4 and 12.0.) A flash kernel keeps no
# [T, S] scores, so the rate is per token; cuDNN's flash attention on GPUs is assumed to
# behave alike until a GPU compile confirms it.
REMAT_BYTES_BY_FSDP = {4: 4.45, 8: 3.69, 16: 3.33}


def remat_bytes_per_token_layer_unit(fsdp: int) -> float:
  """The fitted rate of the nearest compiled fsdp degree (ties: the larger rate)."""
  near = lambda k: (abs(math.log2(k) - math.log2(max(fsdp, 1))), -REMAT_BYTES_BY_FSDP[k])
  return REMAT_BYTES_BY_FSDP[min(REMAT_BYTES_BY_FSDP, key=near)]

# Static-sampler temporaries besides the KV cache, as a share of it (the same compiles: 4.8 GiB
# over a 44 GiB cache at 64 sequences x 22528 slots per chip, 7.8 over 66 at 96).
ROLLOUT_TEMP_OVER_KV = 0.12
BATCH_AXES = ("data", "fsdp")


def mesh_sizes(axes, num_devices: int) -> dict[str, int]:
  """``[(name, size)]`` with one -1 resolved against ``num_devices``."""
  known = math.prod(int(s) for _, s in axes if int(s) != -1)
  return {str(n): (num_devices // known if int(s) == -1 else int(s)) for n, s in axes}


def _split(n: int, ways: int) -> int:
  """Per-device share of a dimension of size ``n`` split ``ways`` ways (whole if indivisible)."""
  return n // ways if ways > 1 and n % ways == 0 else n


def _mesh_sizes(spec: RunSpec, num_devices: int) -> tuple[dict[str, int], dict[str, int]]:
  """The training and the rollout mesh's axis sizes (``rollout_mesh`` empty: the training's)."""
  return (mesh_sizes(spec.mesh, num_devices),
          mesh_sizes(spec.rollout_mesh or spec.mesh, num_devices))


def _mesh_shape(mesh) -> dict[str, int]:
  return dict(mesh.shape) if hasattr(mesh, "shape") else dict(mesh)


def kv_cache_bytes_per_device(mcfg: Qwen2Config, mesh, rows: int, slots: int) -> int:
  """The decode loop's K and V for ``rows`` sequences of ``slots`` tokens, on one device
  (rows over the data axes, KV heads over ``tensor``)."""
  shape = _mesh_shape(mesh)
  batch_ways = math.prod(shape.get(a, 1) for a in BATCH_AXES)
  kv_heads = _split(mcfg.num_key_value_heads, shape.get("tensor", 1))
  return (_split(rows, batch_ways) * mcfg.num_hidden_layers * 2 * kv_heads * mcfg.dim_per_head
          * slots * np.dtype(mcfg.dtype).itemsize)


def _matmul_params(mcfg: Qwen2Config) -> int:
  """Parameters that take part in a matmul per token (the embedding lookup is free)."""
  embed = mcfg.vocab_size * mcfg.hidden_size
  return mcfg.num_params() if mcfg.tie_word_embeddings else mcfg.num_params() - embed


def _attn_flops_per_token(mcfg: Qwen2Config, context: float) -> float:
  return 4.0 * mcfg.num_hidden_layers * mcfg.num_attention_heads * mcfg.dim_per_head * context


def adapter_sizes(mcfg: Qwen2Config, lcfg: lora.LoRAConfig) -> tuple[int, int]:
  """(adapter parameters, parameters of the base kernels they adapt) over every layer, for the
  projections ``lcfg.targets`` selects (by the module paths `lora.add_adapters` matches)."""
  if lcfg.rank <= 0:
    return 0, 0
  d, f, e = mcfg.hidden_size, mcfg.intermediate_size, mcfg.dim_per_head
  q, kv = mcfg.num_attention_heads * e, mcfg.num_key_value_heads * e
  shapes = {"self_attn.q_proj": (d, q), "self_attn.k_proj": (d, kv), "self_attn.v_proj": (d, kv),
            "self_attn.o_proj": (q, d), "mlp.gate_proj": (d, f), "mlp.up_proj": (d, f),
            "mlp.down_proj": (f, d)}
  scanned = mcfg.scan_layers
  adapters = adapted = 0
  for layer in range(mcfg.num_hidden_layers):
    for name, (n_in, n_out) in shapes.items():
      path = f"layers.{name}" if scanned else f"layers.{layer}.{name}"
      if lora._matches(path, lcfg.targets):  # pylint: disable=protected-access
        adapters += lcfg.rank * (n_in + n_out)
        adapted += n_in * n_out
  return adapters, adapted


def lora_rollout_bytes(spec: RunSpec, mcfg: Qwen2Config, num_devices: int, rollout_params: int
                       ) -> dict[str, int] | None:
  """A LoRA run's rollout weights per device beyond its train state
  (``rollout/weights.MergedRolloutWeights``), or None without adapters: ``merged``, the adapted
  kernels merged in the model's dtype and rollout layout (new arrays each step; every other
  leaf is the rollout base's own), and ``resident``, a copy of the base in the rollout layout
  kept for the run where the training layout differs (``fsdp`` > 1, which ``SAMPLE_RULES``
  replicates, or another ``rollout_mesh``). ``rollout_params``: the whole model in the rollout
  layout; the adapted kernels take their share of it."""
  n_adapter, n_adapted = adapter_sizes(mcfg, lora.LoRAConfig.from_config(spec.model.lora))
  if not n_adapter:
    return None
  train, roll = _mesh_sizes(spec, num_devices)
  same = train.get("fsdp", 1) == 1 and train == roll
  return {"merged": int(rollout_params * n_adapted / mcfg.num_params()),
          "resident": 0 if same else rollout_params}


def step_flops(spec: RunSpec, mcfg: Qwen2Config, packed: dict[str, Any] | None = None
               ) -> dict[str, float]:
  """FLOPs of one RL step over all devices: one generation batch (dynamic sampling may draw
  more), the old-log-prob forward and the updates (with full rematerialisation, one more
  forward per update).

  With LoRA (``model.lora.rank > 0``) the frozen base's matmuls get no weight gradient: the
  update is the forward, the activation gradients (1x the frozen matmuls, 2x the attention) and
  the adapters' both gradients (2x their forward, ``(x @ A) @ B``: 2 FLOPs per adapter parameter
  and token). The rollout runs the merged weights (no adapter FLOPs); ``merge`` is the step's
  ``A @ B`` per adapted kernel.

  ``packed`` (`plan_packing.packed_shape`, optim.packing): the trainer's forwards run the packed
  rows' positions (the log-prob head on all of them) and the attention the packed kernel
  executes (``attention_pairs``); ``attention_full_square`` then says 0 (see
  `plan_overlap.training_seconds`)."""
  lcfg = lora.LoRAConfig.from_config(spec.model.lora)
  n_adapter, n_adapted = adapter_sizes(mcfg, lcfg)
  n_mm = _matmul_params(mcfg)
  p, r = spec.data.max_prompt_length, spec.rollout.max_response_length
  t = spec.sizes.max_length
  prompts, g = spec.algorithm.gen_batch_size, spec.rollout.n
  rollout = (prompts * p * (2 * n_mm + _attn_flops_per_token(mcfg, p))
             + prompts * g * r * (2 * n_mm + _attn_flops_per_token(mcfg, p + r / 2)))
  rows = spec.sizes.rows_per_step
  # The log-prob head (vocab x hidden) runs on the R response positions only (logprobs.py).
  head = mcfg.vocab_size * mcfg.hidden_size
  if packed is None:
    weights = rows * (t * 2 * (n_mm - head) + r * 2 * head)  # the base's matmuls
    attn = full_square = rows * t * _attn_flops_per_token(mcfg, t)
    adapters = rows * t * 2 * n_adapter
  else:  # every packed position runs every matmul, the head included
    batches = rows / packed["rows"]
    positions = packed["packed_rows"] * packed["budget"] * batches
    weights = positions * 2 * n_mm
    attn, full_square = 4.0 * mcfg.num_hidden_layers * mcfg.num_attention_heads * \
        mcfg.dim_per_head * packed["attention_pairs"] * batches, 0.0
    adapters = positions * 2 * n_adapter
  fwd = weights + attn + adapters
  # What MFU counts (no recomputation): forward + backward, the base's weight gradients only
  # when it trains.
  update_model = (fwd + (2 if lcfg.rank <= 0 else 1) * weights + 2 * attn + 2 * adapters
                  ) * spec.optim.ppo_epochs
  train = update_model + (fwd * spec.optim.ppo_epochs if spec.model.remat != "none" else 0)
  logprob = 0.0 if spec.rollout.use_sampler_logprobs else fwd
  merge = 2.0 * lcfg.rank * n_adapted
  return {"rollout": rollout, "logprob": logprob, "train": train, "merge": merge,
          "total": rollout + logprob + train + merge, "update_model": update_model,
          "adapter_params": n_adapter, "attention_full_square": full_square}


def layout_warnings(spec: RunSpec, mcfg: Qwen2Config, num_devices: int) -> list[str]:
  """Layout choices that silently waste devices (replicated work) or memory."""
  out = []
  for field, axes in (("mesh", spec.mesh), ("rollout_mesh", spec.rollout_mesh or spec.mesh)):
    known = math.prod(int(s) for _, s in axes if int(s) != -1)
    if num_devices % known:
      out.append(f"config.{field}={list(axes)} does not divide {num_devices} devices.")
      return out
  train, roll = _mesh_sizes(spec, num_devices)
  ways = math.prod(train.get(a, 1) for a in BATCH_AXES)
  micro = min(spec.optim.micro_batch_size, spec.sizes.rows_per_update)
  if micro % ways:
    out.append(f"micro-batch of {micro} trajectories does not split over the {ways} batch "
               f"shards (data x fsdp): every shard computes all of it. Use a multiple of {ways}.")
  rways = math.prod(roll.get(a, 1) for a in BATCH_AXES)
  prompts = spec.sizes.prompts_per_call
  if prompts % rways:
    out.append(f"{prompts} prompts per rollout call do not split over the {rways} rollout "
               f"batch shards: set rollout.prompts_per_call to a multiple of {rways}.")
  for name, mesh in (("training", train), ("rollout", roll)):
    tp = mesh.get("tensor", 1)
    for what, n in (("attention heads", mcfg.num_attention_heads),
                    ("KV heads", mcfg.num_key_value_heads)):
      if tp > 1 and n % tp:
        out.append(f"{name} tensor={tp} does not divide the {n} {what}: they stay replicated.")
  return out


def analytic_memory(spec: RunSpec, mcfg: Qwen2Config, num_devices: int,
                    master_dtype: str = "float32", packed: dict[str, Any] | None = None
                    ) -> dict[str, Any]:
  """Per-device bytes in the shape ``plan.make_plan`` reports for compiled targets.

  Parameters, optimizer state and KV cache are exact up to indivisible dimensions. Train-step
  temporaries with rematerialisation use the per-token rate fitted to TPU compiles
  (``REMAT_BYTES_BY_FSDP``); without it, every layer's activations. With LoRA the trained
  parameters (and their gradients) are the adapters; the base is held once, frozen, in its dtype.
  ``packed`` (optim.packing): a micro-batch's activations are its packed rows' on a shard.
  """
  train, roll = _mesh_sizes(spec, num_devices)
  tp, rtp = train.get("tensor", 1), roll.get("tensor", 1)
  pb, ab = np.dtype(mcfg.param_dtype).itemsize, np.dtype(mcfg.dtype).itemsize
  # The trained copy is held in the master dtype (fp32 for a bf16 model), as the trainer does.
  mb = max(pb, np.dtype(master_dtype).itemsize) if master_dtype else pb
  n = mcfg.num_params()
  shards = train.get("fsdp", 1) * tp
  n_adapter, _ = adapter_sizes(mcfg, lora.LoRAConfig.from_config(spec.model.lora))
  frozen = n * pb // shards if n_adapter else 0
  trained = n_adapter or n
  params = trained * mb // shards
  opt_state = 2 * params  # Adam's two moments, in the master dtype
  p, r = spec.data.max_prompt_length, spec.rollout.max_response_length
  t = spec.sizes.max_length
  ways = math.prod(train.get(a, 1) for a in BATCH_AXES)
  rows = spec.sizes.rows_per_update
  micro = _split(min(spec.optim.micro_batch_size, rows), ways)
  d, f, layers = mcfg.hidden_size, mcfg.intermediate_size, mcfg.num_hidden_layers
  if packed is not None:  # rows of the micro-batch on a shard, and their length
    micro, t_row = packed["rows_per_cell"], packed["budget"]
  else:
    t_row = t
  if spec.model.remat != "none":
    saved = micro * t_row * layers * d * remat_bytes_per_token_layer_unit(train.get("fsdp", 1))
  else:  # every layer keeps its activations, attention scores included (fp32)
    heads = _split(mcfg.num_attention_heads, tp)
    saved = layers * micro * (t_row * (6 * d + 3 * _split(f, tp)) * ab
                              + 3 * heads * t_row * t_row * 4)
  # fp32 gradient accumulators + the forward's copy in the model's dtype
  grads = trained * 4 // shards + trained * pb // shards
  if packed is not None:  # ids, positions, segments a packed position; index, mask, inputs a slot
    batch = (packed["packed_rows"] * packed["budget"] * 12
             + packed["slots"] * (r * 13 + 5)) // ways
  else:
    batch = _split(rows, ways) * (t * 5 + r * 5 + 5)
  activations = int(saved) + grads
  train_parts = {"params": params, "opt_state": opt_state, "frozen_base": frozen, "batch": batch,
                 "activations_and_temp": activations}
  rparams = n * pb // rtp
  src = n * pb // (train.get("fsdp", 1) * tp)
  prompts, g = spec.sizes.prompts_per_call, spec.rollout.n
  kv = kv_cache_bytes_per_device(mcfg, roll, prompts * g, t)
  rrows = _split(prompts * g, math.prod(roll.get(a, 1) for a in BATCH_AXES))
  outputs = rrows * (r * 9 + p * 5 + 9)
  other = int(ROLLOUT_TEMP_OVER_KV * kv) + rrows * _split(mcfg.vocab_size, rtp) * 4 * 3
  return {
      "train": {"parts": train_parts, "peak": sum(train_parts.values()),
                "state_bytes": params + opt_state + frozen,
                "num_micro_batches": spec.sizes.micro_batches_per_update},
      "rollout": {"parts": {"params": rparams, "kv_cache_estimate": kv, "other_temp": other,
                            "outputs": outputs},
                  "peak": rparams + kv + other + outputs, "prompts_per_call": prompts,
                  # The compiled TPU reshard stages one destination-sized buffer.
                  # Its source is the training shard cast to the model's dtype.
                  "reshard": {"src": src, "dst": rparams, "temp": rparams,
                              "peak": src + 2 * rparams}}}
