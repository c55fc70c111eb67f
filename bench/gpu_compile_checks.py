r"""What the GPU compile of the 32B train step holds, on compile-only CUDA devices (no GPU needed):

    python bench/gpu_compile_checks.py --target gpu:h100:16x8 --layers 2 [--json out.json]

The Qwen2.5-32B paper config's train step (prompt 2,048 + response 20,480 = 22,528 tokens, remat
"full", scanned layers, fsdp 16 x tensor 8) at ``--layers`` layers, as `dapo-plan` compiles it:
the attention kernel "auto" resolves to and the cuDNN custom calls in the compiled HLO (forward,
the forward again where remat recomputes it, backward), the donated bytes (the training state
updated in place) and the memory per device. Needs the CUDA plugin (pip install 'jax[cuda12]').
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import time

from dapo_jax.planner import gpu_targets


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4}


def largest_arrays(hlo: str, top: int = 8) -> list[str]:
  """The biggest distinct array shapes the compiled HLO names (per device), with their GiB:
  what the temporaries are made of (shapes, not liveness)."""
  sizes = {}
  for dtype, dims in re.findall(r"\b(pred|s8|u8|bf16|f16|s32|u32|f32)\[([\d,]+)\]", hlo):
    n = 1
    for d in dims.split(","):
      n *= int(d)
    sizes[f"{dtype}[{dims}]"] = n * _BYTES[dtype]
  big = sorted(sizes.items(), key=lambda kv: -kv[1])[:top]
  return [f"{shape} {size / 2**30:.2f} GiB" for shape, size in big]


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--target", default="gpu:h100:16x8")
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  gpu_targets.prepare_cuda_env(args.target)
  # pylint: disable=g-import-not-at-top,protected-access
  from dapo_jax.infra import sharding as shd
  from dapo_jax.models import attention
  from dapo_jax.planner import plan as plan_lib
  from dapo_jax.planner import programs
  from dapo_jax.planner import targets
  fv = plan_lib._parse(["--config", "configs/dapo_qwen2_5_32b.py", "--target", args.target,
                        "--config.mesh=data=1,fsdp=-1,tensor=8",
                        "--config.optim.micro_batch_size=16", f"--layers={args.layers}"])
  spec = plan_lib.configure(fv)
  tgt = targets.parse_target(args.target)
  if tgt.analytic:
    raise SystemExit(f"{args.target}: {tgt.why_analytic}")
  mcfg = programs.plan_model_config(spec.model, spec.tokenizer)
  mesh = shd.make_mesh([("data", 1), ("fsdp", -1), ("tensor", 8)], devices=list(tgt.devices))
  tokens = spec.sizes.max_length
  with attention.compile_for("gpu"):
    impl = attention.resolve_impl(spec.model.attention_impl, dtype=mcfg.jnp_dtype,
                                  seq_len=tokens, head_dim=mcfg.dim_per_head)
    lowered = programs._train_program(spec, mcfg, mesh)[0]
    start = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - start
  hlo = compiled.as_text()
  calls = collections.Counter(re.findall(r'custom_call_target="(__cudnn\$[A-Za-z]+)"', hlo))
  mem = programs._mem(compiled)
  # Arrays of a whole [T, T] per row: the dense mask (the padding part goes to cuDNN as a bias).
  txt = sorted(set(re.findall(rf"(\w+\[[\d,]*{tokens},{tokens}\])", hlo)))
  out = {"target": args.target, "layers": args.layers, "tokens": tokens, "remat": spec.model.remat,
         "attention_auto": impl, "cudnn_calls": dict(calls),
         "triton_fusions": hlo.count('"__triton"') + hlo.count("__triton_gemm"),
         "TxT_shapes": txt, "largest_arrays": largest_arrays(hlo), "memory": mem,
         "compile_seconds": round(seconds, 1)}
  print(json.dumps(out))
  gib = 2**30
  print(f"train step, {args.layers} layers, {tokens} tokens, remat {spec.model.remat}: attention "
        f"auto = {impl}; cuDNN calls {dict(calls)}; donated {mem['alias'] / gib:.2f} GiB of "
        f"{mem['argument'] / gib:.2f} GiB arguments; temporaries {mem['temp'] / gib:.2f} GiB; "
        f"[T, T] arrays {txt}; compile {seconds:.1f} s")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
