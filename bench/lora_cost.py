r"""LoRA vs full fine-tuning on CPU: update step time, compiled memory, checkpoint bytes, and the
rollout's merge once per step vs applying the adapters inside every decode step.

    nice -n 19 python bench/lora_cost.py [--preset tiny] [--ranks 1,8,32] \
        [--out bench/results/lora_cost.json]

One device (no mesh), bf16 params and compute, fp32 master copy of what is trained, one
mini-batch of `--rows` rows x (`--prompt` + `--response`) tokens in 2 micro-batches. Per variant:
XLA's memory analysis of the compiled `TrainStep` (arguments, outputs, aliased, temporaries),
the median wall time of `--steps` updates after a warm-up one, and the bytes an Orbax save of
(params, opt_state) writes (`TrainCheckpointer`, what dapo-train saves each checkpoint). Then the
rollout side for one LoRA rank: the time of `MergedRolloutWeights` (W + s A B and the cast, once
per step) vs `RolloutWeights` (the cast alone, full fine-tuning), and the static sampler's decode
time with merged weights vs with the adapters applied in every decode step (the adapted graph).

`--parts transfer` (8 simulated devices: `XLA_FLAGS=--xla_force_host_platform_device_count=8`):
the bytes a LoRA run moves from the training to the rollout layout per step, read from the
compiled programs (`sharding.collective_bytes`: what their collectives produce per device, and
`sharding.reshard_cost`), before (merge on the training layout, then move the merged weights)
and after (move the adapters, merge into the base kept in the rollout layout), for a rollout
mesh of its own and for the training mesh read by `SAMPLE_RULES`; and what the resident base
costs per device.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dapo_jax.infra import sharding as shd
from dapo_jax.trainer import train_step as ts
from dapo_jax.checkpoints.orbax import TrainCheckpointer
from dapo_jax.models import cast_params, create_model, get_preset, lora
from dapo_jax.rollout.sampler import Sampler
from dapo_jax.rollout.sampling import SamplingParams
from dapo_jax.rollout.weights import MergedRolloutWeights, RolloutWeights

MIB = 2.0 ** 20


def _batch(rows, prompt, response, vocab, seed=0):
  rng = np.random.RandomState(seed)
  ids = rng.randint(1, vocab, (rows, prompt + response)).astype(np.int32)
  attn = np.ones_like(ids)
  return ts.TrainBatch(
      input_ids=jnp.asarray(ids), attention_mask=jnp.asarray(attn),
      response_mask=jnp.ones((rows, response), jnp.float32),
      old_log_probs=jnp.full((rows, response), -5.0, jnp.float32),
      advantages=jnp.asarray(np.where(np.arange(rows) % 2, 1.0, -1.0), jnp.float32))


def _model(args, rank):
  mcfg = get_preset(args.preset, param_dtype="bfloat16", dtype="bfloat16", remat="full",
                    scan_layers=True)
  model = create_model(mcfg, seed=0)
  if rank:
    lora.add_adapters(model, lora.LoRAConfig(rank=rank, alpha=2.0 * rank), seed=1)
  return model


def _time(fn, n):
  out = []
  for _ in range(n):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    out.append(time.perf_counter() - t0)
  return statistics.median(out)


def train_side(args, rank):
  model = _model(args, rank)
  cfg = ts.TrainConfig(num_micro_batches=2, logit_chunk_size=0, warmup_steps=0)
  graphdef, state = ts.init_train_state(model, cfg)
  batch = _batch(args.rows, args.prompt, args.response, model.config.vocab_size)
  step = ts.TrainStep(graphdef, cfg)
  mem = step.lower(state, batch).compile().memory_analysis()
  state, _ = step(state, batch, 0)  # warm-up (compiles)
  times = []
  for s in range(args.steps):
    t0 = time.perf_counter()
    state, m = step(state, batch, s)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t0)
  with tempfile.TemporaryDirectory() as d:
    ck = TrainCheckpointer(d, async_save=False)
    ck.save(1, state.params, state.opt_state, {"step": 1})
    ck.wait_until_finished()
    ck.close()
    ckpt_bytes = int(subprocess.check_output(["du", "-sb", d]).split()[0])
  n_trained = sum(x.size for x in jax.tree.leaves(state.params))
  return {"rank": rank, "trained_params": int(n_trained),
          "base_params": int(sum(x.size for x in jax.tree.leaves(state.rest))),
          "argument_mib": mem.argument_size_in_bytes / MIB,
          "output_mib": mem.output_size_in_bytes / MIB,
          "alias_mib": mem.alias_size_in_bytes / MIB,
          "temp_mib": mem.temp_size_in_bytes / MIB,
          "peak_mib": (mem.argument_size_in_bytes + mem.output_size_in_bytes
                       - mem.alias_size_in_bytes + mem.temp_size_in_bytes) / MIB,
          "step_s_median": statistics.median(times), "checkpoint_bytes": ckpt_bytes}


def rollout_side(args, rank):
  model = _model(args, 0)
  plain_graphdef, plain_state = nnx.split(model)
  dtype = model.config.jnp_param_dtype
  fp32 = jax.tree.map(lambda x: x.astype(jnp.float32), plain_state)
  to_rollout = RolloutWeights(dtype, None)
  to_rollout(fp32)
  cast_s = _time(lambda: to_rollout(fp32), 5)
  lcfg = lora.LoRAConfig(rank=rank, alpha=2.0 * rank)
  lora.add_adapters(model, lcfg, seed=1)
  graphdef, adapters, base = nnx.split(model, lora.Adapter, ...)
  adapters = jax.tree.map(lambda x: (x + 0.01).astype(jnp.float32), adapters)
  merge = MergedRolloutWeights(dtype, None, lcfg.scale, base=base)
  merge(adapters)
  merge_s = _time(lambda: merge(adapters), 5)
  sp = SamplingParams(max_new_tokens=args.decode_tokens, eos_ids=(), pad_id=0)
  prompts = jnp.asarray(np.random.RandomState(1).randint(1, 100, (args.decode_rows, 16)),
                        jnp.int32)
  mask = jnp.ones(prompts.shape, bool)
  merged_state = merge(adapters)
  adapted_graphdef, adapted_state = nnx.split(nnx.merge(graphdef, adapters, base))
  calls = {}
  for name, gd, st in (("merged", plain_graphdef, merged_state),
                       ("applied_in_decode", adapted_graphdef, adapted_state)):
    gen = Sampler(gd).generate
    calls[name] = lambda gen=gen, st=st: gen(st, prompts, mask, jax.random.key(0), sp,
                                             1).logprobs
    calls[name]()  # compile
  # Interleaved (A B A B ...) so that load from other processes hits both alike.
  times = {name: [] for name in calls}
  for _ in range(args.decode_repeats):
    for name, call in calls.items():
      times[name].append(_time(call, 1))
  out = {f"decode_s_{name}": statistics.median(t) for name, t in times.items()}
  out.update({f"decode_s_{name}_all": t for name, t in times.items()})
  return {"rank": rank, "cast_only_s": cast_s, "merge_and_cast_s": merge_s, **out,
          "decode_rows": args.decode_rows, "decode_tokens": args.decode_tokens}


def _moved(tree, dst) -> dict:
  """Compiles the move of ``tree`` (its arrays' layouts) to ``dst``: collective bytes per
  device, and `reshard_cost`'s source / destination / temporaries."""
  src = jax.tree.map(lambda x: x.sharding, tree)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          tree)
  text = jax.jit(lambda t: t, out_shardings=dst).lower(abstract).compile().as_text()
  cost = shd.reshard_cost(tree, src, dst)
  return {"collective_bytes": shd.collective_bytes(text), "src": cost.src, "dst": cost.dst,
          "temp": cost.temp}


