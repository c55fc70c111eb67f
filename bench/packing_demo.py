r"""The CPU demo trained packed (optim.packing=True) and padded, from the committed warm starts:
held-out avg@4, the update's and old log-probs' seconds a step, and the packed rows' fill
(issue 49's fidelity check). Resumable: a finished run's workdir is read, not run again. Run it
alone (it times).

    python bench/packing_demo.py --num_steps 4 --seeds 0 --eval_every 0        # smoke
    python bench/packing_demo.py --num_steps 160 --seeds 0,1,2 \
        --out bench/results/packing/demo_160.json                             # the study (hours)

``--response 256`` (the default) is the demo with max_response_length 256: its responses
(about 25 tokens) are then about 10% of a padded row, where packing has something to pack;
``--response 32`` is the demo as configured (responses fill ~65% of a row: packing does not pay,
bench/packing_speed.py). --config.x=y after `--` go to every run. Per run, over steps 3..N (the
first two compile): update_s, old_logprob_s (mean time/update, time/old_logprob), and
held_out (eval/avg@4 after the last step); per seed the packed / padded time ratios;
`held_out_padded_range` is the padded runs' range over seeds, the band the packed runs' should
fall in.
"""

from __future__ import annotations

import os
import sys

import _demo_runs

MODES = {"padded": "False", "packed": "True"}


def _name(mode: str, seed: int, args) -> str:
  return f"r{args.response}_{mode}_s{seed}_{args.num_steps}"


def _run(mode: str, seed: int, args) -> str:
  return _demo_runs.run(_name(mode, seed, args), "configs/tiny_cpu.py", seed, args,
                        [f"--config.optim.packing={MODES[mode]}",
                         f"--config.rollout.max_response_length={args.response}"])


def _summary(workdir: str) -> dict:
  all_rows = _demo_runs.rows(workdir)
  rows = [r for r in all_rows if r["step"] > 0 and "time/update" in r]
  steady = rows[2:] or rows
  mean = lambda k: sum(r.get(k, 0.0) for r in steady) / max(len(steady), 1)
  out = {"steps": len(rows), "update_s": mean("time/update"),
         "old_logprob_s": mean("time/old_logprob"),
         "response_length_mean": mean("response/response_length_mean")}
  if "packing/fill" in rows[-1]:
    out["fill"] = mean("packing/fill")
    out["positions_vs_padded"] = mean("packing/positions_vs_padded")
    out["train_programs"] = rows[-1]["packing/train_programs"]
  out["held_out_start"], out["held_out"] = _demo_runs.held_out(all_rows)
  return out


def main() -> None:
  ap = _demo_runs.parser(__doc__, num_steps=160, seeds="0,1,2", workdir="/tmp/packing_demo",
                         out="bench/results/packing/demo.json")
  ap.add_argument("--response", type=int, default=256)
  args = ap.parse_args()
  os.makedirs(args.workdir, exist_ok=True)
  seeds = [int(s) for s in args.seeds.split(",")]
  result = {"command": "python " + " ".join(sys.argv), "runs": {}, "ratios": {}}
  for seed in seeds:
    for mode in MODES:
      result["runs"][_name(mode, seed, args)] = _summary(_run(mode, seed, args))
    padded, packed = (result["runs"][_name(m, seed, args)] for m in MODES)
    result["ratios"][f"s{seed}"] = {k: packed[k] / padded[k] if padded[k] else None
                                    for k in ("update_s", "old_logprob_s")}
  held = [result["runs"][_name("padded", s, args)]["held_out"] for s in seeds]
  held = [h for h in held if h is not None]
  if held:
    result["ratios"]["held_out_padded_range"] = [min(held), max(held)]
  _demo_runs.write(result, args.out)


if __name__ == "__main__":
  main()
