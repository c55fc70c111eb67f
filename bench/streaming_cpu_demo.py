r"""The CPU demo with streaming vs batch-level dynamic sampling: same seed, same kept groups.

    python bench/streaming_cpu_demo.py --seed 0 \
        --warm-start bench/results/ablation/warm_starts/seed0_sft600   # 160 steps, ~10 min
    python bench/streaming_cpu_demo.py --steps 6                        # a short version (SFT too)
    python bench/streaming_cpu_demo.py --engine static --prompts-per-call 8

Runs configs/tiny_cpu.py (the DAPO recipe, the trainer's default rollout engine unless
``--engine``) twice from the same start, ``algorithm.sampling_loop`` = "batch" then "stream",
and prints per loop: decoded response tokens and decode slot-steps per kept (trained) group,
prompts sent to the rollout per step (in generation batches), rollout and step time (medians
over the steps), and held-out accuracy before and after RL. The two runs must train on the same
groups: every per-step metric of the trained groups (loss, rewards, lengths, clip fractions,
diagnostics of the trained groups) and every evaluation is compared and the run stops with an
error if one differs; the metrics of the generated groups differ by design. A finished run in
``--workdir`` is read back, not rerun. ``--warm-start`` (a HF directory, as
``bench/table1_cpu.py`` writes per seed) skips the supervised phase; the "stream" arm is then
exactly the ablation's DAPO run of that seed, whose held-out result is printed next to it when
``bench/results/ablation`` has it.
On the static engine a call is ``--prompts-per-call`` prompts, the unit streaming can skip.
The summary goes to ``--out`` as JSON. Extra ``--config.x=y`` flags go to both runs.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import table1_cpu  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from dapo_jax.trainer.train import train_and_evaluate  # noqa: E402  pylint: disable=g-import-not-at-top

_TIMING = ("time/", "perf/")
_DECODE = ("sampling/prompts_admitted", "sampling/gen_batches_admitted",
           "sampling/decoded_tokens", "sampling/decode_slot_steps",
           "sampling/decoded_tokens_per_kept_group", "sampling/slot_utilization",
           "sampling/num_groups_generated", "sampling/kept_ratio", "sampling/all_correct_ratio",
           "sampling/all_wrong_ratio", "sampling/num_groups_kept", "sampling/rollouts_generated",
           "sampling/num_all_correct", "sampling/num_all_wrong", "sampling/surplus_groups")
_REPORT = ("sampling/decoded_tokens_per_kept_group", "slot_steps_per_kept_group",
           "sampling/gen_batches_admitted", "sampling/slot_utilization", "time/rollout",
           "time/step")


def _config(args, loop: str):
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location("tiny_cpu", os.path.join(ROOT, "configs",
                                                                         "tiny_cpu.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  c = mod.get_config()
  c.seed = args.seed
  c.num_steps = args.steps
  if args.warm_start:
    c.model.checkpoint = os.path.abspath(args.warm_start)
    c.sft.steps = 0
  elif args.sft_steps is not None:
    c.sft.steps = args.sft_steps
  if args.engine:
    c.rollout.engine = args.engine
  c.rollout.prompts_per_call = args.prompts_per_call
  c.algorithm.sampling_loop = loop
  if args.eval_every is not None:
    c.eval.every = args.eval_every
  c.checkpoint.save_every = args.steps
  c.logging.console = "lines"
  for item in args.overrides:
    key, value = item.removeprefix("--config.").split("=", 1)
    *parents, leaf = key.split(".")
    node = c
    for name in parents:
      node = node[name]
    node[leaf] = type(node[leaf])(json.loads(value) if value[:1] in "[{" else value)
  return c


def _finished(metrics: str, steps: int) -> bool:
  if not os.path.exists(metrics):
    return False
  with open(metrics, encoding="utf-8") as f:
    return any(json.loads(line)["step"] == steps for line in f)


def _about_generated(key: str) -> bool:
  """Metrics of the groups generated (not trained), which streaming decodes fewer of, and the
  sampler's log-prob rounding against the trainer's (rows sit in other slots at other steps)."""
  return (key in _DECODE or "_generated" in key or key.startswith("diag/accepted/")
          or key.startswith("rollout/logprob_diff"))


def _evals(rows: list[dict]) -> dict[int, float]:
  """Held-out avg@k by step (the rows that carry one)."""
  key = next((k for r in rows for k in sorted(r) if k.startswith("eval/avg@")), None)
  return {r["step"]: r[key] for r in rows if key and r.get(key) is not None}


def _ablation_dapo(seed: int, warm_start: str) -> dict | None:
  """The ablation's DAPO result for this seed if it started from these weights, else None."""
  if not warm_start:
    return None
  sha = table1_cpu.weights_hash(warm_start)
  pattern = os.path.join(ROOT, "bench", "results", "ablation", "ch1_ds1_tl1_so1_of0", "seed*.json")
  found = {}
  for path in glob.glob(pattern):
    with open(path, encoding="utf-8") as f:
      found[path] = json.load(f)
  same = [r for r in found.values() if r["seed"] == seed and r["warm_start_sha256"] == sha]
  return {"this_seed": same[0]["after"] if same else None,
          "all_seeds": sorted(r["after"] for r in found.values())}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--steps", type=int, default=160)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--warm-start", default="", help="HF directory: skip SFT, start from it")
  ap.add_argument("--sft-steps", type=int, default=None, help="default: tiny_cpu's")
  ap.add_argument("--engine", default="", help="static or continuous (default: the config's)")
  ap.add_argument("--prompts-per-call", type=int, default=8, help="static engine only")
  ap.add_argument("--eval-every", type=int, default=None, help="default: tiny_cpu's")
  ap.add_argument("--workdir", default="")
  ap.add_argument("--out", default="", help="summary JSON (default: <workdir>/summary.json)")
  args, args.overrides = ap.parse_known_args()
  root = args.workdir or tempfile.mkdtemp(prefix="streaming_demo_")
  rows, evals, engine = {}, {}, None
  for loop in ("batch", "stream"):
    workdir = os.path.join(root, loop)
    config = _config(args, loop)
    engine = config.rollout.engine
    metrics = os.path.join(workdir, "metrics.jsonl")
    if not _finished(metrics, args.steps):  # a finished run in --workdir is read, not rerun
      train_and_evaluate(config, workdir)
    with open(metrics, encoding="utf-8") as f:
      all_rows = [json.loads(line) for line in f]
    evals[loop] = _evals(all_rows)
    rows[loop] = [r for r in all_rows if r["step"] > 0 and "sampling/decode_slot_steps" in r]
    for r in rows[loop]:
      r["slot_steps_per_kept_group"] = (r["sampling/decode_slot_steps"]
                                        / r["sampling/trained_groups"])
  for b, s in zip(rows["batch"], rows["stream"], strict=True):
    same = {k for k in b if not k.startswith(_TIMING) and not _about_generated(k)
            and k != "slot_steps_per_kept_group"}
    moved = sorted(k for k in same if b[k] != s.get(k))
    if moved:
      raise SystemExit(f"step {b['step']}: the loops trained on different groups ({moved[:5]})")
  if evals["batch"] != evals["stream"]:
    raise SystemExit(f"held-out accuracy differs: {evals['batch']} vs {evals['stream']}")
  summary = {"steps": args.steps, "seed": args.seed, "engine": engine,
             "warm_start": os.path.relpath(os.path.abspath(args.warm_start), ROOT)
             if args.warm_start else None,
             "host": table1_cpu.host_info(),
             "held_out": {str(k): v for k, v in sorted(evals["stream"].items())}}
  print(f"{args.steps} RL steps of configs/tiny_cpu.py, seed {args.seed}, engine {engine}: "
        "identical training metrics and evaluations in both loops")
  for k in _REPORT:
    stat = np.median if k.startswith(_TIMING) else np.mean
    b = float(stat([r[k] for r in rows["batch"]]))
    s = float(stat([r[k] for r in rows["stream"]]))
    summary[k] = {"batch": b, "stream": s, "stream/batch": s / b}
    print(f"  {k:40s} batch {b:10.3f}   stream {s:10.3f}   stream/batch {s / b:.3f}"
          f"   ({'median' if stat is np.median else 'mean'} over steps)")
  steps = sorted(evals["stream"])
  if steps:
    print(f"  held-out {steps[0]} -> {steps[-1]}: {evals['stream'][steps[0]]:.3f} -> "
          f"{evals['stream'][steps[-1]]:.3f} (both loops)")
  ref = _ablation_dapo(args.seed, args.warm_start)
  if ref is not None:
    summary["ablation_dapo_after"] = ref
    print(f"  the ablation's DAPO run after RL: this seed {ref['this_seed']}, "
          f"all seeds {ref['all_seeds']}")
  out = args.out or os.path.join(root, "summary.json")
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=1)
  print(f"  summary: {out}")


if __name__ == "__main__":
  main()
