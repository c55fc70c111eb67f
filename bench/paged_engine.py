r"""The continuous engine with a paged vs a dense KV cache on a long-tail length mix (one run).

    python bench/paged_engine.py            # tiny preset; writes bench/results/paged_engine.json

Workload as `bench/continuous_vs_static.py`: G responses per prompt, lengths drawn so that 5%
reach the mix's maximum and the mean is about a quarter of it; EOS is off and each row gets its
length as its own budget, so every engine decodes exactly the same tokens. Four measurements:

1. speed: decode tokens/s, paged vs dense, at response capacity `--capacity` (4,096) with the
   mix's maximum `--mix_max` (1,024: mean ~256 tokens). Goal: paged >= 3x dense.
2. growth: the paged engine's time per token at capacities 512 and 16,384 with one mix that
   fits both (maximum 512) and one pool (`--growth_pages`: a pool is sized by memory, not by
   capacity), and with each capacity's default CPU pool (every slot at full length). Goal:
   within 1.3x.
3. memory: slots that one KV budget holds (the dense engine's `--slots` slots at the capacity),
   paged vs dense: the paged engine gets that many tokens as pages and 4x the slots, and
   its concurrency is measured (mean live slots per decode step) and its preemptions counted.
4. preemption: the paged engine on a pool a sixteenth of that size: preemptions, the tokens
   decoded again, wall time against the unpreempted pool, and that the outputs are identical.

Every run's tokens are checked equal to the dense engine's (log-probs to 1e-5). Timings: each
engine compiled by a warm-up call, then timed alternately (`--repeats`, best kept): the machine
may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.continuous_vs_static import long_tail_lengths  # noqa: E402
from dapo_jax.models import create_model, get_preset  # noqa: E402
from dapo_jax.rollout.continuous import ContinuousSampler  # noqa: E402
from dapo_jax.rollout.sampling import SamplingParams  # noqa: E402


def _cpu() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    return platform.processor() or "unknown"


class Workload:
  """Prompts and per-row budgets of one length mix."""

  def __init__(self, cfg, args, mix_max: int, seed: int):
    rng = np.random.default_rng(seed)
    self.lengths = long_tail_lengths(args.prompts * args.g, mix_max, 0.05, rng)
    self.ids = np.zeros((args.prompts, args.prompt_len), np.int32)
    self.mask = np.zeros_like(self.ids, bool)
    for i, n in enumerate(rng.integers(args.prompt_len // 2, args.prompt_len + 1, args.prompts)):
      self.ids[i, -n:], self.mask[i, -n:] = rng.integers(1, cfg.vocab_size, n), True
    self.g = args.g


def _engine(graphdef, args, **kv) -> ContinuousSampler:
  return ContinuousSampler(graphdef, num_slots=kv.pop("slots", args.slots),
                           chunk_steps=args.chunk_steps, max_prefill_length=args.prompt_len,
                           attention_impl="xla", **kv)


def _time(runs: dict, repeats: int) -> dict:
  """{name: (best seconds, output, stats)}: a warm-up call each, then alternate timed calls."""
  out = {name: [float("inf"), fn[0](), None] for name, fn in runs.items()}
  for _ in range(repeats):
    for name, (call, sampler) in runs.items():
      t0 = time.perf_counter()
      res = call()
      dt = time.perf_counter() - t0
      if dt < out[name][0]:
        out[name] = [dt, res, sampler.last_stats]
  return {k: tuple(v) for k, v in out.items()}


def _call(sampler, state, work: Workload, capacity: int):
  params = SamplingParams(temperature=1.0, max_new_tokens=capacity, eos_ids=())
  return (lambda: jax.device_get(sampler.generate(state, work.ids, work.mask, jax.random.key(0),
                                                  params, work.g,
                                                  max_new_tokens=work.lengths)), sampler)


def _same(a, b) -> bool:
  """The same tokens (log-probs to 1e-5), compared over the narrower capacity of the two."""
  w = min(a.response_ids.shape[1], b.response_ids.shape[1])
  return bool(np.array_equal(a.response_ids[:, :w], b.response_ids[:, :w])) and float(
      np.abs(np.asarray(a.logprobs)[:, :w] - np.asarray(b.logprobs)[:, :w]).max()) < 1e-5


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", default="tiny")
  ap.add_argument("--slots", type=int, default=32)
  ap.add_argument("--prompts", type=int, default=16)
  ap.add_argument("--g", type=int, default=8)
  ap.add_argument("--prompt_len", type=int, default=32)
  ap.add_argument("--capacity", type=int, default=4096)
  ap.add_argument("--mix_max", type=int, default=1024)
  ap.add_argument("--page_size", type=int, default=16)
  ap.add_argument("--growth_pages", type=int, default=2048, help="the growth runs' pool")
  ap.add_argument("--chunk_steps", type=int, default=32)
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--out", default="bench/results/paged_engine.json")
  args = ap.parse_args()
  cfg = get_preset(args.preset)
  graphdef, state = nnx.split(create_model(cfg, seed=0))
  paged = dict(kv_cache="paged", page_size=args.page_size)
  res: dict = {"command": "python bench/paged_engine.py", "args": vars(args), "cpu": _cpu(),
               "cores": os.cpu_count(), "jax": jax.__version__}

  # 1. Speed at the capacity, mean ~mix_max / 4.
  work = Workload(cfg, args, args.mix_max, seed=0)
  tokens = int(work.lengths.sum())
  dense_s, paged_s = _engine(graphdef, args, kv_cache="dense"), _engine(graphdef, args, **paged)
  t = _time({"dense": _call(dense_s, state, work, args.capacity),
             "paged": _call(paged_s, state, work, args.capacity)}, args.repeats)
  assert _same(t["paged"][1], t["dense"][1]), "the paged engine drew other tokens"
  res["speed"] = {"capacity": args.capacity, "mean_length": float(work.lengths.mean()),
                  "max_length": int(work.lengths.max()), "tokens": tokens,
                  **{f"{k}_tokens_per_s": tokens / v[0] for k, v in t.items()},
                  "paged_over_dense": t["dense"][0] / t["paged"][0],
                  "kv_pages": t["paged"][2].kv_pages}
  print("speed", json.dumps(res["speed"]))

  # 2. Paged time per token at two capacities, one mix that fits both.
  small = Workload(cfg, args, 512, seed=1)
  caps = (512, 16384)
  runs2 = {}
  for c in caps:
    runs2[f"paged@{c}"] = _call(_engine(graphdef, args, kv_pages=args.growth_pages, **paged),
                                state, small, c)
    runs2[f"paged@{c}_default_pool"] = _call(_engine(graphdef, args, **paged), state, small, c)
  t2 = _time(runs2, args.repeats)
  assert all(_same(v[1], t2["paged@512"][1]) for v in t2.values())
  per_tok = {k: 1e6 * v[0] / int(small.lengths.sum()) for k, v in t2.items()}
  res["growth"] = {"mean_length": float(small.lengths.mean()), "pool_pages": args.growth_pages,
                   **{f"{k}_us_per_token": v for k, v in per_tok.items()},
                   **{f"{k}_pages": v[2].kv_pages for k, v in t2.items()},
                   "ratio": per_tok["paged@16384"] / per_tok["paged@512"],
                   "ratio_default_pools": per_tok["paged@16384_default_pool"]
                   / per_tok["paged@512_default_pool"]}
  print("growth", json.dumps(res["growth"]))

  # 3. One KV budget: the dense slots at the capacity, as pages for 4x the slots.
  budget_tokens = args.slots * (args.prompt_len + args.capacity)
  pages = budget_tokens // args.page_size
  wide = _engine(graphdef, args, slots=4 * args.slots, kv_pages=pages, **paged)
  t3 = _time({"paged_budget": _call(wide, state, work, args.capacity)}, 1)
  st = t3["paged_budget"][2]
  assert _same(t3["paged_budget"][1], t["dense"][1])
  res["memory"] = {"budget_tokens": budget_tokens, "dense_slots": args.slots,
                   "paged_slots": 4 * args.slots, "paged_peak_live_slots": st.peak_live_slots,
                   "dense_peak_live_slots": t["dense"][2].peak_live_slots, "kv_pages": pages,
                   "paged_mean_live_slots": st.busy_slot_steps / max(1, st.decode_steps),
                   "dense_mean_live_slots": t["dense"][2].busy_slot_steps / max(
                       1, t["dense"][2].decode_steps),
                   "paged_preemptions": st.preemptions, "paged_min_free_pages": st.min_free_pages,
                   "paged_tokens_per_s": tokens / t3["paged_budget"][0]}
  res["memory"]["live_slots_ratio"] = (res["memory"]["paged_mean_live_slots"]
                                       / res["memory"]["dense_mean_live_slots"])
  print("memory", json.dumps(res["memory"]))

  # 4. Preemption: a pool a sixteenth of the budget for the same 4x slots.
  tight = _engine(graphdef, args, slots=4 * args.slots, kv_pages=pages // 16, **paged)
  t4 = _time({"paged_tight": _call(tight, state, work, args.capacity)}, 1)
  st4 = t4["paged_tight"][2]
  res["preemption"] = {"kv_pages": pages // 16, "preemptions": st4.preemptions,
                       "preempted_tokens": st4.preempted_tokens,
                       "stalled_slot_steps": st4.stalled_slot_steps,
                       "wall_s": t4["paged_tight"][0], "unpreempted_wall_s": t3["paged_budget"][0],
                       "identical_to_dense": _same(t4["paged_tight"][1], t["dense"][1])}
  print("preemption", json.dumps(res["preemption"]))
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(res, f, indent=1)


if __name__ == "__main__":
  main()
