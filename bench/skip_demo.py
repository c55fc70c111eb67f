r"""The CPU demo with the pre-rollout skip filter (algorithm.skip_filter, issue 39) on and off:
decoded tokens per kept group, rollout seconds per step, generation batches per step and
held-out avg@4, on the multi-epoch demo (256 problems, ~50 visits each in 160 steps) and on
today's single-epoch demo, from the committed warm starts. Resumable: a finished run's workdir
is read, not run again. Run it alone (it times).

    python bench/skip_demo.py --num_steps 4 --seeds 0 --eval_every 0   # smoke
    python bench/skip_demo.py --num_steps 160 --seeds 0,1,2 \
        --out bench/results/skip_demo/demo_160.json                     # the study (hours)

Each run is `dapo-train --config configs/tiny_cpu.py[:multi_epoch]` with
`--config.algorithm.skip_filter=True|False`; --config.x=y after `--` go to every run.
Per run it reports, over steps 3..N (the first two compile):
  decoded_tokens_per_kept_group  sum(sampling/decoded_tokens) / sum(sampling/trained_groups)
  rollout_s                      mean time/rollout
  gen_batches                    mean sampling/num_gen_batches (and gen_batches_admitted)
  held_out                       eval/avg@4 after the last step
and per seed the on/off ratios of the first three; `held_out_off_range` is the off runs' range
over seeds, the band the on runs' held-out should fall in.
"""

from __future__ import annotations

import os
import sys

import _demo_runs

DEMOS = {"multi_epoch": "configs/tiny_cpu.py:multi_epoch", "single_epoch": "configs/tiny_cpu.py"}
FILTER = {"off": "False", "on": "True"}


def _name(demo: str, mode: str, seed: int, args) -> str:
  return f"{demo}_{mode}_s{seed}_{args.num_steps}"


def _run(demo_name: str, mode: str, seed: int, args) -> str:
  return _demo_runs.run(_name(demo_name, mode, seed, args), DEMOS[demo_name], seed, args,
                  [f"--config.algorithm.skip_filter={FILTER[mode]}"])


def _summary(workdir: str) -> dict:
  all_rows = _demo_runs.rows(workdir)
  rows = [r for r in all_rows if r["step"] > 0 and "sampling/num_gen_batches" in r]
  steady = rows[2:] or rows  # the first two steps compile
  tot = lambda k, rs=steady: sum(r.get(k, 0.0) for r in rs)
  n = len(steady)
  out = {
      "steps": len(rows),
      "decoded_tokens_per_kept_group": (tot("sampling/decoded_tokens", rows)
                                        / max(tot("sampling/trained_groups", rows), 1.0)),
      # 1 = every decoded group kept: decoded tokens per kept group over decoded per group.
      "decoded_per_kept_vs_ideal": (tot("sampling/num_groups_generated", rows)
                                    / max(tot("sampling/trained_groups", rows), 1.0)),
      "rollout_s": tot("time/rollout") / n,
      "gen_batches": tot("sampling/num_gen_batches", rows) / len(rows),
      "gen_batches_admitted": tot("sampling/gen_batches_admitted", rows) / len(rows),
      "kept_ratio": tot("sampling/kept_ratio", rows) / len(rows),
      "prompts_skipped": (tot("skip/skipped_right", rows) + tot("skip/skipped_wrong", rows))
                         / len(rows),
  }
  if "skip/retried" in rows[-1]:
    retried = tot("skip/retried", rows)
    out["retried_informative_ratio"] = tot("skip/retried_informative", rows) / max(retried, 1.0)
    out["zero_var_share_before"] = tot("skip/zero_var_share_before", rows) / len(rows)
    out["zero_var_share_after"] = tot("skip/zero_var_share_after", rows) / len(rows)
  out["held_out_start"], out["held_out"] = _demo_runs.held_out(all_rows)
  return out


def main() -> None:
  ap = _demo_runs.parser(__doc__, num_steps=160, seeds="0,1,2", workdir="/tmp/skip_demo",
                   out="bench/results/skip_demo/demo.json")
  ap.add_argument("--demos", default="multi_epoch,single_epoch")
  args = ap.parse_args()
  os.makedirs(args.workdir, exist_ok=True)
  seeds = [int(s) for s in args.seeds.split(",")]
  result = {"command": "python " + " ".join(sys.argv), "runs": {}, "ratios": {}}
  for demo in args.demos.split(","):
    for seed in seeds:
      for mode in FILTER:
        workdir = _run(demo, mode, seed, args)
        result["runs"][_name(demo, mode, seed, args)] = _summary(workdir)
      off, on = (result["runs"][_name(demo, m, seed, args)] for m in FILTER)
      result["ratios"][f"{demo}_s{seed}"] = {
          k: on[k] / off[k] if off[k] else None
          for k in ("decoded_tokens_per_kept_group", "rollout_s", "gen_batches")}
    held = [result["runs"][_name(demo, "off", s, args)]["held_out"] for s in seeds]
    held = [h for h in held if h is not None]
    if held:
      result["ratios"][f"{demo}_held_out_off_range"] = [min(held), max(held)]
  _demo_runs.write(result, args.out)

if __name__ == "__main__":
  main()