def transfer_side(args, rank, rollout_axes):
  """Bytes moved per step, before and after, training on ``--train_mesh``."""
  axes = lambda spec: [(a, int(n)) for a, n in (kv.split("=") for kv in spec.split(","))]
  train_mesh = shd.make_mesh(axes(args.train_mesh))
  rollout_mesh = shd.make_mesh(axes(rollout_axes))
  mcfg = get_preset(args.preset, param_dtype="bfloat16", dtype="bfloat16", scan_layers=True)
  model = create_model(mcfg, seed=0, mesh=train_mesh)
  lcfg = lora.LoRAConfig(rank=rank, alpha=2.0 * rank)
  lora.add_adapters(model, lcfg, seed=1, mesh=train_mesh)
  _, state = ts.init_train_state(model, ts.TrainConfig(), train_mesh)
  adapters = jax.tree.map(lambda x: x + 0.01, state.params)  # B away from 0
  dtype = mcfg.jnp_param_dtype

  def merge(a, b):
    return cast_params(lora.merge_adapters(b, a, lcfg.scale), dtype)
  merged_sh = shd.state_shardings(jax.eval_shape(merge, adapters, state.rest), rollout_mesh,
                                  shd.SAMPLE_RULES)
  old = jax.jit(merge, out_shardings=merged_sh)
  before_text = old.lower(adapters, state.rest).compile().as_text()
  merged_train = jax.jit(merge, out_shardings=shd.state_shardings(
      jax.eval_shape(merge, adapters, state.rest), train_mesh, shd.TRAIN_RULES))(
          adapters, state.rest)
  new = MergedRolloutWeights(dtype, rollout_mesh, lcfg.scale, base=state.rest)
  same = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(
      jax.tree.leaves(old(adapters, state.rest)), jax.tree.leaves(new(adapters))))
  kernels, _ = new.split_kernels(new.rollout_base(), adapters)
  merge_text = new._fn.lower(new.send(adapters), kernels).compile().as_text()  # pylint: disable=protected-access
  old_s = _time(lambda: old(adapters, state.rest), args.transfer_repeats)
  new_s = _time(lambda: new(adapters), args.transfer_repeats)
  nbytes = lambda t: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(t))
  return {
      "rank": rank, "train_mesh": args.train_mesh, "rollout_mesh": rollout_axes,
      "adapter_bytes": nbytes(adapters), "base_bytes": nbytes(state.rest),
      "before": {"program_collective_bytes": shd.collective_bytes(before_text),
                 "merged_move": _moved(merged_train, merged_sh), "seconds": old_s},
      "after": {"adapter_move": _moved(adapters, new.rollout_shardings(adapters)),
                "merge_collective_bytes": shd.collective_bytes(merge_text),
                "resident_base_bytes_per_device": new.resident_bytes, "seconds": new_s},
      "bitwise_equal": same}


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", default="tiny")
  p.add_argument("--ranks", default="1,8,32")
  p.add_argument("--rows", type=int, default=8)
  p.add_argument("--prompt", type=int, default=32)
  p.add_argument("--response", type=int, default=96)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--decode_rows", type=int, default=16)
  p.add_argument("--decode_tokens", type=int, default=64)
  p.add_argument("--rollout_rank", type=int, default=8)
  p.add_argument("--decode_repeats", type=int, default=7)
  p.add_argument("--parts", default="train,rollout")
  p.add_argument("--train_mesh", default="data=1,fsdp=4,tensor=2")
  p.add_argument("--rollout_meshes", default="data=4,fsdp=1,tensor=2;data=1,fsdp=4,tensor=2")
  p.add_argument("--transfer_rank", type=int, default=8)
  p.add_argument("--transfer_repeats", type=int, default=5)
  p.add_argument("--out", default="")
  args = p.parse_args()
  rows, roll, transfer = [], None, []
  if "train" in args.parts:
    rows = [train_side(args, 0)] + [train_side(args, int(r)) for r in args.ranks.split(",")]
    for r in rows:
      print(json.dumps(r), flush=True)
  if "rollout" in args.parts:
    roll = rollout_side(args, args.rollout_rank)
    print(json.dumps(roll), flush=True)
  if "transfer" in args.parts:
    for rollout_axes in args.rollout_meshes.split(";"):
      transfer.append(transfer_side(args, args.transfer_rank, rollout_axes))
      print(json.dumps(transfer[-1]), flush=True)
  result = {"command": "python bench/lora_cost.py " + " ".join(
      f"--{k}={v}" for k, v in vars(args).items() if k != "out"),
            "backend": jax.default_backend(), "devices": jax.device_count(),
            "train": rows, "rollout": roll, "transfer": transfer}
  if args.out:
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
