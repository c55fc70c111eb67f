r"""Compiles the paged decode step for one TPU chip of the rollout mesh (libtpu, no TPU needed).

    python bench/paged_decode_compile.py --layers 2        # quick
    python bench/paged_decode_compile.py                   # Qwen2.5-32B, 64 layers, v5p-64 row
    # the continuous engine's whole chunk on v5p-64's mesh (as dapo-plan compiles it), N layers:
    python bench/paged_decode_compile.py --engine_chunk --layers 4 --impl ragged_tpu --slots 256 \
        --pages 35325 [--scan 0]
    # the same on 16 nodes of 8 H100 (the CUDA plugin's compile-only devices, no GPU needed):
    python bench/paged_decode_compile.py --engine_chunk --target gpu:h100:16x8 --impl pallas_gpu \
        --layers 4 --slots 1024 --pages 35325

The model is the chip's share of Qwen2.5-32B under ``tensor`` 8 (5 attention heads, 1 KV head,
1/8 of the MLP and vocabulary: `plan_paged.per_chip_model`), the slots and pool those
`dapo-plan`'s paged estimate reports for the v5p-64 row (``--slots``, ``--pages``). Prints the
compiled memory per chip (weights, pool, temporaries) and whether the Pallas kernel is in the
program. Needs libtpu (pip install 'jax[tpu]'), or for a gpu: target the CUDA plugin
(pip install 'jax[cuda12]').
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from dapo_jax.planner import plan as plan_lib  # noqa: E402
from dapo_jax.planner import programs as plan_programs  # noqa: E402
from dapo_jax.planner import targets as plan_targets  # noqa: E402
from dapo_jax.planner import plan_paged  # noqa: E402
from dapo_jax.models import get_preset  # noqa: E402


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--topology", default="v5p:2x2x1")
  ap.add_argument("--tensor", type=int, default=8)
  ap.add_argument("--layers", type=int, default=64)
  ap.add_argument("--slots", type=int, default=416, help="slots per data shard")
  ap.add_argument("--pages", type=int, default=35329, help="pool pages per data shard")
  ap.add_argument("--page_size", type=int, default=64)
  ap.add_argument("--max_len", type=int, default=2048 + 20480)
  ap.add_argument("--impl", default="pallas_tpu", help="pallas_tpu, or ragged_tpu (combined pool)")
  ap.add_argument("--scan", type=int, default=1, help="scanned layers (the 32B config's)")
  ap.add_argument("--json", default=None)
  ap.add_argument("--engine_chunk", action="store_true",
                  help="the engine's chunk on the 32B v5p-64 plan's mesh (--slots: all slots)")
  ap.add_argument("--target", default="tpu:v5p:2x4x4",
                  help="--engine_chunk's target: tpu:v5p:2x4x4 or gpu:<h100|h200|a100>:NxG")
  args = ap.parse_args()
  if args.engine_chunk:
    engine_chunk(args)
    return
  plan_targets.prepare_libtpu_env(f"tpu:{args.topology}")
  device = plan_targets.tpu_devices(args.topology)[0]
  mcfg = get_preset("qwen2.5-32b").replace(num_hidden_layers=args.layers, dtype="bfloat16",
                                           param_dtype="bfloat16", scan_layers=bool(args.scan))
  chip = plan_paged.per_chip_model(mcfg, args.tensor)
  out = plan_paged.compile_paged_step(
      chip, device, slots=args.slots, pages=args.pages, page_size=args.page_size,
      max_pages=-(-args.max_len // args.page_size), impl=args.impl)
  out |= {"layers": args.layers, "scan_layers": bool(args.scan), "tensor": args.tensor,
          "topology": args.topology}
  gib = 2**30
  m = out["memory"]
  print(json.dumps(out, indent=1))
  peak = m["argument"] + m["output"] - m["alias"] + m["temp"]
  print(f"per chip: weights {out['weights_bytes'] / gib:.2f} GiB, pool "
        f"{out['pool_bytes'] / gib:.2f} GiB, arguments {m['argument'] / gib:.2f} GiB, "
        f"temporaries {m['temp'] / gib:.2f} GiB, peak {peak / gib:.2f} GiB; Pallas kernel "
        f"calls: {out['custom_calls']}; compile {out['compile_seconds']} s")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)


def engine_chunk(args) -> None:
  """`dapo-plan`'s paged chunk (`programs.compile_continuous_rollout`) for the 32B paper config on
  ``--target`` (v5p-64 by default; fsdp -1, tensor 8) at ``--layers`` layers, ``--pages`` pages
  per data shard. Prints the chunk's memory per device and what its temporaries hold."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  import math  # pylint: disable=g-import-not-at-top
  from dapo_jax.infra import sharding as shd  # pylint: disable=g-import-not-at-top
  from dapo_jax.models import attention  # pylint: disable=g-import-not-at-top
  from dapo_jax.planner import gpu_targets  # pylint: disable=g-import-not-at-top
  target = args.target
  plan_targets.prepare_libtpu_env(target)
  gpu_targets.prepare_cuda_env(target)
  flags = plan_lib._parse([  # pylint: disable=protected-access
      "--config", "configs/dapo_qwen2_5_32b.py", "--target", target,
      f"--config.rollout.max_concurrent_decodes={args.slots}",
      "--config.mesh=data=1,fsdp=-1,tensor=8", f"--config.rollout.attention_impl={args.impl}"])
  spec = plan_lib.configure(flags)
  tgt = plan_targets.parse_target(target)
  if tgt.analytic:
    raise SystemExit(f"{target}: {tgt.why_analytic}")
  mcfg = plan_programs.plan_model_config(spec.model, spec.tokenizer).replace(
      num_hidden_layers=args.layers, scan_layers=bool(args.scan))
  mesh = shd.make_mesh([("data", 1), ("fsdp", -1), ("tensor", 8)], devices=list(tgt.devices))
  shards = math.prod(shd.batch_axes(mesh, shd.SAMPLE_RULES).values())
  paged = plan_paged.engine_spec(spec, mcfg, tgt.kind, 8, shards, tgt.hbm_bytes, 0)
  paged = dataclasses.replace(paged, num_pages=args.pages)
  with attention.compile_for(tgt.kind):
    c = plan_programs.compile_continuous_rollout(
        spec, mcfg, mesh, plan_programs.sampling_params(spec.rollout, mcfg), paged)
  gib = 2**30
  # One layer's K and V pool on a device: its shard's pages, its KV head (8 over tensor 8).
  layer_pool = args.pages * args.page_size * plan_paged.kv_bytes_per_token(
      mcfg.replace(num_hidden_layers=1), 8)
  temp = c.get("memory", {}).get("temp", 0)
  out = {"target": target, "impl": args.impl, "layers": args.layers, "scan": bool(args.scan),
         "slots": args.slots, "pages_per_shard": args.pages, "data_shards": shards,
         "engine_state_bytes": c["parts"]["engine_state"], "temp_bytes": temp,
         "layer_pool_bytes": layer_pool, "pool_bytes": layer_pool * args.layers,
         "memory": c.get("memory"),  # argument / output / alias (donated) / temp bytes
         "oom": c.get("oom"), "kernel_calls": c.get("kernel_calls"),
         "compile_seconds": c.get("compile_seconds")}
  print(json.dumps(out))
  print(f"{args.impl} chunk on {target}, {args.layers} layers, scan {bool(args.scan)}, "
        f"{args.slots} slots, {args.pages} pages/shard: engine state "
        f"{c['parts']['engine_state'] / gib:.2f} GiB, temporaries {temp / gib:.2f} GiB per device "
        f"({temp / (layer_pool * args.layers):.1%} of the pool; one layer's K and V "
        f"{layer_pool / gib:.2f} GiB), oom {c.get('oom')}, kernel calls {c.get('kernel_calls')}, "
        f"compile {c.get('compile_seconds')} s")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
