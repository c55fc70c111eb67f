r"""Compiles the paged decode step for one TPU chip of the rollout mesh (libtpu, no TPU needed).

    python bench/paged_decode_compile.py --layers 2        # quick
    python bench/paged_decode_compile.py                   # Qwen2.5-32B, 64 layers, v5p-64 row
    # the continuous engine's whole chunk on v5p-64's mesh (as dapo-plan compiles it), N layers:
    python bench/paged_decode_compile.py --engine_chunk --layers 4 --impl ragged_tpu --slots 256 \
        --pages 35325 [--scan 0]

The model is the chip's share of Qwen2.5-32B under ``tensor`` 8 (5 attention heads, 1 KV head,
1/8 of the MLP and vocabulary: `plan_paged.per_chip_model`), the slots and pool those
`dapo-plan`'s paged estimate reports for the v5p-64 row (``--slots``, ``--pages``). Prints the
compiled memory per chip (weights, pool, temporaries) and whether the Pallas kernel is in the
program. Needs libtpu (pip install 'jax[tpu]').
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
  v5p-64 (fsdp 4, tensor 8) at ``--layers`` layers, ``--pages`` pages per data shard."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from dapo_jax.infra import sharding as shd  # pylint: disable=g-import-not-at-top
  from dapo_jax.models import attention  # pylint: disable=g-import-not-at-top
  target = "tpu:v5p:2x4x4"
  plan_targets.prepare_libtpu_env(target)
  flags = plan_lib._parse([  # pylint: disable=protected-access
      "--config", "configs/dapo_qwen2_5_32b.py", "--target", target,
      f"--config.rollout.max_concurrent_decodes={args.slots}",
      "--config.mesh=data=1,fsdp=-1,tensor=8", f"--config.rollout.attention_impl={args.impl}"])
  spec = plan_lib.configure(flags)
  tgt = plan_targets.parse_target(target)
  mcfg = plan_programs.plan_model_config(spec.model, spec.tokenizer).replace(
      num_hidden_layers=args.layers, scan_layers=bool(args.scan))
  mesh = shd.make_mesh([("data", 1), ("fsdp", -1), ("tensor", 8)], devices=list(tgt.devices))
  paged = plan_paged.engine_spec(spec, mcfg, "tpu", 8, 4, tgt.hbm_bytes, 0)
  paged = dataclasses.replace(paged, num_pages=args.pages)
  with attention.compile_for("tpu"):
    c = plan_programs.compile_continuous_rollout(
        spec, mcfg, mesh, plan_programs.sampling_params(spec.rollout, mcfg), paged)
  gib = 2**30
  print(f"{args.impl} chunk, {args.layers} layers, scan {bool(args.scan)}, {args.slots} slots, "
        f"{args.pages} pages/shard: engine state {c['parts']['engine_state'] / gib:.2f} GiB, "
        f"temporaries {c.get('memory', {}).get('temp', 0) / gib:.2f} GiB per chip, "
        f"oom {c.get('oom')}, kernel calls {c.get('kernel_calls')}")


if __name__ == "__main__":
  main()
