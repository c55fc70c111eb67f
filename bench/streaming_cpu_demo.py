r"""The CPU demo with streaming vs batch-level dynamic sampling: same seed, same kept groups.

    python bench/streaming_cpu_demo.py                       # 160 steps, prompts_per_call=8
    python bench/streaming_cpu_demo.py --steps 6 --sft-steps 600   # a short version

Runs configs/tiny_cpu.py twice, ``algorithm.sampling_loop`` = "batch" then "stream" (static
sampler, ``rollout.prompts_per_call`` prompts per call, so a call is the unit streaming can skip),
and prints per loop: decoded response tokens and decode slot-steps per kept (trained) group,
prompts sent to the rollout per step (in generation batches), rollout and step time. The two runs
must train on the same groups: every per-step training metric is compared and the run stops
with an error if one differs. Extra ``--config.x=y`` flags go to both runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dapo_jax.train import train_and_evaluate  # noqa: E402  pylint: disable=g-import-not-at-top

_TIMING = ("time/", "perf/")
_DECODE = ("sampling/prompts_admitted", "sampling/gen_batches_admitted",
           "sampling/decoded_tokens", "sampling/decode_slot_steps",
           "sampling/decoded_tokens_per_kept_group", "sampling/slot_utilization",
           "sampling/num_groups_generated", "sampling/kept_ratio", "sampling/all_correct_ratio",
           "sampling/all_wrong_ratio", "sampling/num_groups_kept", "sampling/rollouts_generated",
           "sampling/num_all_correct", "sampling/num_all_wrong", "sampling/surplus_groups")


def _config(args, loop: str):
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location("tiny_cpu", os.path.join(ROOT, "configs",
                                                                         "tiny_cpu.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  c = mod.get_config()
  c.num_steps = args.steps
  c.sft.steps = args.sft_steps
  c.rollout.prompts_per_call = args.prompts_per_call
  c.algorithm.sampling_loop = loop
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


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--steps", type=int, default=160)
  ap.add_argument("--sft-steps", type=int, default=600)
  ap.add_argument("--prompts-per-call", type=int, default=8)
  ap.add_argument("--eval-every", type=int, default=0)
  ap.add_argument("--workdir", default="")
  args, args.overrides = ap.parse_known_args()
  root = args.workdir or tempfile.mkdtemp(prefix="streaming_demo_")
  rows = {}
  for loop in ("batch", "stream"):
    workdir = os.path.join(root, loop)
    train_and_evaluate(_config(args, loop), workdir)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      rows[loop] = [r for r in map(json.loads, f) if r["step"] > 0]
    for r in rows[loop]:
      r["slot_steps_per_kept_group"] = (r["sampling/decode_slot_steps"]
                                        / r["sampling/trained_groups"])
  for b, s in zip(rows["batch"], rows["stream"], strict=True):
    same = {k for k in b if not k.startswith(_TIMING) and k not in _DECODE
            and k != "slot_steps_per_kept_group"}
    moved = sorted(k for k in same if b[k] != s.get(k))
    if moved:
      raise SystemExit(f"step {b['step']}: the loops trained on different groups ({moved[:5]})")
  print(f"{args.steps} RL steps of configs/tiny_cpu.py, prompts_per_call="
        f"{args.prompts_per_call}, identical training metrics in both loops")
  mean = lambda loop, k: float(np.mean([r[k] for r in rows[loop]]))
  keys = ("sampling/decoded_tokens_per_kept_group", "slot_steps_per_kept_group",
          "sampling/gen_batches_admitted", "sampling/slot_utilization", "time/rollout",
          "time/step")
  for k in keys:
    b, s = mean("batch", k), mean("stream", k)
    print(f"  {k:40s} batch {b:10.3f}   stream {s:10.3f}   stream/batch {s / b:.3f}")


if __name__ == "__main__":
  main()
