r"""The CPU demo (configs/tiny_cpu.py) synchronous against overlapped (algorithm.max_staleness):
RL steps per hour, trainer and rollout idle, and held-out accuracy, from the committed warm
starts. Resumable: a finished run's workdir is read, not run again. Run it alone (it times).

    python bench/overlap_demo.py --num_steps 40 --layouts sync,async1   # the speed ratio
    python bench/overlap_demo.py --num_steps 160 --seeds 0,1,2 \
        --out bench/results/overlap/demo_160.json                        # accuracy, 3 seeds

Layouts (each a dapo-train run of the demo; --config.x=y after `--` go to every run):
  sync          today's demo: one CPU device, rollout and update take turns
  sync_2dev     two devices, both phases sharded over both, in turns
  sync_split    rollout on device 1, training on device 0, in turns (max_staleness 0)
  async1        the same split, one step off (max_staleness 1, token-TIS behaviour weights)
  async2        the same split, up to two versions behind (max_staleness 2)
  async2_partial  async2 with partial rollouts (samples in flight move on to newer weights)
  async1_coloc  one device, one step off (both phases on it, from two threads)
  async4        split, max_staleness 4 (stress)
  async4_uncorrected  split, max_staleness 4 without the behaviour correction (explicit flag)
  async1_procs  async1 in two processes of one device each (dapo-train --role=train and
                --role=rollout): weights pulled device to device, batches sent host to host;
                its metrics are compared with async1's, step by step
  sync_1core    sync on one core of the host (the other idle): what one phase gets alone
  async1_procs_pinned  async1_procs with each process on a core of its own (training on core
                0, rollout on core 1), so the two phases stop contending for both cores
  async2_partial_procs_pinned  async2_partial the same way, two processes on a core each

Wall time per step is read from the step log lines' timestamps, from the second step to the
last (the first step compiles), so it includes evaluation and checkpoints as a user sees them.
The bound is what perfect overlap of the sync run's own measured phases would give: (rollout +
old log-probs + update + rest) / (max(rollout, old log-probs + update) + rest), where rest is
the sync step's wall time outside the three phases.
"""

from __future__ import annotations

import datetime
import os
import re
import sys

import _demo_runs

SPLIT = ["--config.rollout_devices=1"]
CORRECTED = ["--config.algorithm.rollout_is=token_truncated"]
LAYOUTS = {  # name -> (simulated CPU devices, dapo-train flags)
    "sync": (1, []),
    "sync_2dev": (2, []),
    "sync_split": (2, SPLIT),
    "async1": (2, SPLIT + CORRECTED + ["--config.algorithm.max_staleness=1"]),
    "async2": (2, SPLIT + CORRECTED + ["--config.algorithm.max_staleness=2"]),
    "async2_partial": (2, SPLIT + CORRECTED + ["--config.algorithm.max_staleness=2",
                                               "--config.algorithm.partial_rollouts=True"]),
    "async1_coloc": (1, CORRECTED + ["--config.algorithm.max_staleness=1"]),
    "async4": (2, SPLIT + CORRECTED + ["--config.algorithm.max_staleness=4"]),
    "async4_uncorrected": (2, SPLIT + ["--config.algorithm.max_staleness=4",
                                       "--config.algorithm.allow_uncorrected_staleness=True"]),
    "async1_procs": (1, CORRECTED + ["--config.algorithm.max_staleness=1"]),
    "sync_1core": (1, []),
    "async1_procs_pinned": (1, CORRECTED + ["--config.algorithm.max_staleness=1"]),
    "async2_partial_procs_pinned": (1, CORRECTED + ["--config.algorithm.max_staleness=2",
                                                    "--config.algorithm.partial_rollouts=True"]),
}
# two-process layout -> the one-process layout it equals (None: timing-dependent, no equal)
PROCESSES = {"async1_procs": "async1", "async1_procs_pinned": "async1",
             "async2_partial_procs_pinned": None}
PINNED = {"sync_1core": ({0}, set()), "async1_procs_pinned": ({0}, {1}),
          "async2_partial_procs_pinned": ({0}, {1})}  # layout -> (training, rollout) cores
_TIMING = ("time/", "perf/", "sync/batch_bytes")
_STEP_LINE = re.compile(r"^(\S+ \S+) \S+: step (\d+)/(\d+)")


def _step_times(log_path: str) -> dict[int, float]:
  """Step -> the wall-clock second its log line was written."""
  out = {}
  with open(log_path) as f:
    for line in f:
      m = _STEP_LINE.match(line)
      if m:
        t = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
        out[int(m.group(2))] = t.timestamp()
  return out


def _name(layout: str, seed: int, args) -> str:
  return f"{layout}_s{seed}_{args.num_steps}"


