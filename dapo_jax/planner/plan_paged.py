"""Closed-form rollout estimate of the continuous engine with a paged KV cache, next to the
dense engine's on the same basis (``dapo-plan``; issue 28).

The dense engine reserves ``S = P + R`` positions per slot and every decode step reads them all;
the paged engine holds pages of ``page_size`` tokens from one pool per data shard and reads only
each slot's live pages. Both estimates here are rooflines of one decode step per chip (the
larger of FLOPs at peak and HBM bytes at full bandwidth) times the steps a generation batch
needs, from the model's sizes and a response-length mix. Neither comes from XLA's cost
analysis, so neither carries its charge of a one-slot scatter's whole operand (README,
"Step-time estimate"): this is the corrected basis, for both engines alike.

The length mix is the long-tail bench's (``bench/continuous_vs_static.py``): a share ``at_max``
of the responses at ``R``, the rest ``floor(Beta(a, b) x (R - 1)) + 1``; with the defaults the
mean is a quarter of ``R`` (the dense estimate's ``MEAN_RESPONSE_FRACTION``) and 5% reach it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from scipy import special

from dapo_jax.models import Qwen2Config
from dapo_jax.planner import plan_estimates as est
from dapo_jax.spec.run_spec import RolloutSpec, RunSpec


@dataclasses.dataclass(frozen=True)
class LengthMix:
  """Response lengths in [1, R]: ``at_max`` of them R, the rest Beta(a, b) scaled to [1, R)."""
  at_max: float = 0.05
  a: float = 1.2
  b: float = 4.5

  def pmf(self, r: int) -> np.ndarray:
    """P(length = l) for l = 1 .. r (index l - 1)."""
    if r < 2:
      return np.ones(max(r, 1))
    edges = special.betainc(self.a, self.b, np.arange(r) / (r - 1))  # F at k / (r - 1)
    p = (1.0 - self.at_max) * np.diff(edges)  # floor(x (r - 1)) = k, k = 0 .. r - 2
    return np.append(p, self.at_max)


LONG_TAIL = LengthMix()


@dataclasses.dataclass(frozen=True)
class MixStats:
  """What the engines' costs need from the mix, per busy slot, at steady state.

  A sample of L tokens holds its slot for L steps, its j-th reading ``prompt + j`` tokens, so a
  busy slot reads ``prompt + live_response`` tokens a step on average (time-weighted). Its own
  pages (response tokens, the copied last partial prompt page included) average
  ``own_pages``; the prompt's full pages are stored once per group and held while any of its G
  samples runs (the G start together), ``shared_pages`` per busy slot."""
  mean: float
  live_response: float
  own_pages: float
  max_of_group: float
  shared_pages: float


def mix_stats(pmf: np.ndarray, prompt: int, page_size: int, group: int) -> MixStats:
  r = len(pmf)
  l = np.arange(1, r + 1, dtype=np.float64)
  mean = float(pmf @ l)
  live = float(pmf @ (l * (l + 1) / 2)) / mean
  own = np.cumsum(np.ceil((prompt + l) / page_size) - prompt // page_size)  # pages at step j
  below = np.concatenate([[0.0], np.cumsum(pmf)[:-1]])  # P(L <= l - 1), l = 1 .. r
  max_of_group = float(np.sum(1.0 - below**group))  # E[max] = sum_{l>=0} P(max > l)
  shared = (prompt // page_size) * max_of_group / (group * mean)
  return MixStats(mean, live, float(pmf @ own) / mean, max_of_group, shared)


def kv_bytes_per_token(mcfg: Qwen2Config, tensor: int) -> int:
  """One token's K and V over all layers, on one chip (KV heads over ``tensor``), as the cache
  stores them (``mcfg.kv_cache_dtype``: 8-bit values plus a 4-byte scale per KV head)."""
  from dapo_jax.models import kv_quant  # pylint: disable=g-import-not-at-top
  heads = est._split(mcfg.num_key_value_heads, tensor)  # pylint: disable=protected-access
  return (mcfg.num_hidden_layers * 2 * heads
          * kv_quant.bytes_per_token_head(mcfg.dim_per_head, mcfg.kv_dtype))


def with_kv_cache_dtype(spec: RunSpec, mcfg: Qwen2Config) -> Qwen2Config:
  """``mcfg`` with the run's ``rollout.kv_cache_dtype`` (the caches the engine would build)."""
  return mcfg.replace(kv_cache_dtype=spec.rollout.kv_cache_dtype)


