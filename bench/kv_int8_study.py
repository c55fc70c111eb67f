"""The int8 KV cache's accuracy cost on the CPU demo (issue 51), resumable: 160 RL steps x 3 seeds
of configs/tiny_cpu.py from the committed warm starts, three arms:

  default           tiny_cpu.py:dapo (the model's dtype in the cache, no correction)
  int8_tis          tiny_cpu.py:kv_int8 (int8 cache + token-TIS, cap 2)
  int8_uncorrected  tiny_cpu.py:dapo with rollout.kv_cache_dtype=int8 and
                    algorithm.allow_uncorrected_kv_quantization=True (the stress case)

  python bench/kv_int8_study.py                                  # all 9 runs (hours on 2 cores)
  python bench/kv_int8_study.py --arms int8_tis --seeds 0 --max_runs 1
  python bench/kv_int8_study.py --num_steps 2 --eval_every 2 --seeds 0 \\
      --workdir /tmp/kv_int8_smoke --out bench/results/kv_int8_study_smoke.json   # the smoke run

A finished run (its last metrics row at --num_steps) is read, not run again; an interrupted one
resumes from its checkpoint (dapo-train's workdir). Writes ``--out``: per arm and seed the
held-out avg@4 at the start and end and its curve, and per step the sampler/trainer gap
(rollout/logprob_diff_mean, _max, kl_k3) and the TIS weights (rollout/is_weight_min, _max);
per arm the final held-out over seeds and whether int8 + TIS lies in the default's seed range.
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _demo_runs  # noqa: E402  # pylint: disable=wrong-import-position
from _host import cpu_name  # noqa: E402  # pylint: disable=wrong-import-position

TINY = "configs/tiny_cpu.py"
ARMS = {
    "default": (f"{TINY}:dapo", []),
    "int8_tis": (f"{TINY}:kv_int8", []),
    "int8_uncorrected": (f"{TINY}:dapo", ["--config.rollout.kv_cache_dtype=int8",
                                          "--config.algorithm.allow_uncorrected_kv_quantization"
                                          "=True"]),
}
GAP_KEYS = ("rollout/logprob_diff_mean", "rollout/logprob_diff_max", "rollout/kl_k3",
            "rollout/is_weight_min", "rollout/is_weight_max")


def summarize(all_rows: list[dict]) -> dict:
  """One run's held-out curve and per-step gap figures."""
  start, end = _demo_runs.held_out(all_rows)
  curve = [(r["step"], r["eval/avg@4"]) for r in all_rows if "eval/avg@4" in r]
  gap = {k: [r[k] for r in all_rows if k in r] for k in GAP_KEYS}
  means = {k: statistics.fmean(v) for k, v in gap.items() if v}
  return {"held_out_start": start, "held_out": end, "curve": curve, "steps": len(all_rows),
          "gap_per_step": gap, "gap_mean": means,
          "rollout_s": sum(r.get("time/rollout", 0.0) for r in all_rows)}


def main() -> None:
  ap = _demo_runs.parser(__doc__, num_steps=160, seeds="0,1,2", workdir="/tmp/kv_int8_study",
                         out="bench/results/kv_int8_study.json")
  ap.add_argument("--arms", default=",".join(ARMS))
  ap.add_argument("--max_runs", type=int, default=0, help="stop after this many new runs")
  args = ap.parse_args()
  os.makedirs(args.workdir, exist_ok=True)
  result = {"cpu": cpu_name(), "num_steps": args.num_steps, "runs": {}}
  ran = 0
  for seed in (int(s) for s in args.seeds.split(",")):
    for arm in args.arms.split(","):
      config, flags = ARMS[arm]
      name = f"{arm}_seed{seed}"
      done = _demo_runs.rows(os.path.join(args.workdir, name))
      finished = bool(done) and done[-1].get("step") == args.num_steps
      if not finished and args.max_runs and ran >= args.max_runs:
        continue
      workdir = _demo_runs.run(name, config, seed, args, flags)
      ran += not finished
      result["runs"][name] = {"arm": arm, "seed": seed,
                              **summarize(_demo_runs.rows(workdir))}
  final = {arm: [r["held_out"] for r in result["runs"].values()
                 if r["arm"] == arm and r["held_out"] is not None] for arm in ARMS}
  result["held_out_by_arm"] = final
  if final["default"] and final["int8_tis"]:
    lo, hi = min(final["default"]), max(final["default"])
    result["int8_tis_within_default_range"] = all(lo <= x <= hi for x in final["int8_tis"])
  _demo_runs.write(result, args.out)


if __name__ == "__main__":
  main()
