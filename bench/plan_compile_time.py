r"""libtpu compile time of the 32B train step, decoder layers unrolled vs scanned, in one run.

    python bench/plan_compile_time.py                 # docs/scale.md's v5p-64 row, 64 layers
    python bench/plan_compile_time.py --layers 8 --rounds 2

For each layout (`model.scan_layers` false, true; alternating for `--rounds`), a fresh process
lowers and compiles the train step `dapo-plan` compiles (`programs.compile_train_step`) for the
target's TPU topology through libtpu on this host, and reports the compile's wall seconds, the
process's CPU seconds, and the compiled step's peak bytes per chip. Needs libtpu
(`pip install 'jax[tpu]'`); the persistent compilation cache is off, so every round compiles.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW = ["--config", os.path.join(ROOT, "configs", "dapo_qwen2_5_32b.py"),
       "--target", "tpu:v5p:2x4x4", "--config.optim.micro_batch_size=4",
       "--config.rollout.prompts_per_call=16", "--config.rollout.max_concurrent_decodes=256",
       "--config.mesh=data=1,fsdp=-1,tensor=8"]


def child(scan: bool, layers: int, argv: list[str]) -> dict:
  """One compile in this process; returns its figures."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, ROOT)
  from dapo_jax.infra import libtpu_flags  # pylint: disable=g-import-not-at-top
  from dapo_jax.planner import plan as plan_lib  # pylint: disable=g-import-not-at-top
  from dapo_jax.planner import programs as plan_programs  # pylint: disable=g-import-not-at-top
  from dapo_jax.planner import targets as plan_targets  # pylint: disable=g-import-not-at-top
  from dapo_jax.infra import sharding as shd  # pylint: disable=g-import-not-at-top
  from dapo_jax.models import attention  # pylint: disable=g-import-not-at-top
  args = plan_lib._parse(argv)  # pylint: disable=protected-access
  plan_targets.prepare_libtpu_env(args.target)
  spec = plan_lib.configure(args)
  overrides = dict(spec.model.overrides, num_hidden_layers=layers) if layers else \
      spec.model.overrides
  spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, scan_layers=scan,
                                                             overrides=overrides))
  libtpu_flags.apply(spec.tpu_windowed_einsum)
  target = plan_targets.parse_target(args.target)
  mcfg = plan_programs.plan_model_config(spec.model, spec.tokenizer)
  mesh = shd.make_mesh([tuple(a) for a in spec.mesh], devices=list(target.devices))
  start = time.perf_counter()
  with attention.compile_for(target.kind):
    train = plan_programs.compile_train_step(spec, mcfg, mesh)
  wall = time.perf_counter() - start
  usage = resource.getrusage(resource.RUSAGE_SELF)
  cpu = usage.ru_utime + usage.ru_stime
  return {"scan_layers": scan, "layers": mcfg.num_hidden_layers, "wall_s": wall,
          "compile_s": train.get("compile_seconds"), "process_cpu_s": cpu,
          "peak_gib": (train.get("peak") or 0) / 2**30, "oom": train.get("oom")}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: the model's 64)")
  ap.add_argument("--rounds", type=int, default=1)
  ap.add_argument("--_child", default="", help=argparse.SUPPRESS)
  args, rest = ap.parse_known_args()
  argv = rest or ROW
  if args._child:  # pylint: disable=protected-access
    print("RESULT " + json.dumps(child(args._child == "scan", args.layers, argv)))  # pylint: disable=protected-access
    return
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_ENABLE_COMPILATION_CACHE="false")
  rows = []
  for _ in range(args.rounds):
    for layout in ("unrolled", "scan"):
      out = subprocess.run([sys.executable, __file__, "--_child", layout, "--layers",
                            str(args.layers), *argv], env=env, capture_output=True, text=True,
                           check=False)
      line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
      if line is None:
        raise SystemExit(f"{layout} compile failed:\n{out.stderr[-3000:]}")
      rows.append(json.loads(line[len("RESULT "):]))
      r = rows[-1]
      print(f"{layout:9s} {r['layers']} layers: train-step lower+compile {r['wall_s']:.0f} s wall "
            f"(XLA compile {r['compile_s'] or 0:.0f} s), process CPU {r['process_cpu_s']:.0f} s, "
            f"peak {r['peak_gib']:.2f} GiB/chip{' OOM' if r['oom'] else ''}", flush=True)


if __name__ == "__main__":
  main()