def decode_step(mcfg: Qwen2Config, tensor: int, slots: float, busy: float, context: float
                ) -> est.Cost:
  """One decode step on one chip of a data shard: ``slots`` rows through the matmuls (the
  weights split over ``tensor``, read once), ``busy`` of them reading ``context`` tokens of KV
  each. Weight bytes are the matmul parameters' (an embedding lookup reads rows)."""
  n_mm = est._matmul_params(mcfg)  # pylint: disable=protected-access
  weights = n_mm * np.dtype(mcfg.dtype).itemsize / tensor
  flops = (slots * 2.0 * n_mm + busy * est._attn_flops_per_token(mcfg, context)) / tensor  # pylint: disable=protected-access
  return est.Cost(flops, weights + busy * context * kv_bytes_per_token(mcfg, tensor))


def rollout(cost: est.Cost, chip: est.Chip, requests: int, mean: float, slots: int,
            max_response: int, utilization: float) -> dict[str, Any]:
  """A generation batch's decode: ``requests x mean`` tokens at ``slots x utilization`` a step,
  and never fewer steps than the longest response."""
  steps = max(requests * mean / (slots * utilization), max_response)
  per_step = cost.seconds(chip)
  return {"slots": slots, "steps": steps, "step_seconds": per_step,
          "seconds": steps * per_step, "flops": cost.flops, "bytes": cost.bytes,
          "bound": ("compute" if cost.flops / chip.flops_per_s >= cost.bytes / chip.hbm_bytes_per_s
                    else "memory")}