def _run(layout: str, seed: int, args) -> str:
  devices, flags = LAYOUTS[layout]
  peer = f"127.0.0.1:{29400 + seed}" if layout in PROCESSES else ""
  return _demo_runs.run(_name(layout, seed, args), "configs/tiny_cpu.py", seed, args, flags,
                  env={"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"},
                  peer=peer, cpus=PINNED.get(layout))


def _differences(a_dir: str, b_dir: str) -> int:
  """Logged values (timings aside) that differ between two runs, step by step."""
  def by_step(d):
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(_TIMING)}
            for r in _demo_runs.rows(d)}
  a, b = by_step(a_dir), by_step(b_dir)
  return sum(a.get(s, {}).get(k) != b.get(s, {}).get(k)
             for s in set(a) | set(b) for k in set(a.get(s, {})) | set(b.get(s, {})))


def _summary(workdir: str, log_path: str) -> dict:
  all_rows = _demo_runs.rows(workdir)
  rows = [r for r in all_rows if r["step"] > 0]
  times = _step_times(log_path)
  steps = sorted(times)
  first = steps[min(1, len(steps) - 1)]
  wall = (times[steps[-1]] - times[first]) / max(steps[-1] - first, 1)
  # The first two steps compile (the update's programs, then an overlapped rollout's wait
  # for them): averages over the rest.
  tot = lambda k: sum(r.get(k, 0.0) for r in rows[2:])
  n = max(len(rows) - 2, 1)
  out = {"wall_s_per_step": wall, "steps_per_hour": 3600.0 / wall,
         "rollout_s": tot("time/rollout") / n, "old_logprob_s": tot("time/old_logprob") / n,
         "update_s": tot("time/update") / n, "trainer_idle_s": tot("time/trainer_idle") / n,
         "rollout_idle_s": tot("time/rollout_idle") / n,
         "weight_sync_s": tot("time/weight_sync") / n,
         "weight_bytes": rows[-1].get("sync/weight_bytes", 0.0)}
  if "sync/batch_bytes" in rows[-1]:  # two processes: the batch host to host
    out["batch_bytes"] = tot("sync/batch_bytes") / n
  out["trainer_idle_fraction"] = out["trainer_idle_s"] / wall
  if "time/rollout_idle" in rows[-1]:
    out["rollout_idle_fraction"] = out["rollout_idle_s"] / wall
  out["held_out_start"], out["held_out"] = _demo_runs.held_out(all_rows)
  out["gen_batches"] = sum(r.get("sampling/num_gen_batches", 0.0) for r in rows) / len(rows)
  if "staleness/mean" in rows[-1]:
    out["staleness_mean"] = sum(r["staleness/mean"] for r in rows) / len(rows)
    out["behaviour_weight_mean"] = sum(r.get("actor/rollout_is_weight", 1.0)
                                       for r in rows) / len(rows)
  return out


def main() -> None:
  ap = _demo_runs.parser(__doc__, num_steps=40, seeds="0", workdir="/tmp/overlap_demo",
                   out="bench/results/overlap/demo.json")
  ap.add_argument("--layouts", default="sync,sync_split,async1")
  args = ap.parse_args()
  os.makedirs(args.workdir, exist_ok=True)
  seeds = [int(s) for s in args.seeds.split(",")]
  layouts = args.layouts.split(",")
  result = {"command": "python " + " ".join(sys.argv), "runs": {}}
  workdirs = {}
  for seed in seeds:
    for layout in layouts:
      workdirs[layout, seed] = workdir = _run(layout, seed, args)
      result["runs"][f"{layout}_s{seed}"] = _summary(
          workdir, _demo_runs.log_path(_name(layout, seed, args), args))
  for (layout, seed), workdir in workdirs.items():
    same = PROCESSES.get(layout)
    if (same, seed) in workdirs:
      result["runs"][f"{layout}_s{seed}"][f"values_differing_from_{same}"] = _differences(
          workdirs[same, seed], workdir)
  for seed in seeds:
    base = result["runs"].get(f"sync_s{seed}")
    if base is None:
      continue
    rest = base["wall_s_per_step"] - base["rollout_s"] - base["old_logprob_s"] - base["update_s"]
    train_s = base["old_logprob_s"] + base["update_s"]
    base["overlap_bound"] = base["wall_s_per_step"] / (max(base["rollout_s"], train_s) + rest)
    for layout in layouts:
      r = result["runs"][f"{layout}_s{seed}"]
      r["speedup_vs_sync"] = base["wall_s_per_step"] / r["wall_s_per_step"]
  _demo_runs.write(result, args.out)

if __name__ == "__main__":
  main()