def pool_pages(rollout: RolloutSpec, mcfg: Qwen2Config, tensor: int, hbm_bytes: int | None,
               resident_bytes: int) -> tuple[int, float | None]:
  """(pages per data shard, KV budget bytes per chip): ``rollout.kv_pages``, else
  ``rollout.kv_hbm_fraction`` of the HBM a chip has left after ``resident_bytes``, in pages
  (0 when neither is known), as the engine sizes its pool when it opens a stream."""
  page_bytes = rollout.page_size * kv_bytes_per_token(mcfg, tensor)
  fraction = rollout.kv_hbm_fraction
  budget = None if hbm_bytes is None else fraction * max(hbm_bytes - resident_bytes, 0)
  pages = rollout.kv_pages
  if not pages and budget is not None:
    pages = int(budget // page_bytes)
  return pages, budget


def engine_spec(spec: RunSpec, mcfg: Qwen2Config, platform: str, tensor: int, shards: int,
                hbm_bytes: int | None, resident_bytes: int):
  """The paged engine's `PagedSpec` on ``platform`` as the trainer's `ContinuousSampler`
  would pick it for the run ``spec`` (None: the dense cache): "auto" is paged on TPU and GPU; the
  pool is `pool_pages`, capped as the sampler caps it (every slot of a data shard at full
  length plus the queue's prompts) and never below one prompt plus one full sample."""
  # pylint: disable=g-import-not-at-top
  from dapo_jax.models import paged_kv
  from dapo_jax.rollout import slot_programs as prog
  # pylint: enable=g-import-not-at-top
  r = spec.rollout
  mcfg = with_kv_cache_dtype(spec, mcfg)
  p, t = spec.data.max_prompt_length, r.page_size
  if paged_kv.resolve_kv_cache(r.kv_cache, spec.sizes.max_length, platform) != "paged":
    return None
  full, prompt = paged_kv.pages_for(spec.sizes.max_length, t), paged_kv.pages_for(p, t)
  queue = max(2, -(-2 * r.max_concurrent_decodes // r.n))  # ContinuousSampler.queue_prompts
  enough = r.max_concurrent_decodes // shards * full + queue * prompt + 1  # one shard's
  pages, _ = pool_pages(r, mcfg, tensor, hbm_bytes, resident_bytes)
  pages = pages if r.kv_pages else min(enough, max(prompt + full + 1, pages))
  return prog.PagedSpec(num_pages=pages, page_size=t, impl=r.attention_impl, shards=shards)


def estimate(spec: RunSpec, mcfg: Qwen2Config, chip: est.Chip, num_devices: int,
             hbm_bytes: int | None, resident_bytes: int, mix: LengthMix = LONG_TAIL
             ) -> dict[str, Any]:
  """Dense vs paged rollout of one generation batch, per chip of the rollout mesh.

  ``resident_bytes``: what stays on a chip through rollout besides the KV (the training state
  and the rollout weights). The pool per data shard is ``rollout.kv_pages`` pages, or
  ``rollout.kv_hbm_fraction`` of the HBM left after ``resident_bytes`` (the queue's prompts
  take pages from it: the sampler queues ``2 x slots / G`` prompts). Slots that fit: the pool
  over the pages a busy slot holds on average (the engine preempts when a burst exceeds it).
  The paged engine is estimated at the configured slots and at the slots that fit; both use the
  dense estimate's ``SLOT_UTILIZATION``.
  """
  mcfg = with_kv_cache_dtype(spec, mcfg)
  mesh = est.mesh_sizes(spec.rollout_mesh or spec.mesh, num_devices)
  tensor = mesh.get("tensor", 1)
  shards = math.prod(mesh.get(a, 1) for a in est.BATCH_AXES)
  p, r, g = spec.data.max_prompt_length, spec.rollout.max_response_length, spec.rollout.n
  page = spec.rollout.page_size
  u = est.SLOT_UTILIZATION
  stats = mix_stats(mix.pmf(r), p, page, g)
  token = kv_bytes_per_token(mcfg, tensor)
  page_bytes = page * token
  requests = spec.algorithm.gen_batch_size * g
  configured = spec.rollout.max_concurrent_decodes
  dense_per_shard = configured / shards
  dense = rollout(decode_step(mcfg, tensor, dense_per_shard, dense_per_shard, p + r), chip,
                  requests, stats.mean, configured, r, u)
  dense["kv_bytes"] = dense_per_shard * (p + r) * token
  pages, budget = pool_pages(spec.rollout, mcfg, tensor, hbm_bytes, resident_bytes)
  queue_pages = 2 * math.ceil(p / page) / g  # per slot: the queue's prompts
  per_slot = stats.own_pages + stats.shared_pages + queue_pages
  out = {"basis": "closed form, no scatter overcharge (both engines)",
         "mix": dataclasses.asdict(mix) | {"mean_response": stats.mean,
                                          "live_response_per_busy_slot": stats.live_response,
                                          "max_of_group": stats.max_of_group},
         "prompt_tokens": p, "page_size": page, "page_bytes": page_bytes,
         "kv_bytes_per_token": token, "data_shards": shards, "tensor": tensor,
         "utilization": u, "requests": requests, "dense": dense,
         "pages_per_busy_slot": {"own": stats.own_pages, "shared_prompt": stats.shared_pages,
                                 "queue": queue_pages, "total": per_slot},
         "pool_pages": pages, "pool_bytes": pages * page_bytes, "kv_budget_bytes": budget,
         "full_sample_pages": math.ceil((p + r) / page)}
  live = p + stats.live_response

  def paged(per_shard: int) -> dict[str, Any]:
    cost = decode_step(mcfg, tensor, per_shard, u * per_shard, live)
    return rollout(cost, chip, requests, stats.mean, per_shard * shards, r, u) | {
        "live_kv_bytes": u * per_shard * live * token}

  out["paged_configured"] = paged(max(1, round(dense_per_shard)))
  fit = int(pages // per_slot) if pages >= out["full_sample_pages"] else 0
  out["slots_fit_per_shard"] = fit
  if fit:
    out["paged_fit"] = paged(fit)
    out["speedup_fit"] = dense["seconds"] / out["paged_fit"]["seconds"]
  out["speedup_configured"] = dense["seconds"] / out["paged_configured"]["seconds"]
  # The dense engine given the same KV budget (each slot reserves P + R, its queue's prompts P).
  dense_fit = int(out["pool_bytes"] // ((p + r + 2 * p / g) * token))
  if dense_fit:
    out["dense_fit"] = rollout(decode_step(mcfg, tensor, dense_fit, dense_fit, p + r), chip,
                               requests, stats.mean, dense_fit * shards, r, u)
  return out


def compiled_engines(plan: dict[str, Any]) -> list[dict[str, Any]]:
  """Per-chip memory of the compiled paged engine chunks in ``plan`` (dapo-plan's
  ``continuous_rollout`` when the configured engine is paged, and ``paged_fit_rollout``, the
  chunk at the slots that fit): slots, pool, engine state, temporaries, and the rollout phase
  (the training state, which stays on the chips, + the chunk's peak) against HBM."""
  out = []
  for key in ("continuous_rollout", "paged_fit_rollout"):
    c = plan.get(key, {})
    if "error" in c:
      out.append({"program": key, "error": c["error"]})
    if "paged" not in c:
      continue
    shards = c["paged"]["shards"]
    row = {"program": key, "slots": c["slots"], "slots_per_shard": c["slots"] // shards,
           **c["paged"], "engine_state_bytes": c["parts"]["engine_state"],
           "params_bytes": c["parts"]["params"], "compile_seconds": c["compile_seconds"]}
    if "oom" in c or "refused" in c:
      row |= {k: c[k] for k in ("oom", "refused") if k in c}
    else:
      row |= {"temp_bytes": c["memory"]["temp"], "peak_bytes": c["peak"],
              "rollout_phase_bytes": plan["train"]["state_bytes"] + c["peak"]}
      if plan.get("hbm_bytes"):
        row["fits"] = row["rollout_phase_bytes"] <= plan["hbm_bytes"]
    out.append(row)
  return out


def _h(s: float) -> str:
  return f"{s / 3600:.2f} h" if s >= 3600 else f"{s:.0f} s"


def format_lines(pe: dict[str, Any], compiled_dense: float | None = None) -> list[str]:
  """The plan's lines for ``estimate``'s output (``compiled_dense``: the compiled continuous
  engine's rollout seconds, which carry the scatter overcharge)."""
  gib = 1024**3
  d, m = pe["dense"], pe["mix"]
  lines = [f"  paged KV rollout ESTIMATE ({pe['basis']}; long-tail mix: mean response "
           f"{m['mean_response']:.0f}, {100 * m['at_max']:.0f}% at the budget, busy slot's live "
           f"KV prompt {pe['prompt_tokens']} + {m['live_response_per_busy_slot']:.0f} tokens; "
           f"{100 * pe['utilization']:.0f}% of slot-steps busy):",
           f"    dense  {d['slots']} slots ({d['slots'] / pe['data_shards']:.0f}/data shard), "
           f"KV {d['kv_bytes'] / gib:.2f} GiB/chip: {d['steps']:,.0f} steps x "
           f"{1e3 * d['step_seconds']:.1f} ms = {_h(d['seconds'])} ({d['bound']})"
           + (f"; compiled (with the overcharge) {_h(compiled_dense)}" if compiled_dense else "")]
  pp = pe["pages_per_busy_slot"]
  budget = pe["kv_budget_bytes"]
  lines.append(f"    pool   {pe['pool_pages']:,} pages of {pe['page_size']} tokens "
               f"({pe['page_bytes'] / 2**20:.2f} MiB/chip each) = "
               f"{pe['pool_bytes'] / gib:.2f} GiB/chip"
               + (f" (of a {budget / gib:.2f} GiB budget)" if budget is not None else "")
               + f"; a busy slot holds {pp['total']:.1f} pages ({pp['own']:.1f} own, "
               f"{pp['shared_prompt']:.1f} shared prompt, {pp['queue']:.1f} queue)")
  if "dense_fit" in pe:
    x = pe["dense_fit"]
    lines.append(f"    dense  in the same pool: {x['slots']} slots "
                 f"({x['slots'] // pe['data_shards']}/data shard): {_h(x['seconds'])}")
  for key, label in (("paged_configured", "paged  configured slots"),
                     ("paged_fit", "paged  slots that fit")):
    if key in pe:
      x = pe[key]
      lines.append(f"    {label}: {x['slots']} ({x['slots'] // pe['data_shards']}/data shard), "
                   f"live KV {x['live_kv_bytes'] / gib:.2f} GiB/chip: {x['steps']:,.0f} steps x "
                   f"{1e3 * x['step_seconds']:.1f} ms = {_h(x['seconds'])} ({x['bound']}), "
                   f"{d['seconds'] / x['seconds']:.2f}x less than dense")
  for c in pe.get("compiled", []):
    if "error" in c:
      lines.append(f"    compiled paged chunk ({c['program']}) failed: {c['error'][:200]}")
      continue
    head = (f"    compiled {c['impl']} chunk, {c['slots']} slots ({c['slots_per_shard']}/data "
            f"shard), {c['pages_per_shard']:,} pages/shard:")
    if "oom" in c:
      lines.append(f"{head} does not compile ({c['oom'].get('what', 'out of memory')})")
      continue
    if "refused" in c:
      lines.append(f"{head} refused by the compiler ({c['refused']['what'][:200]})")
      continue
    lines.append(f"{head} engine state {c['engine_state_bytes'] / gib:.2f} GiB + weights "
                 f"{c['params_bytes'] / gib:.2f} + temporaries {c['temp_bytes'] / gib:.2f} = "
                 f"peak {c['peak_bytes'] / gib:.2f} GiB/chip; with the training state "
                 f"{c['rollout_phase_bytes'] / gib:.2f} GiB"
                 + ({True: ": fits", False: ": does NOT fit"}.get(c.get("fits"), "")))
  if not pe["slots_fit_per_shard"]:
    lines.append(f"    paged  the pool cannot hold one full-length sample "
                 f"({pe['full_sample_pages']} pages)")
  return lines


def per_chip_model(mcfg: Qwen2Config, tensor: int) -> Qwen2Config:
  """The model as one chip of a ``tensor``-way split holds it: its share of the attention
  heads, KV heads, MLP width and vocabulary (the per-chip weights and KV of the rollout mesh,
  without the all-reduces between chips)."""
  split = lambda n: est._split(n, tensor)  # pylint: disable=protected-access
  return mcfg.replace(num_attention_heads=split(mcfg.num_attention_heads),
                      num_key_value_heads=split(mcfg.num_key_value_heads),
                      intermediate_size=split(mcfg.intermediate_size),
                      vocab_size=split(mcfg.vocab_size), head_dim=mcfg.dim_per_head)


def compile_paged_step(mcfg: Qwen2Config, device, *, slots: int, pages: int, page_size: int,
                       max_pages: int, impl: str) -> dict[str, Any]:
  """Compiles one decode step over a paged cache (`Qwen2ForCausalLM.decode_step_paged`, then
  sampling) for ``device`` with ``mcfg``'s shapes (``per_chip_model`` for one chip of a
  tensor-split mesh): its memory analysis, cost analysis (a Pallas kernel is opaque to it) and
  compile seconds. The pool and the weights are donated/inputs as in the engine's loop."""
  import time  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jax.sharding import SingleDeviceSharding  # pylint: disable=g-import-not-at-top
  from dapo_jax.models import abstract_model  # pylint: disable=g-import-not-at-top
  from dapo_jax.rollout.sampling import sample_logits  # pylint: disable=g-import-not-at-top
  on = SingleDeviceSharding(device)
  at = lambda tree: jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on), tree)
  graphdef, state = nnx.split(abstract_model(mcfg))
  from dapo_jax.models import paged_attention  # pylint: disable=g-import-not-at-top
  cache = jax.eval_shape(lambda: abstract_model(mcfg).init_paged_cache(
      slots, pages, page_size, max_pages,
      combined=paged_attention.uses_combined_pool(impl, platform="tpu")))

  def step(state, tok_N, pos_N, cache, active_N, key):
    logits_NxV, cache, app = nnx.merge(graphdef, state).decode_step_paged(
        tok_N, pos_N, cache, active_N, impl=impl)
    tok_N, lp_N = sample_logits(logits_NxV, key, temperature=1.0, top_p=1.0, top_k=0)
    return tok_N, lp_N, cache, app.out_of_pages

  i32 = jax.ShapeDtypeStruct((slots,), jnp.int32, sharding=on)
  key = jax.eval_shape(lambda: jax.random.key(0))
  start = time.perf_counter()
  compiled = jax.jit(step, donate_argnums=3).lower(
      at(state), i32, i32, at(cache), jax.ShapeDtypeStruct((slots,), jnp.bool_, sharding=on),
      jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=on)).compile()
  seconds = time.perf_counter() - start
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
  nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
  return {"impl": impl, "slots": slots, "pages": pages, "page_size": page_size,
          "compile_seconds": round(seconds, 1), "weights_bytes": nbytes(state),
          "pool_bytes": nbytes((cache.k, cache.v)),
          "memory": {k: int(getattr(mem, f"{k}_size_in_bytes"))
                     for k in ("argument", "output", "alias", "temp")},
          "cost": {"flops": float(cost.get("flops", 0.0)),
                   "bytes": float(cost.get("bytes accessed", 0.0))},
          "custom_calls": compiled.as_text().count("custom_call_target=\"tpu_custom_call\"")}
